"""Observing a run: metrics writers (JSONL, TensorBoard, W&B) and the console, and the commands that
measure or predict one: bench, plan, doctor, scale, profile summaries, plots and HLO reading."""

"""What a run uses to observe itself: metrics writers (JSONL, TensorBoard, W&B), the console, goodput
and the profiler. The commands that measure or predict a run (bench, plan, doctor, scale, plot) are
in `jaxdist.commands`."""

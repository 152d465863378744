"""Observing a run and the machine: metrics writers (JSONL, TensorBoard, W&B), the console, goodput
and profiles; and what the commands measure or predict: the train step timed (timing: `bench`),
compiled for its memory (memory: `plan`), the mesh's collectives checked (mesh_health: `doctor`),
scaling to N hosts on paper (scaling: `scale`), the compiled HLO's collectives (hlo), the GPUs'
clocks (clocks) and what a save costs the loop (checkpoint_cost)."""

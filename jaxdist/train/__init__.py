"""Training: sharded state, the compiled step, optimizers, precision and the Python `Trainer` (the
`train` command's loop, with its files and signals, is `jaxdist/loop.py`)."""

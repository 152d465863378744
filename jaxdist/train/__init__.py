"""Training: sharded state, the compiled step, optimizers, and the loop."""

"""GPU kernels (Pallas, C++ XLA FFI handlers) and their builder; each falls back to XLA where it can't run."""

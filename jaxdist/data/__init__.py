"""Input: sources, grain pipelines sharded per process, and the global batch on the mesh."""

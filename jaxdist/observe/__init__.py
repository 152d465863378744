"""Observing a run: metrics writers (console, JSONL)."""

"""A deterministic tiny random-weight M3 checkpoint for tests, demos and CI (no downloads)."""

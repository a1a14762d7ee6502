"""zero-offload test suite."""

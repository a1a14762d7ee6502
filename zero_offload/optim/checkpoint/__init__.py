"""The optimizer's checkpoints: torch-layout state dicts and streaming checkpoints."""

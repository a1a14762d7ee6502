"""zero-offload: ZeRO-Offload for PyTorch."""

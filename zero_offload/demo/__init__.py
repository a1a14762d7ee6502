"""The ``zero-offload demo``: a small GPT-style model trained on a generated corpus."""

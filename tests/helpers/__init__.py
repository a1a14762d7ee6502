"""What several test files share: small models and loops (``models.py``), Hugging Face runs
(``hf.py``), ranks spawned on gloo (``dist.py``), hypothesis sizing (``properties.py``) and
the ZeRO-3 scenarios (``zero3*.py``). No tests here."""

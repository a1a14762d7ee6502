"""The optimizer's rule: its hyper-parameters and its tile step (AdamW, ``adamw.py``)."""

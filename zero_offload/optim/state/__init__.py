"""Where optimizer state lives: the state stores (host RAM, NVMe, resident on the device)
and the placement that chooses among them. ``opt.state`` and the placement report are in
``optim/reports/``; state dicts and streaming checkpoints in ``optim/checkpoint/``."""

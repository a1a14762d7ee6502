"""Where optimizer state lives: the state stores (host RAM, NVMe, resident on the device),
the placement that chooses among them, the live ``Optimizer.state`` mapping, state dicts
and streaming checkpoints."""

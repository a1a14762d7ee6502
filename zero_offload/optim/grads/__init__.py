"""Where a bucket's gradient goes: its lifecycle (``GradState``), the device gradient
buffers, the order buckets leave in, and the gradient paths behind one interface
(``path.py``: to the host in tiles, with the host worker's passes and the fp32 accumulator;
or kept on the device). The backward's hooks and routing are ``optim/router.py``."""

"""Framework integrations, each in its own module and imported only when asked for.

- ``zero_offload.integrations.transformers``: ``OffloadTrainer``, a ``transformers.Trainer``
  that builds, clips, checkpoints and resumes ``OffloadAdamW``.
- ``zero_offload.integrations.accelerate``: ``OffloadAccelerator``, an
  ``accelerate.Accelerator`` whose ``prepare``, ``backward`` and ``clip_grad_norm_`` know
  that ``OffloadAdamW`` keeps the gradients on the host.

Nothing here is imported by ``import zero_offload``: neither transformers nor accelerate is
a dependency of the library (DESIGN.md, "nothing imports integrations").
"""

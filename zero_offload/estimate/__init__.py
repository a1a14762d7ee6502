"""Memory estimator: bytes per tier for each way of training a model, and what fits.

Importing it imports neither torch nor numba (``zero-offload --help`` stays fast); planning
the optimizer's pools does, on the first estimate.

Accounting (per rank, ``P`` parameters, ``s`` bytes per element of the training dtype,
``N`` ranks), after the ZeRO paper (Rajbhandari et al., SC'20, section 3.1): weights ``sP``,
gradients ``sP``, and optimizer state ``KP``, ``K`` from the optimizer's rule
(``optim/rule/``): for AdamW ``K = 12`` in mixed precision (fp32 master, two moments) and
``K = 8`` in fp32 (the weights are the master copy), each moment 2 bytes instead of 4 with
``moments_dtype="bfloat16"`` (``OffloadConfig.moments_dtype``):

- no offload (DDP): device ``(2s + K) P``;
- ZeRO-1: device ``2sP + KP/N`` (optimizer state partitioned);
- ZeRO-2: device ``sP + (s + K) P/N`` (gradients partitioned too);
- ZeRO-3: device ``(2s + K) P/N`` (weights partitioned too); with ``s = 2``, ``K = 12`` these
  are the paper's Table 1 (``paper.py``, ``zero-offload estimate --zero-table``);
- ZeRO-Offload (this library): the exact pool sizes of the optimizer ``estimate`` names
  (``optimizer=``: AdamW by default; ``OPTIMIZERS``) from
  ``optim.state.placement.plan_placement`` with everything offloaded: device weights plus the
  gradient buffers, host fp32 master, gradient staging, the rule's state and weight staging;
  the host part is partitioned over ``N`` (each rank updates its own shard; for Adafactor
  and Muon each parameter whole in one rank's shard, ``whole.py``). Given the
  parameters' shapes (a ``ModelShape``, a config or a model), the buckets are planned as the
  optimizer plans them, each slot aligned (Note [slots are aligned] in ``partition.py``);
  from a bare parameter count, buckets are taken as full and gap-free.
- parameter offload (a shape known): the device holds the window of
  ``OffloadConfig(offload_parameters=True)`` (Note [a unit always returns to its slot] in
  ``params/window.py``) instead of the weights, plus the gradient buffers; with several
  ranks, ZeRO-3 with offload (an estimate: not run yet);
- NVMe (``tiered.py``): the state beyond the host budget on disk, as ``plan_nvme`` places it
  (Note [the host budget decides the split] in ``nvme.py``); with parameter offload, the
  homes in RAM (run on one rank) or on NVMe too (an estimate: not run yet). Each row says
  whether the library runs it (``ConfigEstimate.library``). ``north_star.py``: the
  big-models issue's two targets, and the configuration chosen for each (or that none
  fits).

Activations: Note [activation bytes per layer] in ``shape.py``; the logits add
``S b V (s + 4)``. Checkpointing keeps each layer's input plus one layer's activations
while it is recomputed; activation offload moves those inputs to the host and keeps two on
the device. Host memory is per node (``ranks_per_node`` ranks share it); a configuration
fits when its host bytes leave ``host_reserve`` free. "Largest that fits": Note [largest
that fits grows the row's own family] in ``rows.py``.
"""

from .api import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_MICRO_BATCH,
    DEFAULT_SEQ_LEN,
    MOMENTS_DTYPES,
    OPTIMIZERS,
    estimate,
    host_reserve,
    parse_size,
)
from .configs import KNOWN_MODELS, SUPPORTED_MODEL_TYPES, load_config, shape_from_config
from .pools import offload_adamw_bytes, offload_bytes, param_offload_bytes
from .result import ConfigEstimate, LeftOutRow, MemoryEstimate
from .rows import ActivationMode, Configuration
from .shape import ARCHITECTURES, Architecture, ModelShape
from .tiered import CONFIGURATIONS

__all__ = [
    "ARCHITECTURES",
    "CONFIGURATIONS",
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_MICRO_BATCH",
    "DEFAULT_SEQ_LEN",
    "KNOWN_MODELS",
    "MOMENTS_DTYPES",
    "OPTIMIZERS",
    "SUPPORTED_MODEL_TYPES",
    "ActivationMode",
    "Architecture",
    "ConfigEstimate",
    "Configuration",
    "LeftOutRow",
    "MemoryEstimate",
    "ModelShape",
    "estimate",
    "host_reserve",
    "load_config",
    "offload_adamw_bytes",
    "offload_bytes",
    "param_offload_bytes",
    "parse_size",
    "shape_from_config",
]

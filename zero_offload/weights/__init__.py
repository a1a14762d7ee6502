"""Model weights from elsewhere: a parameter's initial weights at construction (on the
device, on the host, or on meta with a checkpoint tensor), and ``load_pretrained``.

Sits below ``optim`` and ``params`` (beside ``views``, which calls ``fill``), so both read a
source the same way.
"""

from .checkpoint import SafetensorsCheckpoint
from .load import load_pretrained
from .source import ConstructionPeaks, PeakTracker, fill, has_source, tracking

__all__ = [
    "ConstructionPeaks",
    "PeakTracker",
    "SafetensorsCheckpoint",
    "fill",
    "has_source",
    "load_pretrained",
    "tracking",
]

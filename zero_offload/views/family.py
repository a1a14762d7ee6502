"""A family of parameters: what one run of buckets is planned from."""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["Family"]


class Family(NamedTuple):
    """The trainable parameters of one param group that share one training dtype: what
    one run of buckets is planned from (a bucket never mixes groups or dtypes)."""

    group: int  # index into param_groups
    dtype: torch.dtype  # the training dtype of every member
    members: list[tuple[int, tuple[int, ...]]]  # (flat parameter index, shape), in order

"""Where a reloaded activation lives on the device: its layout and its storage.

Note [device blocks live as long as their storage]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A reloaded activation is a tensor over its own ``UntypedStorage``, a slice of the device
pool's buffer covering one block. Autograd and checkpoint recomputation may keep views and
detached aliases of it, all sharing that storage; so the block is freed by a finalizer on
the storage, which runs exactly when the last of them is gone. Before freeing, the block
records an event on the compute stream (on CUDA, kernels using the tensor may still be
queued), so the pool hands the bytes to the next reload only after that work. The views the
pool hands out pin these blocks in place: nobody could re-point autograd's tensors.

Note [saved layout comes back]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Autograd saves views as they are: ``scaled_dot_product_attention`` saves the transposed
q/k/v and its logsumexp, a linear layer saves a transposed weight. Backward kernels choose
their path, and so their rounding, by strides (and a BLAS may by pointer alignment): a view
that came back contiguous made a run with activation offload differ from one without at
the ulp level. So an offloaded tensor travels as the storage range its view covers (its
*span*: from its first element to its last, ``1 + sum((size - 1) * stride)`` elements,
the same as its numel for a dense view, a permutation included) and comes back as a view
with the saved shape and strides over a device block, placed so that its data pointer has
the saved one's remainder modulo ``LAYOUT_ALIGN`` bytes (the block is that much longer;
pool blocks start aligned, so an aligned tensor costs nothing more). The cost: a view with
gaps (a slice of a fused projection) moves the bytes between its elements too.

Note [a reloaded view is built on the stream that fills it]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The tensor over a block is made with ``set_``, which touches no byte but which CUDA's
sanitizer records as a write on the current stream (Note [metadata ops are recorded on the
current stream] in accelerator/base.py). The bytes are written next by the copy back on
``h2d`` and read by compute only after waiting for that copy's event, so the view is built
with ``h2d`` current: the order the sanitizer sees is the true one, and nothing is silenced.
The same "write" is declared to the host race checker on the current stream, so a view
built on any other stream fails there, before a GPU run.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from ..accelerator import Accelerator, Stream
from ..activation_sizes import LAYOUT_ALIGN
from ..memory.block import Block

__all__ = ["LAYOUT_ALIGN", "saved_offset", "span_of", "tensor_over_block"]


def span_of(tensor: torch.Tensor) -> int:
    """Elements of storage from ``tensor``'s first element to its last (Note [saved layout
    comes back]); strides are never negative in torch."""
    pairs = zip(tensor.shape, tensor.stride(), strict=True)
    return 1 + sum((size - 1) * stride for size, stride in pairs)


def saved_offset(*, ptr_mod: int, data_ptr: int, itemsize: int, span: int, nbytes: int) -> int:
    """Elements from a device block's start (at ``data_ptr``, ``nbytes`` long) to where the
    reloaded view starts: its data pointer gets the saved one's remainder ``ptr_mod``
    modulo ``LAYOUT_ALIGN`` (Note [saved layout comes back]); 0 when the ``span`` elements
    would not fit after that (a pool buffer not aligned to ``LAYOUT_ALIGN``)."""
    pad = (ptr_mod - data_ptr) % LAYOUT_ALIGN // itemsize
    if (pad + span) * itemsize > nbytes:  # a pool buffer not aligned to LAYOUT_ALIGN
        pad = 0
    return pad


def tensor_over_block(
    block: Block,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    on_free: Callable[[], None],
    *,
    accelerator: Accelerator,
    fill_stream: Stream,
) -> torch.Tensor:
    """A contiguous ``dtype`` tensor of ``shape`` over its own storage slice of ``block``,
    built on ``fill_stream``, the stream that writes the block next (Note [a reloaded view
    is built on the stream that fills it]).

    ``on_free()`` runs when that storage dies; see Note [device blocks live as long as
    their storage].
    """
    flat = block.view(torch.uint8)  # pins the block in place; see the Note
    start = flat.storage_offset()
    storage = flat.untyped_storage()[start : start + block.nbytes]
    with accelerator.stream_context(fill_stream):
        tensor = flat.new_empty(0, dtype=dtype).set_(storage, 0, shape)
        accelerator.declare_access(
            tensor,
            stream=accelerator.current_stream(),
            write=True,
            what="set_ building a reloaded activation's view (a write to CUDA's sanitizer)",
        )
    weakref.finalize(storage, on_free)
    return tensor

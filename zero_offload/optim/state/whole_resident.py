"""Device-resident state for a rule that reads whole parameters (Adafactor, Muon):
``ResidentState``'s fields, plus the parameters' shaped state in the device pool, stepped on
the device one whole parameter at a time.

Note [whole parameters stepped on the device]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A resident bucket (``offload_fraction`` below 1, or ``"auto"``: ``state/placement.py``)
keeps its state on the device and steps it there; an elementwise rule's device step runs
over tiles of ``tile_elements`` (``ResidentState``), which a rule that reads whole
parameters cannot use (Note [rules that read a whole parameter] in ``rule/base.py``). So
for such a rule:

- the store keeps, beside the per-element fp32 fields (the master), the bucket's shaped
  state in one fp32 block of the device pool, laid out as the host store lays its own
  (``ShapedState``: slot after slot, each slot's fields in the rule's order), and shows it
  per slot (``param_state``) to ``state_dict``, ``save_streaming`` and ``opt.state`` as the
  host store does. The planners size the device pool with it: ``_resident_bytes`` in
  ``state/placement.py`` adds ``StateFields.param_state_bytes`` of every slot;
- a step calls the rule's ``device_parameter_step`` once per whole parameter in the runs
  (``whole_parameters``), over views of the master, the shaped state and the fp32 gradient
  accumulator, with torch's operations on the parameters' device (the GPU on CUDA, CPU
  tensors on the host accelerator): Adafactor as ``torch.optim.Adafactor``'s single-tensor
  path, without its host syncs (Note [Adafactor on the device, without a host sync] in
  ``rule/adafactor.py``); a Muon matrix as ``torch.optim.Muon``, Newton-Schulz on the
  device in bf16 as torch runs it for a parameter there (so on CUDA no byte crosses PCIe,
  unlike the host path's round trip: Note [Newton-Schulz where the matmuls are fast] in
  ``kernels/muon.py``), and Muon's other parameters with torch's fused AdamW as
  ``OffloadAdamW``'s resident buckets. The updated master is copied into the weights per
  parameter, as ``ResidentState`` copies each tile;
- the step's temporaries are bounded by the largest parameter stepped, not by a tile
  (Adafactor's variance estimate is as large as its parameter; Newton-Schulz's iterates as
  large as its matrix): the rule says how many bytes (``device_parameter_temporary_bytes``)
  and the store reserves the largest in the device ledger for the update (Note [resident
  temporaries are counted] in ``resident.py``). So that the library does not take that
  room before a step runs, placement keeps it beside the pool (``step_temporaries`` in
  ``placement.py``: ``"auto"`` keeps fewer buckets, a fraction that leaves no room is
  refused at construction), and the device accumulators of micro-batches, taken later,
  leave it free beside their reserve (Note [micro-batches add up on the device] in
  ``grads/device_acc.py``).

What is refused stays refused: resident state on several ranks (for every rule, since it is
not partitioned), and with ``overlap_step`` or parameter offload (``OffloadConfig``).
"""

from __future__ import annotations

from ...accelerator import Event
from ...memory.pool import BlockPool
from ...partition import BucketLayout
from ...views import ParamViews
from ..grads.on_device import DeviceGradients
from ..grads.path import GradSource
from ..publish import Publish
from ..rule.base import Hyper, OptimizerRule, StateFields
from .resident import ResidentState
from .shaped import KeepsShapedState, ShapedState, whole_parameters
from .store import refuse_take_written

__all__ = ["WholeParameterResidentState"]


class WholeParameterResidentState(KeepsShapedState, ResidentState):
    """``ResidentState`` for a rule that is not elementwise; see the module docstring.

    Device fields beyond ``ResidentState``'s:
        _shaped: the shaped state (the rule's ``param_state``) of every slot, slot after
            slot, each slot's fields in order, in one fp32 block of the device pool
            (``ShapedState``).
    """

    def __init__(
        self,
        layout: BucketLayout,
        views: ParamViews,
        *,
        device_pool: BlockPool,
        gradients: DeviceGradients,
        rule: OptimizerRule,
        fields: StateFields,
        tile_elements: int = 1 << 20,
    ) -> None:
        self._shaped = ShapedState(
            layout, fields.fields_of, shard=(0, layout.padded_numel), rule=rule.name
        )
        super().__init__(
            layout,
            views,
            device_pool=device_pool,
            gradients=gradients,
            rule=rule,
            fields=fields,
            tile_elements=tile_elements,
        )
        self.allocate_shaped(device_pool, bucket=layout.index)

    def update(
        self,
        hyper: Hyper,
        grad_scale: float,
        runs: list[tuple[int, int, int]],
        *,
        publish: Publish,
        source: GradSource | None = None,
        after: list[Event] | None = None,
        take_written: bool = False,
    ) -> None:
        """The rule's ``device_parameter_step`` over each whole parameter in the runs, on
        the device (Note [whole parameters stepped on the device])."""
        refuse_take_written(self, take_written)
        stepped = list(whole_parameters(self.layout, runs, 0))
        # Note [resident temporaries are counted]: the largest parameter's, one at a time.
        nbytes = max(
            (
                self.rule.device_parameter_temporary_bytes(slot.shape, hyper, grad_scale)
                for _, slot, _, _, _ in stepped
            ),
            default=0,
        )
        weights = self.views.weights_dev
        grad = self.gradients.grad_acc
        with self._temporaries(nbytes, "step temporaries"):
            for index, slot, lo, hi, step in stepped:
                self.rule.device_parameter_step(
                    {name: tensor[lo:hi] for name, tensor in self.state.items()},
                    self.param_state(index),
                    grad[lo:hi],
                    shape=slot.shape,
                    step=step,
                    hyper=hyper,
                    grad_scale=grad_scale,
                    step_tensor=self._state_step,
                )
                weights[lo:hi].copy_(self.master[lo:hi])

"""The write check at a step's start: which buckets compare fingerprints, and which leave it
to their update (Note [the write check in the update]).

Note [the write check in the update]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A step first takes what was written into the weights since the last one (Note [weights
written outside the optimizer] in views/param_views.py): a fingerprint of every parameter's
slot compared with the one taken after the last update, and ``reconcile_master`` where they
differ. Where the weights are host memory that is a cold xxh3 of every weight byte on the
caller's thread before CPU Adam starts, and another over the tiles as they are published:
on the host side of a GPU machine that is parameter offload, whose pinned home *is* the
weights between uses (about 0.16 ns a parameter for one thread's cold hash against 0.28 ns
for a 16-core host's whole Adam pass, by the H200 run's rates).

But there the update writes the very bytes the check hashes: the home is its ``out``. So
the update's own pass can make the check, element by element, as ``reconcile_master``
would: a master whose weight is not its training-dtype rounding takes the weight (Note [the
update takes the written weights] in kernels/convert.py), before the step uses it, on the
kernel's threads and in its stream (the line is loaded for the store anyway). Bitwise what
the check and ``reconcile_master`` then the update give, with no fingerprint either side:
after the update the bucket's fingerprints are forgotten (``ParamViews.forget``), so
anything else that asks what was written (an announced step's check, a delayed update)
reconciles the bucket by value once, as after a load. Where the home is the fp32 master
itself there is nothing to take: a write is in the master already.

A bucket's check is its update only where all of these hold, decided at the step's start;
every other bucket is checked by fingerprint as before:
- the step is ``step()`` of the immediate update (an announced step checks at the
  announcement and updates during backward; a delayed update publishes later);
- the store's ``reconciles_in_update()``: the parameters are views of the home the update
  writes (under ZeRO-3 each rank's home is its shard, and each rank's update checks the
  shard its fingerprints covered: ``ParamViews.bound_start``), and the rule's kernel takes
  written weights (an elementwise rule: AdamW, Adam,
  Lion, Adagrad; a rule that reads whole parameters reads the master's norm before it
  writes) or the home is the master;
- every parameter of the bucket has a gradient on this rank, so the update's runs cover
  every slot (a slot without one would keep a written weight out of its master, where
  today's step takes it);
- nothing may have written the master itself since the last check (Note [a master written
  outside the optimizer]).
A bucket so chosen that the step does not update after all (a skipped step: an overflow,
no gradient on another rank's say) is reconciled by value when the step ends
(``finish``), so what the master holds after ``step()`` never depends on which check ran.

Note [a master written outside the optimizer]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The two checks agree while the master is the optimizer's own: then a weight that is not its
master's rounding was written. The master can be written too: through ``opt.state[p]
["master"]`` (a live view, writable by design), or by a load that supersedes an announced
step, which stamps the weights that step wrote so that the loaded master wins (``StepPolicy
.superseding_eager``). The fingerprints then keep that master, the weights being
unchanged; the update's comparison would give it the old weights back. So such a bucket
is ``master_exposed``, and its next check is by fingerprint. The flag is set when a view of
the master is handed out and when such a load ends. A bucket whose last check was its
update has no fingerprints (forgotten): handing out a view first makes the check that step
would make, by value, and takes them, so a weight written after that is still seen. The
flag is cleared by a fingerprint check made while no view handed out is alive
(``FlatBucket.master_views``, counted down as the views are collected): a write before
that check is kept by it, and none can follow it.
Version counters cannot tell: the master is a view of a pool whose other views (gradient
staging) are written between steps, and a write through ``.data`` moves none.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...accelerator import Accelerator
from ...views.param_views import changed_params_of
from ..flat_bucket import FlatBucket

__all__ = ["WriteChecks"]


class WriteChecks:
    """The write check of each step (Note [the write check in the update]).

    Fields:
        in_update: layout indices of the buckets whose check this step's update makes,
            until it does (``taken``) or the step ends (``finish``).
    """

    def __init__(self, accelerator: Accelerator) -> None:
        self.accelerator = accelerator
        self.in_update: set[int] = set()

    def check(self, buckets: Sequence[FlatBucket], *, in_update: bool) -> None:
        """At a step's start: each bucket's master takes the weights written since the last
        step, by fingerprint, or (``in_update``, where the bucket can) in its update."""
        for bucket in buckets:  # first, a broken NVMe file refuses: nothing changed
            bucket.store.check_usable()
        self.in_update = set()
        checked = []
        for bucket in buckets:
            if in_update and _checks_in_update(bucket):
                self.in_update.add(bucket.layout.index)
            else:
                checked.append(bucket)
                # Note [a master written outside the optimizer]: a write before this check
                # is kept by it; none can follow while no view is alive
                bucket.master_exposed = bucket.master_views > 0
        # Every bucket's check, read once (Note [one fingerprint pass per bucket]).
        written = changed_params_of([bucket.views for bucket in checked], self.accelerator)
        for bucket, params in zip(checked, written, strict=True):
            if params:
                bucket.reconcile_master()  # Note [a master read after a load]
                bucket.views.remember()
        for bucket in buckets:
            bucket.write_checked()

    def takes(self, bucket: FlatBucket) -> bool:
        """Whether ``bucket``'s update now is its write check (then it is no longer
        pending)."""
        index = bucket.layout.index
        if index not in self.in_update:
            return False
        self.in_update.discard(index)
        return True

    def finish(self, buckets: Sequence[FlatBucket]) -> None:
        """After a step: a bucket whose check was left to an update that did not run takes
        its written weights now, by value."""
        pending, self.in_update = self.in_update, set()
        for bucket in buckets:
            if bucket.layout.index in pending:
                bucket.store.reconcile_master()
                bucket.views.forget()

    def abandon(self) -> None:
        """A step failed: the next one decides again (the weights still hold what was
        written, and a bucket not stepped kept its fingerprints)."""
        self.in_update = set()


def _checks_in_update(bucket: FlatBucket) -> bool:
    """Whether ``bucket``'s update can be its write check (Note [the write check in the
    update]): the store can, every parameter has a gradient, and nothing may have written
    the master (Note [a master written outside the optimizer])."""
    return (
        not bucket.master_exposed
        and bool(bucket.grads.arrived.all())
        and bucket.store.reconciles_in_update()
    )

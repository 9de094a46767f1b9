"""What the units of one sharded model share: groups, plan, iteration state, prefetch orders.

Iteration state heals itself, as FSDP2 resets its own: a *forward pass* starts at the
pre-forward of an outermost unit (one no enclosing unit is running forward for), outside
backward. There, :meth:`ShardingContext.begin_forward_pass` puts every unit back to SHARDED and
IDLE: data gathered by a forward that no backward followed, a prefetch nobody consumed, units
left swapped in by an exception in forward, and the unreduced gradients of a backward that an
exception interrupted (its end-of-backward callback never ran) are all dropped. Gathered data is
therefore valid for one iteration only; the exceptions are what the user asked to keep
(``unshard()``, ``reshard_after_backward=False``).

The end-of-backward callback is queued once per backward, by the first hook that runs in it
(the outermost graph task: nested tasks of reentrant activation checkpointing find it queued).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.autograd import Variable

from ..comm import comm_phase
from ..planning.metadata import ShardingPlan
from .unit import TrainingState

if TYPE_CHECKING:
    from .collectives import PendingReduce
    from .unit import ParamHandle, ShardedUnit

__all__ = ["ShardingContext"]


class ShardingContext:
    """Shared by the units planned together (one model, or the units sharded at one time)."""

    group: Any  # the shard group: owners, all-gather-v and reduce-scatter-v
    rank: int
    world_size: int
    plan: ShardingPlan
    replicate_group: Any  # HSDP: the replicas of this shard group (None without)
    replicate_size: int
    dp_size: int  # gradients are averaged over shard x replicate ranks
    units: list[ShardedUnit]
    auto_prefetch: bool
    forward_order: list[ShardedUnit]  # recorded from the previous pass (same on every rank)
    backward_order: list[ShardedUnit]
    prefetch_log: list[tuple[str, int, int]]  # (phase, issuing unit, prefetched unit), this pass
    backward_active: bool  # a backward touched these units and its final callback has not run
    interrupted_backwards: int  # backwards that never finished (an exception), healed since
    method_depth: int  # inside a method registered with register_fsdp_forward_method

    def __init__(self, group: Any, rank: int, world_size: int, plan: ShardingPlan, replicate_group: Any = None) -> None:
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.plan = plan
        self.replicate_group = replicate_group
        self.replicate_size = 1 if replicate_group is None else dist.get_world_size(replicate_group)
        self.dp_size = world_size * self.replicate_size
        self.units = []
        self.auto_prefetch = True
        self.forward_order = []
        self.backward_order = []
        self.prefetch_log = []
        self.backward_active = False
        self.interrupted_backwards = 0
        self.method_depth = 0
        self._fwd_seq: list[ShardedUnit] = []
        self._bwd_seq: list[ShardedUnit] = []
        self._registrations: dict[tuple[int, str], ParamHandle] | None = None
        self._in_flight: tuple[PendingReduce, Callable[[torch.Tensor], None]] | None = None

    def registrations(self) -> dict[tuple[int, str], ParamHandle]:
        """Where every sharded parameter is registered, ``(id(module), name) -> handle``: fixed
        with the plan, built once (the per-forward registration check reads it)."""
        if self._registrations is None:
            self._registrations = {
                (id(mod), name): h for u in self.units for h in u.handles for mod, name in h.locations
            }
        return self._registrations

    # -- the reduce-scatter in flight -----------------------------------------------------------
    def track_reduce(self, pending: PendingReduce, land: Callable[[torch.Tensor], None]) -> None:
        """Record the reduction just issued; ``land(summed segment)`` writes the gradients.
        One at a time: a unit waits for the previous reduction before issuing its own (FSDP2
        keeps one reduce-scatter's buffers in flight the same way)."""
        assert self._in_flight is None, "a reduce-scatter is already in flight"
        self._in_flight = (pending, land)

    @property
    def reduce_in_flight(self) -> bool:
        """True while an issued reduce-scatter has not landed (during backward only)."""
        return self._in_flight is not None

    def wait_reduce(self) -> None:
        """Land the reduction in flight, if any: before the next one is issued and at the end
        of backward (so ``.grad`` is complete before ``backward()`` returns)."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            pending, land = in_flight
            land(pending.wait())

    def drop_reduce(self) -> None:
        """Complete the reduction in flight (every rank issued it) without landing it: the
        backward that issued it was interrupted, and its gradients are dropped."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            in_flight[0].wait()

    # -- iteration boundaries ------------------------------------------------------------------
    def begin_forward_pass(self) -> None:
        """A new forward pass: every unit back to SHARDED/IDLE (see the module docstring)."""
        self.drop_reduce()  # an interrupted backward's last reduction: completed, not landed
        interrupted = self.backward_active
        if interrupted:
            self.interrupted_backwards += 1
            self.backward_active = False
            self._bwd_seq = []
        for unit in self.units:
            if unit.user_held:
                continue
            if unit.retained and not interrupted:  # kept on purpose after its backward
                unit.training_state = TrainingState.IDLE
                continue
            unit.reset()
        if self._fwd_seq:
            self.forward_order, self._fwd_seq = self._fwd_seq, []
        self.prefetch_log = []

    def begin_backward(self) -> None:
        """Called by every backward hook: queue the end-of-backward callback once."""
        if self.backward_active:
            return
        self.backward_active = True
        Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        self.backward_active = False
        with comm_phase("backward"):
            for unit in self.units:  # same order on every rank
                unit.end_backward()
            self.wait_reduce()
        if self._bwd_seq:
            self.backward_order, self._bwd_seq = self._bwd_seq, []

    # -- prefetch orders -----------------------------------------------------------------------
    def note_forward(self, unit: ShardedUnit) -> None:
        if not any(u is unit for u in self._fwd_seq):
            self._fwd_seq.append(unit)

    def note_backward(self, unit: ShardedUnit) -> None:
        if not any(u is unit for u in self._bwd_seq):
            self._bwd_seq.append(unit)

    @staticmethod
    def _next(order: list[ShardedUnit], unit: ShardedUnit) -> list[ShardedUnit]:
        for i, u in enumerate(order):
            if u is unit:
                return order[i + 1 : i + 2]
        return []

    def next_forward(self, unit: ShardedUnit) -> list[ShardedUnit]:
        return self._next(self.forward_order, unit) if self.auto_prefetch else []

    def next_backward(self, unit: ShardedUnit) -> list[ShardedUnit]:
        return self._next(self.backward_order, unit) if self.auto_prefetch else []

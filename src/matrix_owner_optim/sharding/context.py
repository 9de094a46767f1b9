"""The runtime of one tree of units (:class:`ShardingContext`), as FSDP2's root state.

Made when the tree's plan is fixed (``build.py``) and held by the :class:`~.tree.ShardTree`; the
module hooks call it and it calls the units, never the other way. It keeps what crosses units:
groups, plan, pass orders and prefetch, the one reduction in flight, the end-of-backward
callback (queued once per backward, by the first hook that runs in it) and the iteration
state, which heals at every outermost forward (DESIGN.md, "The lifecycle of a unit").
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import nn
from torch.autograd import Variable

from ..agreement import agree_steps
from ..comm import comm_phase
from ..planning.metadata import ShardingPlan
from ..replica_sync import ReplicaSync, held_pieces, issue_broadcast
from .handle import ParamHandle
from .ignored import is_ignored
from .unit import ReductionInFlight, ShardedState, ShardedUnit, TrainingState
from .unit_options import ShardGroups

__all__ = ["ShardingContext", "TreeSettings"]


class TreeSettings(Protocol):
    """What the context reads of its tree's settings, live (``tree.ShardTree`` is one)."""

    auto_prefetch: bool  # the next-unit prefetch, on or off for the whole tree
    step_watchers: list[weakref.ref[Any]]  # optimizers whose step all-reduces (CheckedSteps)


class CheckedSteps(Protocol):
    """What a forward reads of an optimizer whose step checks its step count
    (``OwnerRoutedOptimizer``, linked by ``agreement.watch_steps``)."""

    _checked_steps: int | None  # step() calls since its first checked step (None: never checked)

    def step_check_groups(self) -> list[tuple[str, Any]]:
        """The groups (with their names) its step opens with the step check over, in order."""
        ...


def _modules_of(members: list[nn.Module]) -> list[nn.Module]:
    """Every module inside ``members``, each once, in ``nn.Module.modules()`` order (one loop)."""
    seen: set[int] = set()
    found: list[nn.Module] = []
    stack = list(reversed(members))
    while stack:
        mod = stack.pop()
        if id(mod) in seen:
            continue
        seen.add(id(mod))
        found.append(mod)
        stack.extend(reversed([c for c in mod._modules.values() if c is not None]))
    return found


class ShardingContext:
    """Drives the units planned together (one ``fully_shard`` tree)."""

    groups: ShardGroups
    plan: ShardingPlan
    units: list[ShardedUnit]
    settings: TreeSettings
    forward_order: list[ShardedUnit]  # recorded from the previous pass (same on every rank)
    backward_order: list[ShardedUnit]
    prefetch_log: list[tuple[str, int, int]]  # (phase, issuing unit, prefetched unit), this pass
    backward_active: bool  # a backward touched these units and its final callback has not run
    interrupted_backwards: int  # backwards that never finished (an exception), healed since
    method_depth: int  # inside a method registered with register_fsdp_forward_method
    nested_modules: set[int]  # modules of a tree nested in this one (nested.py): not this tree's

    def __init__(
        self,
        groups: ShardGroups,
        plan: ShardingPlan,
        units: list[ShardedUnit],
        settings: TreeSettings,
        *,
        nested_modules: set[int] | None = None,
    ) -> None:
        self.groups = groups
        self.nested_modules = nested_modules or set()
        self.plan = plan
        self.units = units
        self.settings = settings
        self.forward_order = []
        self.backward_order = []
        self.prefetch_log = []
        self.backward_active = False
        self.interrupted_backwards = 0
        self.method_depth = 0
        self._fwd_seq: list[ShardedUnit] = []
        self._bwd_seq: list[ShardedUnit] = []
        self._in_flight: ReductionInFlight | None = None
        self._unit_of_module = {id(m): u for u in units for m in u.members}
        self._planned_at: dict[int, dict[str, ParamHandle]] = {}  # id(module) -> name -> handle
        for u in units:
            for h in u.handles:
                for mod, name in h.locations:
                    self._planned_at.setdefault(id(mod), {})[name] = h
        self._walked: dict[int, list[tuple[nn.Module, tuple[nn.Module | None, ...]]]] = {}  # unit -> modules
        self._steps_checked: dict[weakref.ref[Any], int] = {}  # the step count each watcher's last check sent
        self._reduced_since_check = False  # a synced backward reduced gradients since the last step check

    # -- lookups ---------------------------------------------------------------------------------
    def unit_of(self, module: nn.Module) -> ShardedUnit | None:
        """The unit of a module passed to ``fully_shard`` in this tree (None: not one)."""
        return self._unit_of_module.get(id(module))

    def units_in(self, module: nn.Module) -> list[ShardedUnit]:
        """The units whose modules lie inside ``module`` (call order)."""
        inside = {id(m) for m in module.modules()}
        return [u for u in self.units if id(u.module) in inside]

    def check_registrations(self, unit: ShardedUnit) -> None:
        """Refuse parameters registered in ``unit``'s subtree after its plan was fixed (no owner,
        so every rank would train its own copy); at every outermost forward, alike on every rank."""
        nothing: dict[str, ParamHandle] = {}
        for mod in self._modules_in(unit):  # no fqn strings unless wrong
            if id(mod) in self.nested_modules:
                continue
            planned = self._planned_at.get(id(mod), nothing)
            for name, p in mod._parameters.items():
                known = planned.get(name)
                if known is not None and (p is known.sharded or p is known._unsharded):
                    continue  # (the common case first: the planned tensor at its planned place)
                if p is None or is_ignored(p):
                    continue
                mod_name = next(n for member in unit.members for n, m in member.named_modules() if m is mod)
                fqn = f"{mod_name}.{name}" if mod_name else name
                what = "a new tensor was assigned to" if known is not None else "was registered on"
                raise ValueError(
                    f"fully_shard: parameter {fqn!r} (shape {tuple(p.shape)}) {what} "
                    f"{type(unit.module).__name__} after its sharding plan was fixed (by the first "
                    "forward, unshard() or building the optimizer); the plan has no "
                    "owner for it, so its gradient would never be averaged across ranks. Register "
                    "every parameter before that point (sharding is lazy: fully_shard itself fixes "
                    "nothing), or change values in place (load_state_dict / set_model_state_dict)"
                )

    def _modules_in(self, unit: ShardedUnit) -> list[nn.Module]:
        """Every module inside ``unit``'s modules, walked again only where children changed."""
        walked = self._walked.get(unit.index)
        if walked is not None:
            for mod, children in walked:
                if tuple(mod._modules.values()) != children:
                    break
            else:
                return [mod for mod, _ in walked]
        mods = _modules_of(unit.members)
        self._walked[unit.index] = [(mod, tuple(mod._modules.values())) for mod in mods]
        return mods

    def handle_at(self, module: nn.Module, name: str) -> ParamHandle | None:
        """The handle of the parameter the plan registered as ``module.<name>`` (None: none)."""
        return self._planned_at.get(id(module), {}).get(name)

    # -- the hooks -------------------------------------------------------------------------------
    def pre_forward(self, unit: ShardedUnit, backward: bool) -> None:
        """Before ``unit``'s forward (``backward``: its checkpoint recomputation inside backward)."""
        parent = unit.parent
        outermost = parent is None or parent.training_state is not TrainingState.FORWARD
        if not backward and outermost and self.method_depth == 0:
            self.check_registrations(unit)  # input validation: nothing registered since the plan
            self.begin_forward_pass()  # an outermost forward: a new iteration starts clean
        if not backward and unit not in self._fwd_seq:  # (units compare by identity)
            self._fwd_seq.append(unit)
        unit.pre_forward(backward)
        if not backward and not self.groups.moves_nothing:  # one rank: a gather has nothing to overlap
            with comm_phase("forward"):
                self._prefetch("forward", unit, unit.options.forward_prefetch, self.forward_order)
        unit.swap_in()

    def post_forward(self, unit: ShardedUnit, backward: bool, grad: bool) -> None:
        unit.post_forward(backward, grad)

    def pre_backward(self, unit: ShardedUnit) -> None:
        """The first gradient for one of ``unit``'s outputs arrived."""
        self.begin_backward()
        if unit not in self._bwd_seq:
            self._bwd_seq.append(unit)
        unit.pre_backward()
        if not self.groups.moves_nothing:  # one rank: a gather has nothing to overlap
            with comm_phase("backward"):
                self._prefetch("backward", unit, unit.options.backward_prefetch, self.backward_order)
        unit.swap_in()  # an activation-checkpoint recomputation reads the gathered parameters

    def post_backward(self, unit: ShardedUnit) -> None:
        """Every input gradient of one forward of ``unit`` is computed: reduce, then release."""
        self.begin_backward()
        self._finish_gradients(unit)
        unit.release_after_backward()

    # -- prefetch --------------------------------------------------------------------------------
    def _prefetch(
        self, phase: str, unit: ShardedUnit, explicit: list[nn.Module] | None, order: list[ShardedUnit]
    ) -> None:
        if explicit is not None:
            targets = [t for t in (self.unit_of(m) for m in explicit) if t is not None]
        elif self.settings.auto_prefetch:
            at = next((i for i, u in enumerate(order) if u is unit), None)
            targets = order[at + 1 : at + 2] if at is not None else []
        else:
            targets = []
        for t in targets:
            if t is not unit and t.issue_gather():
                self.prefetch_log.append((phase, unit.index, t.index))

    # -- gradients -------------------------------------------------------------------------------
    def _finish_gradients(self, unit: ShardedUnit) -> None:
        """Reduce ``unit``'s gradients (sync on; the one in flight lands first) or accumulate them."""
        if not unit.options.requires_gradient_sync:
            unit.accumulate()
            return
        grads = unit.take_grads()
        if not grads:
            return
        self._reduced_since_check = True
        self.wait_reduce()
        self._in_flight = unit.issue_reduce(grads)

    @property
    def reduce_in_flight(self) -> bool:
        """True while an issued reduce-scatter has not landed (during backward only)."""
        return self._in_flight is not None

    def wait_reduce(self) -> None:
        """Land the reduction in flight, if any (before the next, and at the end of backward)."""
        record, self._in_flight = self._in_flight, None
        if record is not None:
            record.unit.land(record)

    def drop_reduce(self) -> None:
        """Complete the reduction in flight without landing it (its backward was interrupted)."""
        record, self._in_flight = self._in_flight, None
        if record is not None:
            record.pending.wait()

    # -- HSDP: the replicas' broadcasts (replica_sync.py) -----------------------------------------
    @property
    def replicas(self) -> ReplicaSync | None:
        """The tree's replica record (None: no replicate group)."""
        return self.groups.replica_sync

    def replicas_stepped(self, params: Sequence[torch.Tensor], *, deferred: bool) -> None:
        """The global owners stepped ``params``: broadcast their pieces now, or (``deferred``)
        give every unit its broadcast due before its next all-gather."""
        replicas = self.replicas
        if replicas is None:
            return
        replicas.pending = False
        if deferred:
            replicas.generation += 1
        else:
            issue_broadcast(replicas, held_pieces(params)).wait()

    def _replicas_due(self) -> None:
        """HSDP with a plain torch optimizer: gradients landed since the last sync make every
        unit's broadcast due (the global owners may have stepped)."""
        replicas = self.replicas
        if replicas is not None and replicas.pending and not replicas.by_optimizer:
            self.replicas_stepped([h.sharded for u in self.units for h in u.handles], deferred=True)

    def sync_replicas(self) -> None:
        """HSDP: land every unit's due broadcast now, in unit order (reads outside a forward)."""
        self._replicas_due()
        for unit in self.units:
            unit.land_replica_sync()

    # -- iteration boundaries --------------------------------------------------------------------
    def begin_forward_pass(self) -> None:
        """A new forward pass: every unit back to SHARDED/IDLE except HELD and RETAINED data,
        and under HSDP every unit's due broadcast issued asynchronously, in unit order."""
        self.check_steps()  # before this pass's first collective
        self.drop_reduce()  # an interrupted backward's last reduction: completed, not landed
        self._replicas_due()
        interrupted = self.backward_active
        if interrupted:
            self.interrupted_backwards += 1
            self.backward_active = False
            self._bwd_seq = []
        for unit in self.units:
            if unit.held:
                continue
            if unit.state is ShardedState.RETAINED and not interrupted:  # kept on purpose
                unit.training_state = TrainingState.IDLE
                continue
            unit.reset()
        if self._fwd_seq:
            self.forward_order, self._fwd_seq = self._fwd_seq, []
        self.prefetch_log = []
        with comm_phase("forward"):
            for unit in self.units:
                unit.issue_replica_sync()

    def check_steps(self) -> None:
        """The step check that opens a forward pass (DESIGN.md, "Ranks at different steps"): the
        optimizer's step all-reduce (``agreement.agree_steps``) of this rank's step count over each
        group its step checks, at the first forward pass after a step or a synced backward (alike
        on every rank), so a rank at another step meets it and every rank raises by name."""
        for ref in self.settings.step_watchers:
            opt: CheckedSteps | None = ref()
            groups = [] if opt is None else opt.step_check_groups()
            step = opt._checked_steps if opt is not None and groups else None
            if step is None or (self._steps_checked.get(ref) == step and not self._reduced_since_check):
                continue
            self._steps_checked[ref] = step
            device = self.units[0].device if self.units else torch.device("cpu")
            with comm_phase("forward"):
                for among, group in groups:
                    agree_steps(step, among, group, device, who="fully_shard forward (its step check)")
        self._reduced_since_check = False

    def reset_iteration(self) -> None:
        """FSDP2's ``reset_iter_state``: drop the whole iteration (the reduction in flight,
        unreduced and accumulated gradients) and every unit back to SHARDED/IDLE, HELD included."""
        self.drop_reduce()
        if self.backward_active:
            self.interrupted_backwards += 1
            self.backward_active = False
        self._bwd_seq = []
        self._fwd_seq = []
        self.prefetch_log = []
        for unit in self.units:
            unit.reset()
            for h in unit.handles:  # no_sync sums too: the micro-batch sequence is invalidated
                h.accumulated = None

    def begin_backward(self) -> None:
        """Called by every backward hook: queue the end-of-backward callback once."""
        if self.backward_active:
            return
        self.backward_active = True
        Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        """End of the whole backward: reduce what the post-backward hooks did not (the same on
        every rank), release the data unless it is kept, land the last reduction."""
        self.backward_active = False
        with comm_phase("backward"):
            for unit in self.units:  # same order on every rank
                self._finish_gradients(unit)
                unit.training_state = TrainingState.IDLE
                unit.release_after_backward()
            self.wait_reduce()
        if self._bwd_seq:
            self.backward_order, self._bwd_seq = self._bwd_seq, []

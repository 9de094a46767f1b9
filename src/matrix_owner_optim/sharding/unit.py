"""One ``fully_shard`` call's parameters and their data lifecycle (:class:`ShardedUnit`).

Where the unit's data is, is one :class:`ShardedState`, one transition per method, with the
invariants asserted at every transition; which pass runs is a :class:`TrainingState`. DESIGN.md,
"The lifecycle of a unit", draws the states and says what a local-only unit skips; "HSDP: one
global owner per matrix" says when a unit's replica sync is due. The unit never calls up: its
:class:`~.context.ShardingContext` decides when, and lands the :class:`ReductionInFlight` records
the unit returns.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..comm import comm_phase
from ..replica_sync import PendingBroadcast, held_pieces, issue_broadcast
from .collectives import (
    PendingGather,
    PendingReduce,
    SegmentLayout,
    all_gather_v,
    gradient_divide_factors,
    reduce_scatter_v,
)
from .handle import ParamHandle, RegistrationSlots
from .replica_reduce import ReplicaSplit, reduce_across_replicas
from .unit_options import ShardGroups, UnitOptions, compute_dtype, one_compute_dtype

__all__ = ["ReductionInFlight", "ShardedState", "ShardedUnit", "TrainingState", "in_backward"]


def in_backward() -> bool:
    """True while the autograd engine runs (e.g. activation-checkpoint recomputation)."""
    return bool(torch._C._current_graph_task_id() != -1)


class ShardedState(enum.Enum):
    """Where a unit's data is (see the module docstring for the transitions)."""

    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"
    UNSHARDED = "unsharded"
    HELD = "held"  # unshard() by the user: registered until reshard()
    RETAINED = "retained"  # kept after backward for the next forward (reshard_after_backward=False)


class TrainingState(enum.Enum):
    """Which pass the unit is in, as FSDP2's ``TrainingState``."""

    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


@dataclass(frozen=True)
class _GatherInFlight:
    pending: PendingGather
    for_user: bool  # issued by unshard(): lands as HELD


@dataclass(frozen=True)
class ReductionInFlight:
    """A reduce-scatter-v a unit issued and the context has not landed yet."""

    unit: ShardedUnit
    pending: PendingReduce
    layout: SegmentLayout
    post: float  # the division after the sum


class ShardedUnit:
    """The parameters of one ``fully_shard`` call and their data lifecycle."""

    groups: ShardGroups
    index: int
    module: nn.Module  # the first of its modules
    members: list[nn.Module]  # every module of the fully_shard call (FSDP2's list form)
    handles: list[ParamHandle]
    parent: ShardedUnit | None  # the nearest enclosing unit (None: outermost)
    options: UnitOptions
    mp_policy: Any
    is_root: bool
    state: ShardedState
    training_state: TrainingState
    gather_layout: SegmentLayout
    gather_dtype: torch.dtype
    reduce_dtype: torch.dtype
    device: torch.device
    local_only: bool  # one rank, no replicas, compute reads the resident pieces: nothing moves

    def __init__(
        self,
        groups: ShardGroups,
        index: int,
        members: list[nn.Module],
        handles: list[ParamHandle],
        *,
        options: UnitOptions,
        mp_policy: Any,
        is_root: bool,
    ) -> None:
        self.groups = groups
        self.index = index
        self.module = members[0]
        self.members = members
        self.handles = handles
        self.parent = None  # set by build_context (build.py) once every unit of the tree exists
        self.options = options
        self.mp_policy = mp_policy
        self.is_root = is_root
        self.state = ShardedState.SHARDED
        self.training_state = TrainingState.IDLE
        self._gather: _GatherInFlight | None = None
        self._shards = [h.shard for h in handles]
        self.gather_layout = SegmentLayout.build(self._shards, groups.world_size)
        self._reduce_layouts: dict[frozenset[int], SegmentLayout] = {}
        self._replica_splits: dict[int, ReplicaSplit] = {}  # by id of a cached reduce layout
        self._replica_generation = 0  # the tree's ReplicaSync.generation last broadcast
        self._replica_in_flight: PendingBroadcast | None = None
        self._divide: tuple[tuple[torch.dtype, int, float | None], tuple[float, float]] | None = None
        self.rebuild_unsharded()

    def _set(self, state: ShardedState) -> None:
        self.state = state
        assert (self._gather is not None) == (state is ShardedState.GATHERING), (self.index, state)
        if self.handles:
            want = state is ShardedState.UNSHARDED or state is ShardedState.HELD
            assert self._slots.unsharded_registered() == want, (self.index, state)

    def rebuild_unsharded(self) -> None:
        """(Re)create every unsharded tensor and the unit's dtypes from the sharded parameters
        (at creation, and after ``nn.Module._apply`` changed their device or dtype)."""
        if self.state is not ShardedState.SHARDED:
            raise RuntimeError(f"unit {self.index}: rebuild needs the SHARDED state, not {self.state}")
        for h in self.handles:
            h.compute_dtype = compute_dtype(self.mp_policy, h.sharded.dtype)
            h.create_unsharded()
            h.free()
        self._slots = RegistrationSlots(self.handles)
        # (handle, sharded, unsharded), read by the per-forward and per-backward loops
        self._tensors = [(h, h.sharded, h.unsharded) for h in self.handles]
        one = one_compute_dtype(self.index, {h.shard.fqn: h.compute_dtype for h in self.handles})
        self.gather_dtype = one if one is not None else torch.float32
        reduce_dtype = getattr(self.mp_policy, "reduce_dtype", None)
        self.reduce_dtype = reduce_dtype or self.gather_dtype
        self.device = self.handles[0].sharded.device if self.handles else torch.device("cpu")
        self.local_only = self.groups.moves_nothing and all(h.aliases_resident for h in self.handles)

    def sync_requires_grad(self) -> None:
        """Pick up parameters frozen or unfrozen since the last forward (same on every rank).
        The reads are of this package's own tensors' metadata: no ``__torch_function__`` per read."""
        with torch._C.DisableTorchFunctionSubclass():
            for h, sharded, unsharded in self._tensors:
                if sharded.requires_grad is not unsharded.requires_grad:
                    h.sync_requires_grad()

    @property
    def held(self) -> bool:
        """Held by the user (``unshard()``), or a gather the user issued is in flight."""
        return self.state is ShardedState.HELD or (self._gather is not None and self._gather.for_user)

    def reduce_layout(self, indices: frozenset[int]) -> SegmentLayout:
        layout = self._reduce_layouts.get(indices)
        if layout is None:
            keep = {id(self._shards[i]) for i in indices}
            layout = SegmentLayout.build(self._shards, self.groups.world_size, include=lambda s: id(s) in keep)
            self._reduce_layouts[indices] = layout
        return layout

    def replica_split(self, layout: SegmentLayout) -> ReplicaSplit:
        split = self._replica_splits.get(id(layout))
        if split is None:
            split = ReplicaSplit.build(layout, self.groups.rank, self._shards, self.groups.replicate_size)
            self._replica_splits[id(layout)] = split
        return split

    # -- HSDP: the deferred broadcast of stepped matrices -------------------------------------------
    @property
    def replica_due(self) -> bool:
        """Its global owners stepped since this unit last broadcast (the deferred placement)."""
        sync = self.groups.replica_sync
        return sync is not None and self.groups.replicate_size > 1 and self._replica_generation != sync.generation

    def issue_replica_sync(self) -> None:
        """Issue the due broadcast asynchronously (none when nothing is due or it is in flight)."""
        sync = self.groups.replica_sync
        if not self.replica_due or self._replica_in_flight is not None:
            return
        assert sync is not None
        self._replica_generation = sync.generation
        self._replica_in_flight = issue_broadcast(sync, held_pieces([h.sharded for h in self.handles]))

    def land_replica_sync(self) -> None:
        """The stepped values in this rank's pieces: the due broadcast issued (if not yet) and
        completed. Before any read of the pieces (the all-gather's send buffer, state dicts)."""
        self.issue_replica_sync()
        record, self._replica_in_flight = self._replica_in_flight, None
        if record is not None:
            record.wait()

    # -- data ----------------------------------------------------------------------------------
    def issue_gather(self, *, for_user: bool = False) -> bool:
        """SHARDED -> GATHERING: issue the all-gather-v asynchronously (after a due HSDP broadcast
        landed); True if it did. At one rank the unit is GATHERED at once."""
        if self.state is not ShardedState.SHARDED:
            return False
        if not self.local_only:  # (a local-only unit has no replicas: nothing is ever due)
            self.land_replica_sync()
        groups, layout = self.groups, self.gather_layout
        me = groups.rank
        if groups.world_size == 1:  # one rank owns everything: no collective, no send buffer
            if not self.local_only:  # local-only: compute reads the resident pieces, nothing to copy
                with torch.no_grad():
                    for h in self.handles:
                        if not h.aliases_resident:  # a low-precision compute copy
                            h.alloc()
                            h.write(h.local.reshape(-1), None)
            if for_user:
                self._swap(True)
                self._set(ShardedState.HELD)
            else:
                self._set(ShardedState.GATHERED)
            return True
        with torch.no_grad():
            send = torch.empty(layout.sizes[me], dtype=self.gather_dtype, device=self.device)
            mine = [self.handles[e.index].local.reshape(-1).to(self.gather_dtype) for e in layout.entries[me]]
            if mine:
                torch.cat(mine, out=send)
            for h in self.handles:
                h.alloc()
            pending = all_gather_v(send, layout.sizes, me, groups.group, async_op=True)
            assert isinstance(pending, PendingGather)
        self._gather = _GatherInFlight(pending, for_user)
        self._set(ShardedState.GATHERING)
        return True

    def wait_gather(self) -> None:
        """-> GATHERED (HELD if the user issued it; UNSHARDED and HELD stay): every rank's segment
        lands in the unsharded tensors, issued now if nothing was in flight."""
        if self.state in (ShardedState.GATHERED, ShardedState.UNSHARDED, ShardedState.HELD):
            return
        if self.state is ShardedState.RETAINED:
            self._set(ShardedState.GATHERED)
            return
        self.issue_gather()
        if self._gather is None:  # one rank: gathered without a collective
            return
        record, self._gather = self._gather, None
        layout, me = self.gather_layout, self.groups.rank
        with torch.no_grad():
            parts = record.pending.wait()
            dsts: list[torch.Tensor] = []
            srcs: list[torch.Tensor] = []
            for r in range(self.groups.world_size):
                for e in layout.entries[r]:
                    h = self.handles[e.index]
                    if e.length == 0 or (r == me and h.aliases_resident):
                        continue  # nothing to copy (an empty copy into a view still bumps its version)
                    data = h.unsharded_data
                    dst = data if e.rows is None else data[e.rows[0] : e.rows[1]]
                    dsts.append(dst)
                    srcs.append(parts[r][e.offset : e.offset + e.length].view(dst.shape))
            if dsts:  # copy-out in one foreach kernel; autograd's saved versions stay valid
                written = tuple(h.unsharded_data for h in self.handles if not h.aliases_resident)
                with torch.autograd._unsafe_preserve_version_counter(written):
                    torch._foreach_copy_(dsts, srcs)
        if record.for_user:
            self._swap(True)
            self._set(ShardedState.HELD)
        else:
            self._set(ShardedState.GATHERED)

    def _swap(self, unsharded: bool) -> None:
        self._slots.swap(unsharded)

    def swap_in(self) -> None:
        """GATHERED -> UNSHARDED: register the unsharded tensors for compute."""
        if self.state in (ShardedState.UNSHARDED, ShardedState.HELD):
            return
        if self.state is not ShardedState.GATHERED:
            raise RuntimeError(f"unit {self.index}: swap_in needs gathered data, state is {self.state}")
        self._swap(True)
        self._set(ShardedState.UNSHARDED)

    def swap_out(self) -> None:
        """UNSHARDED -> GATHERED: register the sharded parameters again (data stays valid)."""
        if self.state is ShardedState.UNSHARDED:
            self._swap(False)
            self._set(ShardedState.GATHERED)

    def free(self) -> None:
        """Any state -> SHARDED: an issued gather is completed and dropped, storage released
        (HELD too: :meth:`release` is the user's way back)."""
        if self.state is ShardedState.HELD:
            self._swap(False)
            self.state = ShardedState.GATHERED
        self.swap_out()
        if self._gather is not None:  # a prefetch nobody consumed: finish it, then drop it
            self._gather.pending.wait()
            self._gather = None
        if not self.local_only:  # local-only: every unsharded tensor aliases its resident piece
            for h in self.handles:
                h.free()
        self._set(ShardedState.SHARDED)

    def hold(self) -> None:
        """The user's ``unshard()`` completes: gathered, registered, kept until :meth:`release`."""
        if self.state is ShardedState.HELD:
            return
        self.wait_gather()
        if self.state is ShardedState.GATHERED:
            self._swap(True)
        if self.state is not ShardedState.HELD:
            self._set(ShardedState.HELD)

    def release(self) -> None:
        """The user's ``reshard()``: back to SHARDED whatever the state."""
        self.free()

    def retain(self) -> None:
        """After backward with ``reshard_after_backward=False``: swap out, keep the data."""
        self.swap_out()
        if self.state is ShardedState.GATHERED:
            self._set(ShardedState.RETAINED)

    def reset(self) -> None:
        """Back to SHARDED and IDLE, dropping gradients a failed backward left unreduced."""
        for _, _, unsharded in self._tensors:
            unsharded.grad = None
        self.free()
        self.training_state = TrainingState.IDLE

    # -- gradients ----------------------------------------------------------------------------
    def take_grads(self) -> dict[int, torch.Tensor]:
        """The gradients to reduce now (accumulated sum plus this backward's), cleared from the
        handles; frozen and unused parameters have none (their ``grad`` stays None)."""
        grads: dict[int, torch.Tensor] = {}
        for i, (h, _, unsharded) in enumerate(self._tensors):
            if h.tp or h.accumulated is not None:  # a TP slice to take, or a sum to add to
                g = h.take_grad()
            else:  # the common case, ParamHandle.take_grad without the calls
                g = unsharded.grad
                if g is not None:
                    unsharded.grad = None
            if g is not None:
                grads[i] = g
        return grads

    def _divide_factors(self) -> tuple[float, float]:
        """:func:`.collectives.gradient_divide_factors` of the unit's reduce dtype, data-parallel
        size and ``gradient_divide_factor`` (computed again only when one of them changed)."""
        key = (self.reduce_dtype, self.groups.dp_size, self.options.gradient_divide_factor)
        if self._divide is None or self._divide[0] != key:
            self._divide = (key, gradient_divide_factors(*key))
        return self._divide[1]

    def accumulate(self) -> None:
        """Gradient sync off: move this backward's gradients into the accumulators."""
        for h in self.handles:
            h.accumulate(self.reduce_dtype)

    def issue_reduce(self, grads: dict[int, torch.Tensor]) -> ReductionInFlight | None:
        """Reduce-scatter-v ``grads`` (from :meth:`take_grads`) asynchronously: the average lands
        on the owners when the context lands the returned record (under HSDP after crossing the
        replicas). At one rank without replicas it lands now and nothing is returned."""
        groups = self.groups
        W, me = groups.world_size, groups.rank
        pre, post = self._divide_factors()
        if groups.moves_nothing:
            # landing reads and writes only this package's own tensors' metadata and .grad: no
            # __torch_function__ per read (a third of a one-rank backward's own cost otherwise)
            reduce_dtype, divide, handles = self.reduce_dtype, pre * post != 1, self.handles
            hooked = False
            with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
                for i, g in grads.items():
                    h = handles[i]
                    if g.dtype is not reduce_dtype:
                        g = g.to(reduce_dtype)  # round as the reduction would
                    if divide:  # a custom divide factor (one rank: nothing summed)
                        g = g.div(pre).div_(post)
                    sharded = h.sharded
                    if g.dtype is not sharded.dtype:
                        g = g.to(sharded.dtype)
                    h.add_grad(g)
                    # no parameter with a hook now: none runs, so none can register another
                    hooked = hooked or bool(sharded._post_accumulate_grad_hooks)
            if hooked:
                for i in sorted(grads):
                    handles[i].run_post_accumulate_grad_hooks()
            return None
        layout = self.reduce_layout(frozenset(grads))
        with torch.no_grad(), comm_phase("backward"):
            # one buffer, others' segments first, filled by one concatenation kernel
            order = [r for r in range(W) if r != me] + [me]
            pieces = []
            for r in order:
                for e in layout.entries[r]:
                    g = grads[e.index]
                    if e.rows is not None:
                        g = g[e.rows[0] : e.rows[1]]
                    pieces.append(g.reshape(-1).to(self.reduce_dtype))
            flat = torch.empty(layout.total, dtype=self.reduce_dtype, device=self.device)
            if pieces:
                torch.cat(pieces, out=flat)
            if pre != 1:
                flat.div_(pre)
            pending = reduce_scatter_v(flat, layout.sizes, me, groups.group, async_op=True)
            assert isinstance(pending, PendingReduce)
        return ReductionInFlight(self, pending, layout, post)

    def land(self, record: ReductionInFlight) -> None:
        """A completed reduce-scatter-v lands as ``.grad`` of the sharded parameters (summed into
        existing ones; an empty piece off the owner, as FSDP2), then each reduced parameter's
        post-accumulate-grad hooks run once, in parameter order."""
        assert record.unit is self
        groups = self.groups
        total = record.pending.wait()
        with torch.no_grad(), comm_phase("backward"), torch._C.DisableTorchFunctionSubclass():
            if groups.replicate_group is not None and groups.replicate_size > 1 and total.numel():
                reduce_across_replicas(total, self.replica_split(record.layout), groups)
            if record.post != 1:
                total.div_(record.post)
            landed: set[int] = set()
            for e in record.layout.entries[groups.rank]:
                h = self.handles[e.index]
                landed.add(e.index)
                if groups.steps_here(h.shard):  # HSDP: another replica's holder steps it
                    h.add_grad(total[e.offset : e.offset + e.length].view(h.local.shape).to(h.sharded.dtype))
            reduced = sorted({e.index for es in record.layout.entries for e in es})
            reduced = [i for i in reduced if groups.steps_here(self.handles[i].shard)]
            for i in reduced:
                if i not in landed:
                    h = self.handles[i]
                    if h.sharded.grad is None:
                        h.add_grad(torch.zeros_like(h.local))
        for i in reduced:  # user code: outside this method's no_grad
            self.handles[i].run_post_accumulate_grad_hooks()

    # -- the unit's part of each hook (the context calls these) --------------------------------
    def pre_forward(self, backward: bool) -> None:
        """Forward (or a checkpoint recomputation, ``backward=True``) is about to read the
        weights: pick up frozen parameters, gather (or consume a prefetch)."""
        if not backward and not self.held:
            self.sync_requires_grad()
        if not backward:
            self.training_state = TrainingState.FORWARD
        if self.local_only:  # no collective to attribute to a phase
            self.wait_gather()
            return
        with comm_phase("backward" if backward else "forward"):
            self.wait_gather()

    def post_forward(self, backward: bool, grad: bool) -> None:
        """Swap out; free unless a backward will read the data (``grad``) and the unit keeps it
        (``reshard_after_forward=False``, or the root, as FSDP2's root stays for backward).
        In a recomputation (``backward``) the unit stays swapped in until its post-backward."""
        if backward:
            return
        self.training_state = TrainingState.IDLE
        if self.held:
            return
        self.swap_out()
        if not grad or (self.options.reshard_after_forward and not self.is_root):
            self.free()

    def pre_backward(self) -> None:
        """The first gradient for one of this unit's outputs arrived: gather again if freed."""
        self.training_state = TrainingState.BACKWARD
        if self.local_only:  # no collective to attribute to a phase
            self.wait_gather()
            return
        with comm_phase("backward"):
            self.wait_gather()

    def release_after_backward(self) -> None:
        """Free, or keep for the next micro-batch (``reshard_after_backward=False``); a unit the
        user holds stays."""
        if self.held:
            return
        if self.options.reshard_after_backward:
            self.free()
        else:
            self.retain()

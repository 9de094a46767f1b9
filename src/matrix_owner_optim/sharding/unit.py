"""One ``fully_shard`` call's parameters and their data lifecycle, as one explicit state.

A *unit* is the set of parameters one ``fully_shard`` call manages. Where its data is, is one
:class:`ShardedState`, one transition per method::

    SHARDED    owner: full tensor resident; others: an empty piece (row blocks for ``rows``);
      |        the sharded parameters are registered on the modules
      | issue_gather()      all-gather-v issued asynchronously (prefetch, unshard(async_op=True))
    GATHERING  storage of the unsharded tensors allocated, the collective in flight (a record)
      | wait_gather()       (SHARDED -> GATHERED directly when nothing was issued)
    GATHERED   every rank holds valid full tensors; the sharded parameters are still registered
      | swap_in()
    UNSHARDED  the unsharded tensors are registered: forward / backward compute reads them
      | swap_out(), free()  back to SHARDED: non-aliased storage released in place

and two states that keep gathered data past the point where it is normally freed, because the
user asked for it:

    HELD       unshard() by the user: gathered and registered until reshard() (``hold`` /
               ``release``); forward, backward and the next forward pass leave it alone
    RETAINED   gathered after a backward with ``reshard_after_backward=False``: swapped out,
               kept for the next micro-batch's forward (which swaps it in without a gather)

Invariants (asserted at every transition): a gather record exists exactly in GATHERING; the
unsharded tensors are registered exactly in UNSHARDED and HELD.

Under HSDP with the broadcast deferred (``replica_sync.py``, placement ``"forward"``) a unit
also has a *pending replica sync*, orthogonal to the states above: due when its tree's
``ReplicaSync.generation`` moved past the one it last broadcast (:attr:`ShardedUnit.replica_due`),
issued asynchronously (:meth:`ShardedUnit.issue_replica_sync`, at the start of a forward pass)
and landed (:meth:`ShardedUnit.land_replica_sync`) before :meth:`ShardedUnit.issue_gather` reads
the unit's pieces, so every replica gathers the stepped values.

The unit never calls up: the :class:`~.context.ShardingContext` that owns it decides *when*
(hooks, prefetch, one reduction in flight) and calls these methods; a reduction the unit issues
comes back as a :class:`ReductionInFlight` record that the context lands later. What the unit
needs of its process groups is a :class:`ShardGroups` value, and the options the user sets on
its module are a :class:`UnitOptions` record the unit reads.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import comm
from ..comm import comm_phase
from ..planning.metadata import MatrixShard
from ..replica_sync import PendingBroadcast, ReplicaSync, held_pieces, issue_broadcast, steps_here
from .collectives import (
    PendingGather,
    PendingReduce,
    SegmentLayout,
    all_gather_v,
    gradient_divide_factors,
    reduce_scatter_v,
)
from .handle import ParamHandle

__all__ = [
    "ReductionInFlight",
    "ShardGroups",
    "ShardedState",
    "ShardedUnit",
    "TrainingState",
    "UnitOptions",
    "compute_dtype",
    "in_backward",
    "one_compute_dtype",
]


def compute_dtype(mp_policy: Any, dtype: torch.dtype) -> torch.dtype:
    """The dtype a parameter of ``dtype`` computes and is gathered in: the policy's
    ``param_dtype`` for floating-point parameters, else its own."""
    param_dtype = getattr(mp_policy, "param_dtype", None)
    return param_dtype if (param_dtype is not None and dtype.is_floating_point) else dtype


def one_compute_dtype(unit: int, dtypes: dict[str, torch.dtype]) -> torch.dtype | None:
    """The one compute dtype of a unit's parameters (``fqn -> dtype``; one all-gather buffer),
    None for a unit without parameters; a mix is refused, naming every parameter."""
    if len(set(dtypes.values())) > 1:
        names = ", ".join(f"{fqn}: {dt}" for fqn, dt in dtypes.items())
        raise NotImplementedError(
            f"fully_shard unit {unit} mixes parameter dtypes ({names}); give the unit one "
            "dtype or set MixedPrecisionPolicy(param_dtype=...) so all compute in one dtype"
        )
    return next(iter(dtypes.values()), None)


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
class ShardGroups:
    """The process groups a tree of units runs on (the same for all its units)."""

    group: Any  # the shard group: owners, all-gather-v and reduce-scatter-v
    rank: int
    world_size: int
    replicate_group: Any = None  # HSDP: the replicas of this shard group
    replicate_size: int = 1
    replicate_rank: int = 0  # HSDP: this process's replica
    replica_sync: ReplicaSync | None = None  # HSDP: the tree's replica record (replica_sync.py)

    def steps_here(self, shard: MatrixShard) -> bool:
        """Whether this replica's holder of ``shard`` gets its averaged gradient and steps it
        (HSDP gives each matrix one global owner: ``MatrixShard.step_replica``)."""
        return steps_here(shard, self.replica_sync)

    @property
    def dp_size(self) -> int:
        """Gradients are averaged over shard x replicate ranks."""
        return self.world_size * self.replicate_size


@dataclass(eq=False)
class UnitOptions:
    """What the user set on a ``fully_shard`` module (its ``set_*`` methods record here; the
    unit and the context read it when they act, so a setter never needs the plan)."""

    reshard_after_forward: bool
    requires_gradient_sync: bool = True
    reshard_after_backward: bool = True
    gradient_divide_factor: float | None = None  # None: the data-parallel size (the average)
    forward_prefetch: list[nn.Module] | None = None  # explicit targets; None: automatic
    backward_prefetch: list[nn.Module] | None = None


@dataclass(frozen=True)
class ReplicaSplit:
    """How one rank's reduced segment crosses the replicas (HSDP): the ranges each replica's
    holders step (``step_replica``: reduce-scattered, each to its replica) and the ranges every
    replica steps (tail, ``rows``, frozen: all-reduced). Ranges are (offset, length) in the segment."""

    by_replica: tuple[tuple[tuple[int, int], ...], ...]
    everywhere: tuple[tuple[int, int], ...]

    @classmethod
    def build(cls, layout: SegmentLayout, rank: int, shards: list[MatrixShard], replicas: int) -> ReplicaSplit:
        by: list[list[tuple[int, int]]] = [[] for _ in range(replicas)]
        everywhere: list[tuple[int, int]] = []
        for e in layout.entries[rank]:
            r = shards[e.index].step_replica
            (everywhere if r is None else by[r]).append((e.offset, e.length))
        return cls(tuple(tuple(b) for b in by), tuple(everywhere))


def _cat(total: torch.Tensor, ranges: Sequence[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([total[o : o + n] for o, n in ranges]) if ranges else total.new_empty(0)


def _scatter_back(total: torch.Tensor, ranges: Sequence[tuple[int, int]], flat: torch.Tensor) -> None:
    at = 0
    for o, n in ranges:
        total[o : o + n].copy_(flat[at : at + n])
        at += n


def reduce_across_replicas(total: torch.Tensor, split: ReplicaSplit, groups: ShardGroups) -> None:
    """The second stage of HSDP's gradient reduction, in place on this rank's summed segment:
    each replica's ranges are reduce-scattered to it (one reduce-scatter-v over the replicate
    group: the step owner gets the sum, the others keep partial values they never read), the
    ranges every replica steps are all-reduced. Bytes: those of one all-reduce of the segment
    (its reduce-scatter half here, the all-gather half is the updated matrices' broadcast)."""
    R, me = groups.replicate_size, groups.replicate_rank
    sizes = [sum(n for _, n in ranges) for ranges in split.by_replica]
    if sum(sizes):
        order = [r for r in range(R) if r != me] + [me]
        flat = torch.cat([_cat(total, split.by_replica[r]) for r in order])
        mine = reduce_scatter_v(flat, sizes, me, groups.replicate_group, op="replicate_reduce_scatter_v")
        assert isinstance(mine, torch.Tensor)
        _scatter_back(total, split.by_replica[me], mine)
        if groups.replica_sync is not None:  # the global owners will step: sync before the next gather
            groups.replica_sync.pending = True
    if split.everywhere:
        rest = _cat(total, split.everywhere)
        comm.all_reduce(rest, group=groups.replicate_group, name="replicate_all_reduce")
        _scatter_back(total, split.everywhere, rest)


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
        self.rebuild_unsharded()

    def _set(self, state: ShardedState) -> None:
        self.state = state
        assert (self._gather is not None) == (state is ShardedState.GATHERING), (self.index, state)
        if self.handles:
            h = self.handles[0]
            registered_unsharded = h.registered() is h._unsharded
            want = state in (ShardedState.UNSHARDED, ShardedState.HELD)
            assert registered_unsharded == want, (self.index, state)

    def rebuild_unsharded(self) -> None:
        """(Re)create every unsharded tensor and the unit's dtypes from the sharded parameters
        (at creation, and after ``nn.Module._apply`` changed their device or dtype)."""
        if self.state is not ShardedState.SHARDED:
            raise RuntimeError(f"unit {self.index}: rebuild needs the SHARDED state, not {self.state}")
        for h in self.handles:
            h.compute_dtype = compute_dtype(self.mp_policy, h.sharded.dtype)
            h.create_unsharded()
            h.free()
        one = one_compute_dtype(self.index, {h.shard.fqn: h.compute_dtype for h in self.handles})
        self.gather_dtype = one if one is not None else torch.float32
        reduce_dtype = getattr(self.mp_policy, "reduce_dtype", None)
        self.reduce_dtype = reduce_dtype or self.gather_dtype
        self.device = self.handles[0].sharded.device if self.handles else torch.device("cpu")
        self.local_only = (
            self.groups.world_size == 1
            and self.groups.replicate_size == 1
            and all(h.aliases_resident for h in self.handles)
        )

    def sync_requires_grad(self) -> None:
        """Pick up parameters frozen or unfrozen since the last forward (same on every rank).
        The reads are of this package's own tensors' metadata: no ``__torch_function__`` per read."""
        with torch._C.DisableTorchFunctionSubclass():
            for h in self.handles:
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
        """Issue the due broadcast asynchronously (one per step replica and dtype holding pieces
        here; none when nothing is due or it is in flight). Every rank of the replicate group
        issues the same ones in the same unit order."""
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
        """SHARDED -> GATHERING: issue the all-gather-v asynchronously; True if it did (a no-op
        in other states; at one rank the data is copied and the unit is GATHERED at once).
        A deferred HSDP broadcast due on the unit lands first."""
        if self.state is not ShardedState.SHARDED:
            return False
        self.land_replica_sync()
        groups, layout = self.groups, self.gather_layout
        me = groups.rank
        if groups.world_size == 1:  # one rank owns everything: no collective, no send buffer
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
        """-> GATHERED: every rank's segment lands in the unsharded tensors (issued now if
        nothing was in flight). A gather the user issued lands as HELD; UNSHARDED and HELD stay;
        RETAINED data is valid and becomes GATHERED."""
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
        for h in self.handles:
            h.swap(h.unsharded if unsharded else h.sharded)

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
        for h in self.handles:
            h.unsharded.grad = None
        self.free()
        self.training_state = TrainingState.IDLE

    # -- gradients ----------------------------------------------------------------------------
    def take_grads(self) -> dict[int, torch.Tensor]:
        """The gradients to reduce now (accumulated sum plus this backward's), cleared from the
        handles; frozen and unused parameters have none (their ``grad`` stays None)."""
        grads: dict[int, torch.Tensor] = {}
        for i, h in enumerate(self.handles):
            g = h.take_grad()
            if g is not None:
                grads[i] = g
        return grads

    def accumulate(self) -> None:
        """Gradient sync off: move this backward's gradients into the accumulators."""
        for h in self.handles:
            h.accumulate(self.reduce_dtype)

    def issue_reduce(self, grads: dict[int, torch.Tensor]) -> ReductionInFlight | None:
        """Reduce-scatter-v ``grads`` (from :meth:`take_grads`) asynchronously; the DDP average
        lands on the owners when the context lands the returned record. At one rank without
        replicas the local gradient is the average: it lands now and nothing is returned.

        With HSDP the owner's segment then crosses the replicas (at landing): each matrix's
        gradient is reduced to its global owner only, the rest all-reduced
        (:func:`reduce_across_replicas`). The
        division by the data-parallel size (or ``gradient_divide_factor``) is split around the
        sum as :func:`.collectives.gradient_divide_factors` says (float16: part before, part
        after)."""
        groups = self.groups
        W, me = groups.world_size, groups.rank
        pre, post = gradient_divide_factors(self.reduce_dtype, groups.dp_size, self.options.gradient_divide_factor)
        if W == 1 and groups.replicate_size == 1:
            # landing reads and writes only this package's own tensors' metadata and .grad: no
            # __torch_function__ per read (a third of a one-rank backward's own cost otherwise)
            with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
                for i, g in grads.items():
                    h = self.handles[i]
                    if g.dtype != self.reduce_dtype:
                        g = g.to(self.reduce_dtype)  # round as the reduction would
                    if pre * post != 1:  # a custom divide factor (one rank: nothing summed)
                        g = g.div(pre).div_(post)
                    if g.dtype != h.sharded.dtype:
                        g = g.to(h.sharded.dtype)
                    h.add_grad(g)
            for i in sorted(grads):
                self.handles[i].run_post_accumulate_grad_hooks()
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
        """A completed reduce-scatter-v: the owners' averaged gradients land as ``.grad`` of
        the sharded parameters (summed into existing ones); every rank holds a ``.grad`` of
        every reduced parameter (an empty piece off its owner), as FSDP2. Then each reduced
        parameter's post-accumulate-grad hooks run, once, in the unit's parameter order (FSDP2
        runs them there too: optimizer-in-backward steps each parameter as its gradient lands)."""
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
        with comm_phase("backward" if backward else "forward"):
            self.wait_gather()

    def post_forward(self) -> None:
        """Swap out; free unless a backward will read the data and the unit keeps it
        (``reshard_after_forward=False``, or the root, as FSDP2's root stays for backward)."""
        if in_backward():  # recomputation: the unit stays swapped in until its post-backward
            return
        self.training_state = TrainingState.IDLE
        if self.held:
            return
        self.swap_out()
        if not torch.is_grad_enabled():  # no backward will read it
            self.free()
        elif self.options.reshard_after_forward and not self.is_root:
            self.free()

    def pre_backward(self) -> None:
        """The first gradient for one of this unit's outputs arrived: gather again if freed."""
        self.training_state = TrainingState.BACKWARD
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

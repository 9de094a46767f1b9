"""Per-unit runtime: the two tensors of every parameter and the unit's explicit lifecycle.

A *unit* is the set of parameters one ``fully_shard`` call manages. Its data moves through
the states of :class:`ShardedState`, one transition per method::

    SHARDED    owner: full tensor resident; others: numel-0 tensor (row blocks for ``sharded``);
      |        the sharded parameters are registered on the modules
      | issue_gather()      all-gather-v issued asynchronously (prefetch, unshard(async_op=True))
    GATHERING  storage of the unsharded tensors allocated, the collective in flight
      | wait_gather()       (SHARDED -> GATHERED directly when nothing was issued)
    GATHERED   every rank holds valid full tensors; the sharded parameters are still registered
      | swap_in()
    UNSHARDED  the unsharded tensors are registered: forward / backward compute reads them
      | swap_out(), free()  back to SHARDED: non-aliased storage released with
                            ``untyped_storage().resize_(0)``, so what autograd saved stays valid
                            and is revived in place by the next gather

What happens *when* is the :class:`TrainingState` of the unit (IDLE, FORWARD, BACKWARD), driven
by the hooks in :mod:`.api` and the context in :mod:`.context`:

* pre-forward: gather (or consume a prefetch), swap in, prefetch the next unit;
* post-forward: swap out; free unless the unit keeps its data for backward (``reshard_after_forward
  =False``, or the root with grad enabled);
* pre-backward (a multi-grad hook on the unit's outputs): gather again if freed, swap in;
* post-backward (the backward of an identity on the unit's inputs, FSDP2's
  ``RegisterPostBackwardFunction``, so every node that reads the weights has run): reduce the
  gradients present now, free. The end-of-backward callback does the same for units whose
  inputs need no gradient, and reduces whatever a second use of a unit left behind.

Gradients: ``reduce_grads`` reduce-scatters-v the unsharded gradients (in ``reduce_dtype``),
asynchronously: the context keeps one reduction in flight while the next unit's backward runs,
and when it lands the average becomes ``.grad`` of the owner's sharded parameter (summed into an
existing one).
With gradient sync off, the unsharded gradients move after each backward into a per-parameter
accumulator in ``reduce_dtype`` (fp32 for bf16 compute with fp32 reduce, as FSDP2 accumulates),
which the next synced backward reduces once.

Two tensor objects per parameter, as FSDP2: ``sharded`` (the parameter the user and the optimizer
see; the very object the model had before ``fully_shard``) and ``unsharded`` (a leaf
``nn.Parameter`` swapped in for compute). On the owner at full precision the unsharded tensor
aliases the sharded one's storage (no copy, never freed); with a lower ``param_dtype`` it is a
low-precision buffer, gathered like the others.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .. import comm
from ..comm import comm_phase
from ..owner_dtensor import like_layout
from ..planning.metadata import MatrixShard
from ..tensors import local_tensor
from .collectives import (
    PendingGather,
    PendingReduce,
    SegmentLayout,
    all_gather_v,
    gradient_divide_factors,
    reduce_scatter_v,
)

if TYPE_CHECKING:
    from .context import ShardingContext

__all__ = ["ParamHandle", "ShardedState", "ShardedUnit", "TrainingState", "in_backward"]


def in_backward() -> bool:
    """True while the autograd engine runs (e.g. activation-checkpoint recomputation)."""
    return bool(torch._C._current_graph_task_id() != -1)


class ShardedState(enum.Enum):
    """Where a unit's data is (see the module docstring for the transitions)."""

    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"
    UNSHARDED = "unsharded"


class TrainingState(enum.Enum):
    """Which pass the unit is in, as FSDP2's ``TrainingState``."""

    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


class ParamHandle:
    """One distinct parameter of a unit: its sharded and unsharded tensors and where it is
    registered (several places for a tied parameter)."""

    shard: MatrixShard
    locations: list[tuple[nn.Module, str]]
    sharded: nn.Parameter
    rank: int
    compute_dtype: torch.dtype
    is_owner: bool
    aliases_resident: bool
    accumulated: torch.Tensor | None  # gradient sum of unsynced backwards, in reduce dtype

    def __init__(
        self,
        shard: MatrixShard,
        locations: list[tuple[nn.Module, str]],
        sharded: nn.Parameter,
        rank: int,
        compute_dtype: torch.dtype,
    ) -> None:
        self.shard = shard
        self.locations = locations
        self.sharded = sharded
        self.rank = rank
        self.compute_dtype = compute_dtype
        self.is_owner = shard.is_owned_by(rank)
        self.aliases_resident = False
        self.accumulated = None
        self._unsharded: nn.Parameter | None = None
        self._nbytes = 0

    @property
    def local(self) -> torch.Tensor:
        """This rank's piece of the sharded parameter (the DTensor's local tensor)."""
        return local_tensor(self.sharded)

    def add_grad(self, g: torch.Tensor) -> None:
        """Land this rank's piece ``g`` of the averaged gradient as (or into) ``sharded.grad``,
        an owner-layout DTensor of the parameter's layout on every rank."""
        grad = self.sharded.grad
        if grad is None:
            self.sharded.grad = like_layout(self.sharded, g)  # type: ignore[arg-type]
        else:
            local_tensor(grad).add_(g)

    @property
    def unsharded(self) -> nn.Parameter:
        """The tensor swapped in for compute (created once, revived and freed in place)."""
        if self._unsharded is None:
            raise RuntimeError(f"{self.shard.fqn}: the unsharded tensor was not created yet")
        return self._unsharded

    def create_unsharded(self) -> None:
        """(Re)create the unsharded tensor for the sharded one's current device and dtype."""
        self.aliases_resident = self.is_owner and self.compute_dtype == self.sharded.dtype
        requires_grad = self.sharded.requires_grad
        if self.aliases_resident:
            t = nn.Parameter(self.local.detach(), requires_grad=requires_grad)
        else:
            t = nn.Parameter(
                torch.empty(self.shard.shape, dtype=self.compute_dtype, device=self.sharded.device),
                requires_grad=requires_grad,
            )
        self._unsharded = t
        self._nbytes = t.numel() * t.element_size()
        self.accumulated = None

    def sync_requires_grad(self) -> None:
        """Follow ``sharded.requires_grad`` (frozen / unfrozen by the user)."""
        want = self.sharded.requires_grad
        if self.unsharded.requires_grad != want:
            self.unsharded.requires_grad_(want)
            if not want:
                self.unsharded.grad = None

    def alloc(self) -> None:
        """Revive the unsharded storage in place (same storage object autograd saved)."""
        if not self.aliases_resident:
            storage = self.unsharded.untyped_storage()
            if storage.size() != self._nbytes:
                storage.resize_(self._nbytes)

    def free(self) -> None:
        if not self.aliases_resident:
            storage = self.unsharded.untyped_storage()
            if storage.size() != 0:
                storage.resize_(0)

    def write(self, flat: torch.Tensor, rows: tuple[int, int] | None) -> None:
        """Copy gathered elements into the unsharded tensor without bumping its version."""
        t = self.unsharded
        with torch.autograd._unsafe_preserve_version_counter(t):
            dst = t if rows is None else t[rows[0] : rows[1]]
            dst.copy_(flat.view(dst.shape))

    def swap(self, tensor: torch.Tensor) -> None:
        for module, name in self.locations:
            module._parameters[name] = tensor  # type: ignore[assignment]  # as FSDP2 swaps

    def registered(self) -> torch.Tensor | None:
        """The tensor registered at the first location now (``nn.Module._apply`` may replace it)."""
        module, name = self.locations[0]
        return module._parameters.get(name)

    def has_grad(self) -> bool:
        return self.unsharded.grad is not None or self.accumulated is not None

    def accumulate(self, reduce_dtype: torch.dtype) -> None:
        """Move this backward's unsharded gradient into the unsynced accumulator."""
        g = self.unsharded.grad
        if g is None:
            return
        if self.accumulated is None:
            self.accumulated = g.detach().to(reduce_dtype, copy=True)
        else:
            self.accumulated.add_(g.detach().to(reduce_dtype))
        self.unsharded.grad = None

    def take_grad(self) -> torch.Tensor | None:
        """The gradient to reduce: accumulated sum plus this backward's, then both cleared."""
        g = self.unsharded.grad
        acc = self.accumulated
        self.unsharded.grad = None
        self.accumulated = None
        if acc is None:
            return g
        if g is not None:
            acc.add_(g.detach().to(acc.dtype))
        return acc

    def drop_grads(self) -> None:
        self.unsharded.grad = None
        self.accumulated = None


class ShardedUnit:
    """The parameters of one ``fully_shard`` call and their per-step lifecycle."""

    ctx: ShardingContext
    index: int
    module: nn.Module  # the first of its modules
    members: list[nn.Module]  # every module of the fully_shard call (FSDP2's list form)
    handles: list[ParamHandle]
    parent: ShardedUnit | None  # the nearest enclosing unit (None: outermost)
    reshard_after_forward: bool
    reshard_after_backward: bool
    requires_gradient_sync: bool
    mp_policy: Any
    is_root: bool
    state: ShardedState
    training_state: TrainingState
    user_held: bool  # unshard() by the user: stays UNSHARDED until reshard()
    retained: bool  # data kept after backward on purpose (reshard_after_backward=False)
    forward_prefetch: list[ShardedUnit] | None  # explicit targets; None: automatic
    backward_prefetch: list[ShardedUnit] | None
    gradient_divide_factor: float | None  # None: the data-parallel size (the average)
    gather_layout: SegmentLayout
    gather_dtype: torch.dtype
    reduce_dtype: torch.dtype
    device: torch.device

    def __init__(
        self,
        ctx: ShardingContext,
        index: int,
        module: nn.Module,
        handles: list[ParamHandle],
        *,
        reshard_after_forward: bool,
        mp_policy: Any,
        is_root: bool,
        members: list[nn.Module] | None = None,
    ) -> None:
        self.ctx = ctx
        self.index = index
        self.module = module
        self.members = members if members is not None else [module]
        self.handles = handles
        self.parent = None  # set once every unit of the context exists
        self.reshard_after_forward = reshard_after_forward
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        self.mp_policy = mp_policy
        self.is_root = is_root
        self.state = ShardedState.SHARDED
        self.training_state = TrainingState.IDLE
        self.user_held = False
        self.retained = False
        self.forward_prefetch = None
        self.backward_prefetch = None
        self.gradient_divide_factor = None
        self._pending: PendingGather | None = None
        self._shards = [h.shard for h in handles]
        self.gather_layout = SegmentLayout.build(self._shards, ctx.world_size)
        self._reduce_layouts: dict[frozenset[int], SegmentLayout] = {}
        self.rebuild_unsharded()

    def rebuild_unsharded(self) -> None:
        """(Re)create every unsharded tensor and the unit's dtypes from the sharded parameters
        (at creation, and after ``nn.Module._apply`` changed their device or dtype)."""
        if self.state is not ShardedState.SHARDED:
            raise RuntimeError(f"unit {self.index}: rebuild needs the SHARDED state, not {self.state}")
        param_dtype = getattr(self.mp_policy, "param_dtype", None)
        for h in self.handles:
            floating = h.sharded.is_floating_point()
            h.compute_dtype = param_dtype if (param_dtype is not None and floating) else h.sharded.dtype
            h.create_unsharded()
            h.free()
        dtypes = {h.compute_dtype for h in self.handles}
        if len(dtypes) > 1:
            names = ", ".join(f"{h.shard.fqn}: {h.compute_dtype}" for h in self.handles)
            raise NotImplementedError(
                f"fully_shard unit {self.index} mixes parameter dtypes ({names}); give the unit one "
                "dtype or set MixedPrecisionPolicy(param_dtype=...) so all compute in one dtype"
            )
        self.gather_dtype = dtypes.pop() if dtypes else torch.float32
        reduce_dtype = getattr(self.mp_policy, "reduce_dtype", None)
        self.reduce_dtype = reduce_dtype or self.gather_dtype
        self.device = self.handles[0].sharded.device if self.handles else torch.device("cpu")

    def sync_requires_grad(self) -> None:
        """Pick up parameters frozen or unfrozen since the last forward (same on every rank)."""
        for h in self.handles:
            h.sync_requires_grad()

    @property
    def has_frozen(self) -> bool:
        return any(not h.sharded.requires_grad for h in self.handles)

    def reduce_layout(self, indices: frozenset[int]) -> SegmentLayout:
        layout = self._reduce_layouts.get(indices)
        if layout is None:
            keep = {id(self._shards[i]) for i in indices}
            layout = SegmentLayout.build(self._shards, self.ctx.world_size, include=lambda s: id(s) in keep)
            self._reduce_layouts[indices] = layout
        return layout

    # -- data: SHARDED -> GATHERING -> GATHERED <-> UNSHARDED -> SHARDED ---------------------------
    def issue_gather(self) -> None:
        """SHARDED -> GATHERING: issue the all-gather-v asynchronously (a no-op in other states)."""
        if self.state is not ShardedState.SHARDED:
            return
        ctx, layout = self.ctx, self.gather_layout
        me = ctx.rank
        if ctx.world_size == 1:  # one rank owns everything: no collective, no send buffer
            with torch.no_grad():
                for h in self.handles:
                    if not h.aliases_resident:  # a low-precision compute copy
                        h.alloc()
                        h.write(h.local.reshape(-1), None)
            self.state = ShardedState.GATHERED
            return
        with torch.no_grad():
            send = torch.empty(layout.sizes[me], dtype=self.gather_dtype, device=self.device)
            mine = [self.handles[e.index].local.reshape(-1).to(self.gather_dtype) for e in layout.entries[me]]
            if mine:
                torch.cat(mine, out=send)
            for h in self.handles:
                h.alloc()
            pending = all_gather_v(send, layout.sizes, me, ctx.group, async_op=True)
            assert isinstance(pending, PendingGather)
            self._pending = pending
        self.state = ShardedState.GATHERING

    def wait_gather(self) -> bool:
        """-> GATHERED (or stays UNSHARDED): every rank's segment lands in the unsharded tensors.

        Returns True when the data came from a gather issued earlier (a prefetch)."""
        if self.state in (ShardedState.GATHERED, ShardedState.UNSHARDED):
            return False
        prefetched = self.state is ShardedState.GATHERING
        self.issue_gather()
        if self.state is ShardedState.GATHERED:  # one rank: gathered without a collective
            return prefetched
        pending, self._pending = self._pending, None
        assert pending is not None  # issued just above, or by a prefetch
        ctx, layout = self.ctx, self.gather_layout
        me = ctx.rank
        with torch.no_grad():
            parts = pending.wait()
            dsts: list[torch.Tensor] = []
            srcs: list[torch.Tensor] = []
            for r in range(ctx.world_size):
                for e in layout.entries[r]:
                    h = self.handles[e.index]
                    if r == me and h.aliases_resident:
                        continue
                    dst = h.unsharded if e.rows is None else h.unsharded[e.rows[0] : e.rows[1]]
                    dsts.append(dst)
                    srcs.append(parts[r][e.offset : e.offset + e.length].view(dst.shape))
            if dsts:  # copy-out in one foreach kernel; autograd's saved versions stay valid
                written = tuple(h.unsharded for h in self.handles if not h.aliases_resident)
                with torch.autograd._unsafe_preserve_version_counter(written):
                    torch._foreach_copy_(dsts, srcs)
        self.state = ShardedState.GATHERED
        return prefetched

    def swap_in(self) -> None:
        """GATHERED -> UNSHARDED: register the unsharded tensors for compute."""
        if self.state is ShardedState.UNSHARDED:
            return
        if self.state is not ShardedState.GATHERED:
            raise RuntimeError(f"unit {self.index}: swap_in needs gathered data, state is {self.state}")
        for h in self.handles:
            h.swap(h.unsharded)
        self.state = ShardedState.UNSHARDED

    def swap_out(self) -> None:
        """UNSHARDED -> GATHERED: register the sharded parameters again (data stays valid)."""
        if self.state is ShardedState.UNSHARDED:
            for h in self.handles:
                h.swap(h.sharded)
            self.state = ShardedState.GATHERED

    def free(self) -> None:
        """Any state -> SHARDED: an issued gather is completed and dropped, storage released."""
        self.swap_out()
        if self._pending is not None:  # a prefetch nobody consumed: finish it, then drop it
            self._pending.wait()
            self._pending = None
        for h in self.handles:
            h.free()
        self.state = ShardedState.SHARDED
        self.retained = False

    def unshard(self) -> None:
        """Gather (or consume a prefetch) and swap in: ready for compute."""
        self.wait_gather()
        self.swap_in()

    def reset(self) -> None:
        """Back to SHARDED and IDLE, dropping gradients a failed backward left unreduced."""
        for h in self.handles:
            h.unsharded.grad = None
        self.user_held = False
        self.free()
        self.training_state = TrainingState.IDLE

    def _prefetch(self, phase: str, targets: list[ShardedUnit]) -> None:
        for t in targets:
            if t is self or t.state is not ShardedState.SHARDED:
                continue
            t.issue_gather()
            self.ctx.prefetch_log.append((phase, self.index, t.index))

    # -- gradients ----------------------------------------------------------------------------
    def reduce_grads(self) -> None:
        """Reduce-scatter-v this unit's gradients; the DDP average lands on the owners.

        Only parameters with a gradient take part (frozen and unused ones keep ``grad`` None);
        with HSDP the owner's segment is then all-reduced across the replicas. The division by
        the data-parallel size (or :attr:`gradient_divide_factor`) is split around the sum as
        :func:`.collectives.gradient_divide_factors` says (float16: part before, part after)."""
        ctx = self.ctx
        W, me = ctx.world_size, ctx.rank
        grads: dict[int, torch.Tensor] = {}
        for i, h in enumerate(self.handles):
            g = h.take_grad()
            if g is not None:
                grads[i] = g
        if not grads:
            return
        pre, post = gradient_divide_factors(self.reduce_dtype, ctx.dp_size, self.gradient_divide_factor)
        if W == 1 and ctx.replicate_size == 1:  # the local gradient is the average: no copy
            with torch.no_grad():
                for i, g in grads.items():
                    h = self.handles[i]
                    g = g.to(self.reduce_dtype)  # round as the reduction would
                    if pre * post != 1:  # a custom divide factor (one rank: nothing summed)
                        g = g.div(pre).div_(post)
                    h.add_grad(g.to(h.sharded.dtype))
            return
        layout = self.reduce_layout(frozenset(grads))
        ctx.wait_reduce()  # at most one reduce-scatter in flight: bounded buffer memory
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
            pending = reduce_scatter_v(flat, layout.sizes, me, ctx.group, async_op=True)
            assert isinstance(pending, PendingReduce)
        # the next unit's backward runs while this reduction is in flight (gloo's threads, or
        # NCCL's stream); its gradients land when the context waits for it
        ctx.track_reduce(pending, lambda total: self._land_reduced(total, layout, post))

    def _land_reduced(self, total: torch.Tensor, layout: SegmentLayout, post: float) -> None:
        """The summed segment of a completed reduce-scatter-v: the owners' averaged gradients
        land as ``.grad`` of the sharded parameters (summed into existing ones)."""
        ctx = self.ctx
        with torch.no_grad(), comm_phase("backward"):
            if ctx.replicate_group is not None and ctx.replicate_size > 1 and total.numel():
                comm.all_reduce(total, group=ctx.replicate_group, name="replicate_all_reduce")
            if post != 1:
                total.div_(post)
            landed: set[int] = set()
            for e in layout.entries[ctx.rank]:
                h = self.handles[e.index]
                landed.add(e.index)
                h.add_grad(total[e.offset : e.offset + e.length].view(h.local.shape).to(h.sharded.dtype))
            for i in sorted({e.index for es in layout.entries for e in es}):  # every rank holds a .grad
                if i not in landed:  # of every reduced parameter (an empty piece here), as FSDP2
                    h = self.handles[i]
                    if h.sharded.grad is None:
                        h.add_grad(torch.zeros_like(h.local))

    def finish_gradients(self) -> None:
        """Reduce the gradients present now (sync on), or move them to the accumulators."""
        if self.requires_gradient_sync:
            self.reduce_grads()
        else:
            for h in self.handles:
                h.accumulate(self.reduce_dtype)

    # -- lifecycle driven by the hooks ----------------------------------------------------------
    def pre_forward(self) -> None:
        backward = in_backward()  # a checkpoint recomputation of this unit
        if not backward and not self.user_held:
            self.sync_requires_grad()
        if not backward:
            self.training_state = TrainingState.FORWARD
            self.ctx.note_forward(self)
        with comm_phase("backward" if backward else "forward"):
            self.wait_gather()
            if not backward:
                targets = self.forward_prefetch if self.forward_prefetch is not None else self.ctx.next_forward(self)
                self._prefetch("forward", targets)
        self.swap_in()

    def post_forward(self) -> None:
        if in_backward():  # recomputation: the unit stays swapped in until its post-backward
            return
        self.training_state = TrainingState.IDLE
        if self.user_held:
            return
        self.swap_out()
        if not torch.is_grad_enabled():  # no backward will read it
            self.free()
        elif self.reshard_after_forward and not self.is_root:  # FSDP2: the root stays for backward
            self.free()

    def pre_backward(self) -> None:
        """The first gradient for one of this unit's outputs arrived: gather again if freed."""
        self.ctx.begin_backward()
        self.training_state = TrainingState.BACKWARD
        self.ctx.note_backward(self)
        with comm_phase("backward"):
            self.wait_gather()
            targets = self.backward_prefetch if self.backward_prefetch is not None else self.ctx.next_backward(self)
            self._prefetch("backward", targets)
        # swapped in for the backward: an activation-checkpoint recomputation reads the
        # module's parameters and must find the gathered ones
        self.swap_in()

    def post_backward(self) -> None:
        """Every input gradient of one forward of this unit is computed: reduce, then free."""
        self.ctx.begin_backward()
        self.finish_gradients()
        if not self.user_held:
            self._release_after_backward()

    def end_backward(self) -> None:
        """End of the whole backward: reduce what the post-backward did not (same decision on
        every rank), release the data unless the user or ``reshard_after_backward`` keeps it."""
        self.finish_gradients()
        self.training_state = TrainingState.IDLE
        if not self.user_held:
            self._release_after_backward()

    def _release_after_backward(self) -> None:
        if self.reshard_after_backward:
            self.free()
        else:  # kept for the next micro-batch's forward (FSDP2's reshard_after_backward=False)
            self.swap_out()
            self.retained = self.state is ShardedState.GATHERED

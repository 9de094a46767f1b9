"""Per-unit runtime: the two tensors of every parameter and the unit's lifecycle.

Lifecycle of a unit (one ``fully_shard`` call) per step::

    SHARDED   owner: full tensor resident; others: numel-0 tensor (row blocks for ``sharded``)
      | pre-forward: all-gather-v into the unsharded tensors, swap them into the module(s)
    UNSHARDED compute; autograd saves the unsharded tensors
      | post-forward: swap the sharded parameters back; with reshard_after_forward (not the
      |   root) free the non-aliased storage (``untyped_storage().resize_(0)``)
      | pre-backward (multi-grad hook on the forward outputs): all-gather-v again into the
      |   same storage ("revive"), so what autograd saved is valid again
      | post-backward (post-accumulate-grad hooks, or the end-of-backward callback):
      |   reduce-scatter-v; the averaged gradient lands as ``.grad`` of the sharded parameter
    SHARDED

Parity features:

* **Frozen parameters** (``requires_grad=False``, set before or after ``fully_shard``; the
  flag is re-read at every pre-forward, identically on every rank) are gathered for compute
  but never reduced and never get a gradient. **Unused parameters** (no gradient in a step)
  are left out of that step's reduce-scatter and keep ``grad`` None, as in the unsharded
  model; as in FSDP2, which parameters go unused must be the same on every rank.
* **Activation checkpointing**: the pre-backward hook revives *and swaps in* the unsharded
  tensors, so a recomputation (``torch.utils.checkpoint`` inside a block's forward, or
  ``checkpoint_wrapper``) reads the gathered parameters; they are swapped out after the
  unit's reduction.
* **Prefetch**: after a unit's own all-gather, the next unit's all-gather-v is issued
  asynchronously (``async_op=True``) and waited at that unit's pre-forward (pre-backward in
  backward). Automatic: the next unit in the order the previous step ran (forward and
  backward orders are recorded, so the first step does not prefetch); explicit lists from
  ``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch`` replace it for a
  unit; ``set_auto_prefetch(False)`` turns the automatic one off. Still one all-gather-v per
  unit per pass, the same bytes.
* **HSDP**: with a replicate group, the owner's reduced segment is all-reduced across
  replicas and averaged over the whole data-parallel world (shard size x replicate size).

Two tensor objects per parameter, as FSDP2: ``sharded`` (an ``nn.Parameter`` registered on the
module, what ``model.parameters()`` and the optimizer see) and ``unsharded`` (a leaf
``nn.Parameter`` swapped in for compute). On the owner at full precision the unsharded tensor
aliases the resident storage (no copy, never freed); with a lower ``param_dtype`` it is one
low-precision buffer, kept from forward to backward and freed after the reduction.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten, tree_map

from ..comm import comm_phase
from ..planning.metadata import MatrixShard, ShardingPlan
from .. import comm
from .collectives import PendingGather, SegmentLayout, all_gather_v, reduce_scatter_v

__all__ = ["ParamHandle", "ShardedUnit", "ShardingContext", "in_backward"]


def in_backward() -> bool:
    """True while the autograd engine runs (e.g. activation-checkpoint recomputation)."""
    return torch._C._current_graph_task_id() != -1


class ParamHandle:
    """One distinct parameter of a unit: sharded + unsharded tensors and where it is registered."""

    def __init__(self, shard: MatrixShard, locations: list[tuple[nn.Module, str]],
                 sharded: nn.Parameter, rank: int, compute_dtype: torch.dtype) -> None:
        self.shard = shard
        self.locations = locations
        self.sharded = sharded
        self.rank = rank
        self.compute_dtype = compute_dtype
        self.is_owner = shard.is_owned_by(rank)
        # owner at full precision: the unsharded tensor *is* the resident storage
        self.aliases_resident = self.is_owner and compute_dtype == sharded.dtype
        self._unsharded: nn.Parameter | None = None
        self._nbytes = 0

    @property
    def unsharded(self) -> nn.Parameter:
        """The tensor swapped in for compute (created once, revived and freed in place)."""
        if self._unsharded is None:
            raise RuntimeError(f"{self.shard.fqn}: the unsharded tensor was not created yet")
        return self._unsharded

    def create_unsharded(self, on_accumulate: Callable[[torch.Tensor], None]) -> None:
        requires_grad = self.sharded.requires_grad
        if self.aliases_resident:
            t = nn.Parameter(self.sharded.detach(), requires_grad=requires_grad)
        else:
            t = nn.Parameter(
                torch.empty(self.shard.shape, dtype=self.compute_dtype, device=self.sharded.device),
                requires_grad=requires_grad,
            )
        self._unsharded = t
        self._on_accumulate = on_accumulate
        self._hooked = False
        self._nbytes = t.numel() * t.element_size()
        self.sync_requires_grad()

    def sync_requires_grad(self) -> bool:
        """Follow ``sharded.requires_grad`` (frozen / unfrozen by the user); True if it changed."""
        want = self.sharded.requires_grad
        changed = self.unsharded.requires_grad != want
        if changed:
            self.unsharded.requires_grad_(want)
            if not want:
                self.unsharded.grad = None
        if want and not self._hooked:
            self.unsharded.register_post_accumulate_grad_hook(self._on_accumulate)
            self._hooked = True
        return changed

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
            dst = t if rows is None else t[rows[0]:rows[1]]
            dst.copy_(flat.view(dst.shape))

    def swap(self, tensor: torch.Tensor) -> None:
        for module, name in self.locations:
            module._parameters[name] = tensor  # type: ignore[assignment]  # as FSDP2 swaps


class ShardingContext:
    """What the units of one sharded model share: group, rank, plan, end-of-backward callback."""

    def __init__(self, group: Any, rank: int, world_size: int, plan: ShardingPlan,
                 replicate_group: Any = None) -> None:
        self.group = group  # the shard group: owners, all-gather-v and reduce-scatter-v
        self.rank = rank
        self.world_size = world_size
        self.plan = plan
        # HSDP: the replicas of this shard group; gradients are averaged over shard x replicate
        self.replicate_group = replicate_group
        self.replicate_size = 1 if replicate_group is None else dist_world_size(replicate_group)
        self.dp_size = world_size * self.replicate_size
        self.units: list[ShardedUnit] = []
        self._queued_for: int | None = None
        # prefetch: orders recorded from the previous step (the same on every rank)
        self.auto_prefetch = True
        self.forward_order: list[ShardedUnit] = []
        self.backward_order: list[ShardedUnit] = []
        self._fwd_seq: list[ShardedUnit] = []
        self._bwd_seq: list[ShardedUnit] = []
        # (phase, issuing unit index, prefetched unit index) per issued prefetch; tests read it
        self.prefetch_log: list[tuple[str, int, int]] = []

    def note_forward(self, unit: "ShardedUnit") -> None:
        if any(u is unit for u in self._fwd_seq):  # a new forward began without a backward
            self.forward_order = self._fwd_seq
            self._fwd_seq = []
        self._fwd_seq.append(unit)

    def note_backward(self, unit: "ShardedUnit") -> None:
        if not any(u is unit for u in self._bwd_seq):
            self._bwd_seq.append(unit)

    @staticmethod
    def _next(order: list["ShardedUnit"], unit: "ShardedUnit") -> "list[ShardedUnit]":
        for i, u in enumerate(order):
            if u is unit:
                return order[i + 1:i + 2]
        return []

    def next_forward(self, unit: "ShardedUnit") -> "list[ShardedUnit]":
        return self._next(self.forward_order, unit) if self.auto_prefetch else []

    def next_backward(self, unit: "ShardedUnit") -> "list[ShardedUnit]":
        return self._next(self.backward_order, unit) if self.auto_prefetch else []

    def queue_final_callback(self) -> None:
        """Run :meth:`_final_callback` once at the end of the current backward pass."""
        task = torch._C._current_graph_task_id()
        if task == -1 or self._queued_for == task:
            return
        self._queued_for = task
        Variable._execution_engine.queue_callback(self._final_callback)

    def _final_callback(self) -> None:
        self._queued_for = None
        with comm_phase("backward"):
            for unit in self.units:  # same order on every rank
                unit.finish_backward()
        if self._fwd_seq:
            self.forward_order, self._fwd_seq = self._fwd_seq, []
        if self._bwd_seq:
            self.backward_order, self._bwd_seq = self._bwd_seq, []


def dist_world_size(group: Any) -> int:
    import torch.distributed as dist

    return dist.get_world_size(group)


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once the whole unit's backward is done
    (FSDP2's ``RegisterPostBackwardFunction``)."""

    @staticmethod
    def forward(ctx, unit: "ShardedUnit", *inputs: torch.Tensor):  # type: ignore[override]
        ctx.unit = unit
        return inputs if len(inputs) > 1 else inputs[0]

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        ctx.unit.post_backward()
        return (None, *grads)


class ShardedUnit:
    """The parameters of one ``fully_shard`` call and their per-step lifecycle."""

    def __init__(self, ctx: ShardingContext, index: int, module: nn.Module, handles: list[ParamHandle],
                 *, reshard_after_forward: bool, mp_policy: Any, is_root: bool) -> None:
        self.ctx = ctx
        self.index = index
        self.module = module
        self.handles = handles
        self.reshard_after_forward = bool(reshard_after_forward)
        self.mp_policy = mp_policy
        self.is_root = is_root
        W = ctx.world_size
        self._shards = [h.shard for h in handles]
        self.gather_layout = SegmentLayout.build(self._shards, W)
        self._reduce_layouts: dict[frozenset[int], SegmentLayout] = {}
        dtypes = {h.compute_dtype for h in handles}
        if len(dtypes) > 1:
            names = ", ".join(f"{h.shard.fqn}: {h.compute_dtype}" for h in handles)
            raise NotImplementedError(
                f"fully_shard unit {index} mixes parameter dtypes ({names}); give the unit one "
                "dtype or set MixedPrecisionPolicy(param_dtype=...) so all compute in one dtype"
            )
        self.gather_dtype = dtypes.pop() if dtypes else torch.float32
        reduce_dtype = getattr(mp_policy, "reduce_dtype", None) if mp_policy is not None else None
        self.reduce_dtype = reduce_dtype or self.gather_dtype
        self.device = handles[0].sharded.device if handles else torch.device("cpu")
        self.requires_gradient_sync = True
        self.data_valid = False  # flips identically on every rank: decides whether to gather
        self.swapped_in = False
        self.user_unsharded = False
        self._pending: PendingGather | None = None  # an issued (prefetched) all-gather-v
        self.forward_prefetch: list[ShardedUnit] | None = None  # explicit; None: automatic
        self.backward_prefetch: list[ShardedUnit] | None = None
        self._accumulated: set[int] = set()
        self._reduced = False
        for i, h in enumerate(handles):
            h.create_unsharded(self._make_accumulate_hook(i))
            h.free()
        self._grad_indices = self._trainable()

    def _trainable(self) -> frozenset[int]:
        return frozenset(i for i, h in enumerate(self.handles) if h.sharded.requires_grad)

    def sync_requires_grad(self) -> None:
        """Pick up parameters frozen or unfrozen since the last forward (same on every rank)."""
        for h in self.handles:
            h.sync_requires_grad()
        self._grad_indices = self._trainable()

    def reduce_layout(self, indices: frozenset[int]) -> SegmentLayout:
        layout = self._reduce_layouts.get(indices)
        if layout is None:
            keep = {id(self._shards[i]) for i in indices}
            layout = SegmentLayout.build(self._shards, self.ctx.world_size, include=lambda s: id(s) in keep)
            self._reduce_layouts[indices] = layout
        return layout

    # -- data movement ------------------------------------------------------------------------
    def issue_gather(self) -> None:
        """Issue the all-gather-v asynchronously (prefetch); :meth:`unshard_data` waits on it."""
        if self.data_valid or self._pending is not None:
            return
        ctx, layout = self.ctx, self.gather_layout
        me = ctx.rank
        with torch.no_grad():
            send = torch.empty(layout.sizes[me], dtype=self.gather_dtype, device=self.device)
            for e in layout.entries[me]:
                send[e.offset:e.offset + e.length].copy_(self.handles[e.index].sharded.reshape(-1))
            for h in self.handles:
                h.alloc()
            pending = all_gather_v(send, layout.sizes, me, ctx.group, async_op=True)
            assert isinstance(pending, PendingGather)
            self._pending = pending

    def unshard_data(self) -> bool:
        """All-gather-v every rank's segment into the unsharded tensors (no-op if valid).

        Returns True when the data came from a prefetch issued earlier."""
        if self.data_valid:
            return False
        prefetched = self._pending is not None
        if not prefetched:
            self.issue_gather()
        pending, self._pending = self._pending, None
        assert pending is not None  # issued just above, or by the previous unit's prefetch
        ctx, layout = self.ctx, self.gather_layout
        me = ctx.rank
        with torch.no_grad():
            parts = pending.wait()
            for r in range(ctx.world_size):
                for e in layout.entries[r]:
                    h = self.handles[e.index]
                    if r == me and h.aliases_resident:
                        continue
                    h.write(parts[r][e.offset:e.offset + e.length], e.rows)
        self.data_valid = True
        return prefetched

    def free_data(self) -> None:
        if self._pending is not None:  # a prefetch nobody used: complete it, then drop it
            self._pending.wait()
            self._pending = None
        for h in self.handles:
            h.free()
        self.data_valid = False

    def _prefetch(self, phase: str, targets: "list[ShardedUnit]") -> None:
        for t in targets:
            if t is self or t.data_valid or t._pending is not None:
                continue
            t.issue_gather()
            self.ctx.prefetch_log.append((phase, self.index, t.index))

    def swap_in(self) -> None:
        if not self.swapped_in:
            for h in self.handles:
                h.swap(h.unsharded)
            self.swapped_in = True

    def swap_out(self) -> None:
        if self.swapped_in:
            for h in self.handles:
                h.swap(h.sharded)
            self.swapped_in = False

    def reduce_grads(self) -> None:
        """Reduce-scatter-v the unsharded gradients; the DDP average lands on the owners.

        Only parameters with a gradient take part (frozen and unused ones keep ``grad`` None);
        with HSDP the owner's segment is then all-reduced across the replicas."""
        ctx = self.ctx
        W, me = ctx.world_size, ctx.rank
        with_grad = frozenset(i for i in self._grad_indices if self.handles[i].unsharded.grad is not None)
        if not with_grad:
            return
        layout = self.reduce_layout(with_grad)
        with torch.no_grad():
            chunks = []
            for r in range(W):
                buf = torch.zeros(layout.sizes[r], dtype=self.reduce_dtype, device=self.device)
                for e in layout.entries[r]:
                    g = self.handles[e.index].unsharded.grad
                    assert g is not None  # e is in with_grad
                    if e.rows is not None:
                        g = g[e.rows[0]:e.rows[1]]
                    buf[e.offset:e.offset + e.length].copy_(g.reshape(-1))
                chunks.append(buf)
            total = reduce_scatter_v(chunks, me, ctx.group)
            if ctx.replicate_group is not None and ctx.replicate_size > 1 and total.numel():
                comm.all_reduce(total, group=ctx.replicate_group, name="replicate_all_reduce")
            total.div_(ctx.dp_size)
            for e in layout.entries[me]:
                h = self.handles[e.index]
                g = total[e.offset:e.offset + e.length].view(h.sharded.shape).to(h.sharded.dtype)
                if h.sharded.grad is None:
                    h.sharded.grad = g
                else:
                    h.sharded.grad += g
            for h in self.handles:
                h.unsharded.grad = None

    # -- hooks --------------------------------------------------------------------------------
    def pre_forward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        backward = in_backward()  # checkpoint_wrapper recomputing a sharded module
        if not backward and not self.user_unsharded:
            self.sync_requires_grad()
        if not backward:
            self.ctx.note_forward(self)
        with comm_phase("backward" if backward else "forward"):
            self.unshard_data()
            if not backward:
                targets = self.forward_prefetch if self.forward_prefetch is not None \
                    else self.ctx.next_forward(self)
                self._prefetch("forward", targets)
        self.swap_in()
        mp = self.mp_policy
        param_dtype = getattr(mp, "param_dtype", None) if mp is not None else None
        if param_dtype is not None and getattr(mp, "cast_forward_inputs", False):
            cast = lambda t: t.to(param_dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
            args, kwargs = tree_map(cast, args), tree_map(cast, kwargs)
        if not backward and self.has_frozen and torch.is_grad_enabled():
            args, kwargs = self._register_post_backward(args, kwargs)
        return args, kwargs

    def _register_post_backward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        flat, spec = tree_flatten((args, kwargs))
        where = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not where:  # nothing to hang it on: the end-of-backward callback frees the unit
            return args, kwargs
        out = _PostBackward.apply(self, *[flat[i] for i in where])
        out = out if isinstance(out, tuple) else (out,)
        for i, t in zip(where, out):
            flat[i] = t
        from torch.utils._pytree import tree_unflatten

        return tree_unflatten(flat, spec)

    def post_forward(self, output: Any) -> Any:
        if not self.user_unsharded:
            self.swap_out()
            keep = self.is_root and torch.is_grad_enabled()  # FSDP2: the root stays for backward
            if self.reshard_after_forward and not keep and not in_backward():
                self.free_data()
        if torch.is_grad_enabled() and not in_backward():
            tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(tensors, self._pre_backward, mode="any")
        output_dtype = getattr(self.mp_policy, "output_dtype", None) if self.mp_policy is not None else None
        if output_dtype is not None:
            output = tree_map(
                lambda t: t.to(output_dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
                output,
            )
        return output

    def _pre_backward(self, grad: torch.Tensor) -> None:
        self.ctx.queue_final_callback()
        self.ctx.note_backward(self)
        with comm_phase("backward"):
            self.unshard_data()
            targets = self.backward_prefetch if self.backward_prefetch is not None \
                else self.ctx.next_backward(self)
            self._prefetch("backward", targets)
        # swapped in for the backward: an activation-checkpoint recomputation reads the
        # module's parameters and must find the gathered ones
        self.swap_in()

    def _make_accumulate_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(_param: torch.Tensor) -> None:
            self.ctx.queue_final_callback()
            self._accumulated.add(index)
            if (self.requires_gradient_sync and not self._reduced
                    and self._accumulated >= self._grad_indices):
                with comm_phase("backward"):
                    self.reduce_grads()
                self._reduced = True
                # a frozen parameter may still be read by a later backward node of this unit
                # (e.g. a frozen LayerNorm weight for its input gradient): free at post-backward
                if not self.user_unsharded and not self.has_frozen:
                    self.swap_out()
                    self.free_data()

        return hook

    @property
    def has_frozen(self) -> bool:
        return len(self._grad_indices) < len(self.handles)

    def post_backward(self) -> None:
        """The unit's backward is complete (all its inputs have gradients): reduce, free."""
        with comm_phase("backward"):
            if self.requires_gradient_sync and not self._reduced:
                self.reduce_grads()
                self._reduced = True
        if self.requires_gradient_sync and not self.user_unsharded:
            self.swap_out()
            self.free_data()

    def finish_backward(self) -> None:
        """End of backward: reduce what the hooks did not (same decision on every rank)."""
        if self.requires_gradient_sync and not self._reduced:
            self.reduce_grads()  # only parameters that got a gradient; none: no collective
        self._accumulated.clear()
        self._reduced = False
        if not self.user_unsharded:
            self.swap_out()
            self.free_data()

    # -- user-facing ------------------------------------------------------------------------
    def user_unshard(self) -> None:
        self.unshard_data()
        self.swap_in()
        self.user_unsharded = True

    def user_reshard(self) -> None:
        self.user_unsharded = False
        self.swap_out()
        self.free_data()

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
from .collectives import SegmentLayout, all_gather_v, reduce_scatter_v

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
        self.unsharded: nn.Parameter | None = None
        self._nbytes = 0

    def create_unsharded(self, on_accumulate: Callable[[torch.Tensor], None]) -> None:
        requires_grad = self.sharded.requires_grad
        if self.aliases_resident:
            t = nn.Parameter(self.sharded.detach(), requires_grad=requires_grad)
        else:
            t = nn.Parameter(
                torch.empty(self.shard.shape, dtype=self.compute_dtype, device=self.sharded.device),
                requires_grad=requires_grad,
            )
        if requires_grad:
            t.register_post_accumulate_grad_hook(on_accumulate)
        self.unsharded = t
        self._nbytes = t.numel() * t.element_size()

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
            module._parameters[name] = tensor


class ShardingContext:
    """What the units of one sharded model share: group, rank, plan, end-of-backward callback."""

    def __init__(self, group: Any, rank: int, world_size: int, plan: ShardingPlan) -> None:
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.plan = plan
        self.units: list[ShardedUnit] = []
        self._queued_for: int | None = None

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
        shards = [h.shard for h in handles]
        self.gather_layout = SegmentLayout.build(shards, W)
        self.reduce_layout = SegmentLayout.build(shards, W, include=lambda s: s.requires_grad)
        self._grad_indices = frozenset(i for i, h in enumerate(handles) if h.sharded.requires_grad)
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
        self._accumulated: set[int] = set()
        self._reduced = False
        for i, h in enumerate(handles):
            h.create_unsharded(self._make_accumulate_hook(i))
            h.free()

    # -- data movement ------------------------------------------------------------------------
    def unshard_data(self) -> None:
        """All-gather-v every rank's segment into the unsharded tensors (no-op if valid)."""
        if self.data_valid:
            return
        ctx, layout = self.ctx, self.gather_layout
        me = ctx.rank
        with torch.no_grad():
            send = torch.empty(layout.sizes[me], dtype=self.gather_dtype, device=self.device)
            for e in layout.entries[me]:
                send[e.offset:e.offset + e.length].copy_(self.handles[e.index].sharded.reshape(-1))
            for h in self.handles:
                h.alloc()
            parts = all_gather_v(send, layout.sizes, me, ctx.group)
            for r in range(ctx.world_size):
                for e in layout.entries[r]:
                    h = self.handles[e.index]
                    if r == me and h.aliases_resident:
                        continue
                    h.write(parts[r][e.offset:e.offset + e.length], e.rows)
        self.data_valid = True

    def free_data(self) -> None:
        for h in self.handles:
            h.free()
        self.data_valid = False

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
        """Reduce-scatter-v the unsharded gradients; the DDP average lands on the owners."""
        ctx, layout = self.ctx, self.reduce_layout
        W, me = ctx.world_size, ctx.rank
        with torch.no_grad():
            chunks = []
            for r in range(W):
                buf = torch.zeros(layout.sizes[r], dtype=self.reduce_dtype, device=self.device)
                for e in layout.entries[r]:
                    g = self.handles[e.index].unsharded.grad
                    if g is None:
                        continue
                    if e.rows is not None:
                        g = g[e.rows[0]:e.rows[1]]
                    buf[e.offset:e.offset + e.length].copy_(g.reshape(-1))
                chunks.append(buf)
            total = reduce_scatter_v(chunks, me, ctx.group)
            total.div_(W)
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
        with comm_phase("backward" if in_backward() else "forward"):
            self.unshard_data()
        self.swap_in()
        mp = self.mp_policy
        param_dtype = getattr(mp, "param_dtype", None) if mp is not None else None
        if param_dtype is not None and getattr(mp, "cast_forward_inputs", False):
            cast = lambda t: t.to(param_dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
            args, kwargs = tree_map(cast, args), tree_map(cast, kwargs)
        return args, kwargs

    def post_forward(self, output: Any) -> Any:
        if not self.user_unsharded:
            self.swap_out()
            keep = self.is_root and torch.is_grad_enabled()  # FSDP2: the root stays for backward
            if self.reshard_after_forward and not keep and not in_backward():
                self.free_data()
        if torch.is_grad_enabled():
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
        if not self.data_valid:
            with comm_phase("backward"):
                self.unshard_data()

    def _make_accumulate_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(_param: torch.Tensor) -> None:
            self.ctx.queue_final_callback()
            self._accumulated.add(index)
            if (self.requires_gradient_sync and not self._reduced
                    and self._accumulated >= self._grad_indices):
                with comm_phase("backward"):
                    self.reduce_grads()
                self._reduced = True
                if not self.user_unsharded:
                    self.free_data()

        return hook

    def finish_backward(self) -> None:
        """End of backward: reduce what the hooks did not (same decision on every rank)."""
        if self.requires_gradient_sync and not self._reduced:
            if any(self.handles[i].unsharded.grad is not None for i in self._grad_indices):
                self.reduce_grads()
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

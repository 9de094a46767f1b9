"""One parameter of a unit: its sharded tensor (what the user and the optimizer see), its
unsharded tensor (what compute reads) and the places it is registered.

Two tensor objects per parameter, as FSDP2: ``sharded`` (an owner-layout DTensor: this rank's
piece, the very object the model had after ``fully_shard``) and ``unsharded`` (a leaf
``nn.Parameter`` swapped in for compute). On the owner at full precision the unsharded tensor
aliases the sharded one's storage (no copy, never freed); with a lower ``param_dtype`` it is a
low-precision buffer, gathered like the others. Freed storage is released with
``untyped_storage().resize_(0)``, so what autograd saved stays valid and is revived in place by
the next gather.

With gradient sync off, the unsharded gradients move after each backward into a per-parameter
accumulator in ``reduce_dtype`` (fp32 for bf16 compute with fp32 reduce, as FSDP2 accumulates),
which the next synced backward reduces once.
"""

from __future__ import annotations

import torch
from torch import nn

from ..owner_dtensor import like_layout
from ..planning.metadata import MatrixShard
from ..replica_sync import attach_replica, get_replica
from ..tensors import local_tensor

__all__ = ["ParamHandle"]


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
            grad = like_layout(self.sharded, g)  # type: ignore[arg-type]
            place = get_replica(self.sharded)
            if place is not None:  # HSDP: GradScaler agrees found_inf over the replicas too
                attach_replica(grad, place)
            self.sharded.grad = grad
        else:
            local_tensor(grad).add_(g)

    def run_post_accumulate_grad_hooks(self) -> None:
        """Run the hooks the user registered with ``register_post_accumulate_grad_hook`` on the
        sharded parameter, now that its reduced ``.grad`` landed. Autograd never runs them: the
        graph holds the unsharded tensor, not the sharded one. FSDP2 runs them at the same point
        (``foreach_reduce``, after the reduce-scatter assigned ``.grad``), once per parameter
        per reduction, on every rank (off the owner ``.grad`` is an empty piece)."""
        hooks = getattr(self.sharded, "_post_accumulate_grad_hooks", None)
        for hook in list((hooks or {}).values()):
            hook(self.sharded)

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

"""One parameter of a unit (:class:`ParamHandle`) and where a unit's parameters are registered
(:class:`RegistrationSlots`).

Two tensor objects per parameter, as FSDP2: ``sharded`` (the owner-layout DTensor the user and
the optimizer see) and ``unsharded`` (a leaf ``nn.Parameter`` swapped in for compute; on a rank
holding the whole tensor at full precision an alias of its storage, else a buffer freed with
``untyped_storage().resize_(0)`` and revived in place). A tensor-parallel parameter (``tp=True``)
moves over dp as its TP slice, and its unsharded tensor is a stock DTensor on the tp mesh with
TP's placement, as torch's FSDP2 wraps its all-gather output for 2D. With gradient sync off, the
gradients accumulate per parameter in ``reduce_dtype``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from ..owner_dtensor import contiguous_stride, like_layout
from ..owner_dtensor.two_dim import tp_mesh_of
from ..planning.metadata import MatrixShard
from ..tensors import local_tensor

__all__ = ["ParamHandle", "RegistrationSlots"]


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
        *,
        tp: bool = False,
    ) -> None:
        self.shard = shard
        self.tp = tp
        self.locations = locations
        self.sharded = sharded
        self.rank = rank
        self.compute_dtype = compute_dtype
        self.is_owner = shard.is_owned_by(rank)
        self.aliases_resident = False
        self.accumulated = None
        self._unsharded: nn.Parameter | None = None
        self._data: torch.Tensor | None = None  # the unsharded tensor's plain data (its TP slice under TP)
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
            grad._tree = self.sharded._tree  # type: ignore[attr-defined]  # HSDP: found_inf over the replicas
            self.sharded.grad = grad
        else:
            local_tensor(grad).add_(g)

    def run_post_accumulate_grad_hooks(self) -> None:
        """Run the user's post-accumulate-grad hooks of the sharded parameter now that its reduced
        ``.grad`` landed (autograd's graph holds the unsharded tensor; FSDP2 runs them here too)."""
        with torch._C.DisableTorchFunctionSubclass():  # a metadata read: no subclass hook
            hooks = getattr(self.sharded, "_post_accumulate_grad_hooks", None)
        for hook in list((hooks or {}).values()):  # the user's code: torch functions as usual
            hook(self.sharded)

    @property
    def unsharded(self) -> nn.Parameter:
        """The tensor swapped in for compute (created once, revived and freed in place)."""
        if self._unsharded is None:
            raise RuntimeError(f"{self.shard.fqn}: the unsharded tensor was not created yet")
        return self._unsharded

    @property
    def unsharded_data(self) -> torch.Tensor:
        """The plain tensor gathers write into and frees release: the unsharded tensor itself,
        or under tensor parallelism its local TP slice."""
        if self._data is None:
            raise RuntimeError(f"{self.shard.fqn}: the unsharded tensor was not created yet")
        return self._data

    def _holds_whole(self) -> bool:
        """This rank's resident piece is the whole tensor: its owner, or every row of a ``rows``
        tensor (one rank). Compute can then read the resident storage itself."""
        if self.is_owner:
            return True
        shard = self.shard
        return (
            not self.tp
            and shard.owner is None
            and len(shard.shape) > 0
            and shard.row_range(self.rank) == (0, shard.shape[0])
        )

    def create_unsharded(self) -> None:
        """(Re)create the unsharded tensor for the sharded one's current device and dtype."""
        self.aliases_resident = self._holds_whole() and self.compute_dtype == self.sharded.dtype
        requires_grad = self.sharded.requires_grad
        if self.aliases_resident:
            data = self.local.detach()
        else:
            data = torch.empty(self.shard.shape, dtype=self.compute_dtype, device=self.sharded.device)
        if self.tp:  # TP's forward computes with a DTensor on the tp mesh of TP's placement
            shape = self.sharded.shape
            spec = DTensorSpec(
                tp_mesh_of(self.sharded),
                (self.sharded.placements[1],),  # type: ignore[attr-defined]
                tensor_meta=TensorMeta(shape, contiguous_stride(shape), self.compute_dtype),
            )
            wrapped = DTensor.__new__(DTensor, data, spec, requires_grad=False)  # type: ignore[call-arg]
            t = nn.Parameter(wrapped, requires_grad=requires_grad)
        else:
            t = nn.Parameter(data, requires_grad=requires_grad)
            data = t
        self._unsharded = t
        self._data = data
        self._nbytes = data.numel() * data.element_size()
        self.accumulated = None

    def _slice_of_grad(self, g: torch.Tensor) -> torch.Tensor:
        """A gradient as the plain tensor the reduction sums: under TP its local slice in TP's
        placement (a ``Partial`` one reduced over tp first, as torch's FSDP2 does)."""
        if not self.tp or not isinstance(g, DTensor):
            return g
        want = (self.sharded.placements[1],)  # type: ignore[attr-defined]
        if tuple(g.placements) != want:
            g = g.redistribute(placements=want)
        return g._local_tensor

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
            storage = self.unsharded_data.untyped_storage()
            if storage.size() != self._nbytes:
                storage.resize_(self._nbytes)

    def free(self) -> None:
        if not self.aliases_resident:
            storage = self.unsharded_data.untyped_storage()
            if storage.size() != 0:
                storage.resize_(0)

    def write(self, flat: torch.Tensor, rows: tuple[int, int] | None) -> None:
        """Copy gathered elements into the unsharded tensor without bumping its version."""
        t = self.unsharded_data
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
        g = self._slice_of_grad(g)
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
        if g is not None:
            g = self._slice_of_grad(g)
        if acc is None:
            return g
        if g is not None:
            acc.add_(g.detach().to(acc.dtype))
        return acc


class RegistrationSlots:
    """Every place a unit's parameters are registered, with the tensor each direction puts there,
    resolved once (rebuilt with the unsharded tensors): a swap is one loop of dict stores, as
    FSDP2's ``_unsharded_param`` / ``_sharded_param`` swap."""

    unsharded: list[tuple[nn.Module, str, torch.Tensor]]
    sharded: list[tuple[nn.Module, str, torch.Tensor]]

    def __init__(self, handles: Sequence[ParamHandle]) -> None:
        self.unsharded = [(m, name, h.unsharded) for h in handles for m, name in h.locations]
        self.sharded = [(m, name, h.sharded) for h in handles for m, name in h.locations]
        self._first = self.unsharded[0] if self.unsharded else None

    def swap(self, unsharded: bool) -> None:
        """Register the unsharded tensors (compute) or the sharded ones (the user's view)."""
        for module, name, t in self.unsharded if unsharded else self.sharded:
            module._parameters[name] = t  # type: ignore[assignment]  # as FSDP2 swaps

    def unsharded_registered(self) -> bool:
        """Whether the unsharded tensors are the registered ones (read at the first place)."""
        first = self._first
        return first is not None and first[0]._parameters.get(first[1]) is first[2]

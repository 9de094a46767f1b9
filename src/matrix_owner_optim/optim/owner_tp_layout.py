"""The owner layout on tensor-parallel blocks: TP slices held whole by their dp owner.

After the package's ``fully_shard(block, mesh=mesh["dp"])`` on blocks ``parallelize_module``
made tensor parallel, a parameter is an owner-layout DTensor on the 2D (dp, tp) mesh
(``owner_dtensor/two_dim.py``): rank ``(o, t)`` holds TP slice ``t`` whole, where ``o`` is the
dp coordinate the plan made its owner (planned on global shapes, so every tp coordinate planned
the same list and the owners of one matrix are the ranks ``(o, 0..T-1)``: the TP group of dp
coordinate ``o``). Backward already landed each slice's dp-averaged gradient on ``(o, t)``.

A step on :class:`OwnerTPLayout`:

* matrices split by TP (``Shard(0)`` colwise, ``Shard(1)`` rowwise): the owners assemble the
  whole matrix and its whole gradient with one all-gather over their TP group per dtype
  (``mesh_slice.assemble``: a header saying which gradients exist, then every owned
  matrix's weight and gradient slice; no dp traffic), step it with the matrix optimizer
  (Newton-Schulz on the global matrix: exact; every TP owner steps the same matrix, ``T`` times
  in all, as the stock TP path does) and keep their slice. The weights travel too, so the
  owners' full copies are never stale (a load, an outside edit) at the price of twice the
  gradient's bytes.
* expert-parallel stacks (torchtitan's routed experts ``[E, out, in]``, ``Shard(0)`` on ep,
  the package's ``fully_shard`` over efsdp: the 2D mesh is (efsdp, ep)): an ep slice is whole
  experts, so its owner steps its local piece as a stack of matrices, expert by expert (the
  ``"stack"`` view declared on the ``step_shape`` of the slice), with no collective over ep or
  efsdp. A >2D matrix cut any other way on the 2D mesh (inside each expert, a conv kernel) is
  refused on every rank, naming it.
* everything else (biases, norms, matrices replicated on tp): the owner steps its local piece
  with its optimizer (AdamW is elementwise: exact on a slice).

Ranks at other dp coordinates hold empty pieces and do nothing: no collective there, and the
per-TP-group collectives are symmetric within each group, so nothing waits on a rank that has
nothing to step. Optimizer state exists only on the owners ``(o, *)``.

State dicts: a whole-stepped matrix's state is the whole tensor held by its owner over the dp
group (as on the 1D owner layout and the stock TP path, so DCP moves it between them); state of a
local piece is a piece of the parameter's 2D layout (see ``state_entry``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import Shard

from ..agreement import STEP_DIGITS, check_header_steps, step_digits
from ..owner_dtensor import OwnerDTensor, as_owner_dtensor, is_owner_dtensor, mesh_of_group
from ..owner_dtensor.placement import spec_piece
from ..owner_dtensor.two_dim import is_2d, same_spec_2d, wrap_2d
from ..planning.metadata import Role, chunk_row_sizes, get_shard_rank
from ..tensors import local_tensor
from .layouts import UpdateLayout, holder_local, plain_local
from .mesh_slice import AxisKind, MeshSlice, assemble, message_sizes
from .routing import RoutedParam

__all__ = ["OwnerTPLayout"]


@dataclass
class _Assembled:
    """A matrix this rank's TP group owns: its TP slice and the owner's whole working copy."""

    rp: RoutedParam
    tp: MeshSlice
    full: torch.Tensor  # the proxy the matrix optimizer steps


def _check_expert_slice(rp: RoutedParam, tp: Shard) -> None:
    """A >2D matrix on a 2D mesh is stepped where it is only as an expert-parallel slice: a
    3D stack (the ``"stack"`` view: ``[E, out, in]`` read as ``E`` matrices) split along its
    stack dim (``Shard(0)`` on ep), whose slice is whole experts. Anything else would step
    pieces of matrices (expert tensor parallel's ``Shard(1)``/``Shard(2)``, a conv kernel or
    a >3D tensor cut on ep): refused, naming the parameter."""
    p = rp.param
    view = rp.view.kind if rp.view is not None else None
    if tp.dim != 0 or p.dim() != 3 or view != "stack":
        what = f"the {view!r} matrix view" if view is not None else "no matrix view"
        raise ValueError(
            f"matrix {rp.label!r} is a {p.dim()}D tensor {tuple(p.shape)} with placements "
            f"{tuple(p.placements)} and {what}; the owner layout on a 2D mesh steps 2D matrices "  # type: ignore[attr-defined]
            "(assembled over tp) and expert-parallel stacks: a 3D stack of experts ('stack' view) "
            "split by Shard(0) on ep, each ep slice whole experts stepped by its owner. Route it "
            f"to the tail optimizer (roles={{{rp.label!r}: 'tail'}}), or keep each expert whole"
        )


class OwnerTPLayout(UpdateLayout):
    """Owner-layout parameters on a 2D (dp, tp) mesh (see the module docstring)."""

    name = "owner_tp"

    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        self._assembled: list[_Assembled] = []
        self._local: list[RoutedParam] = []
        self.steps = 0  # before_step calls

    def add(self, entries: list[RoutedParam]) -> None:
        """Route ``entries`` (module docstring): on their owners, TP-split 2D matrices to the
        assembly over tp, expert-parallel stacks and everything else to local steps; elsewhere
        no proxy."""
        for rp in entries:
            self.entries.append(rp)
            shard, p = rp.shard, rp.param
            if shard is None or shard.owner is None:
                raise ValueError(f"{rp.label!r}: a tensor-parallel owner-layout parameter without its plan")
            rp.owner = shard.owner
            piece = local_tensor(p)
            tp = p.placements[1]  # type: ignore[attr-defined]
            experts = rp.role is Role.MATRIX and isinstance(tp, Shard) and p.dim() > 2
            if experts:  # checked on every rank, owners or not: refused alike
                _check_expert_slice(rp, tp)
            if get_shard_rank(p) != shard.owner:
                rp.proxy = None
                continue
            if experts:  # this ep slice's whole experts: stepped where they are, no collective
                rp.step_shape = tuple(piece.shape)
                rp.proxy = piece.detach()
                self._local.append(rp)
            elif rp.role is Role.MATRIX and isinstance(tp, Shard):
                mesh = p.device_mesh  # type: ignore[attr-defined]
                T = mesh.size(1)
                sizes = tuple(chunk_row_sizes(int(p.shape[tp.dim]), T))
                slice_ = MeshSlice(AxisKind.TP, 1, tp.dim, mesh.get_local_rank(1), sizes)
                full = torch.empty(tuple(p.shape), dtype=piece.dtype, device=piece.device)
                rp.proxy = full
                self._assembled.append(_Assembled(rp, slice_, full))
            else:  # elementwise steps are exact on the slice: the local piece is the proxy
                rp.proxy = piece.detach()
                self._local.append(rp)

    def _buckets(self) -> dict[torch.dtype, list[_Assembled]]:
        out: dict[torch.dtype, list[_Assembled]] = {}
        for a in self._assembled:
            out.setdefault(a.full.dtype, []).append(a)
        return out

    def before_step(self) -> None:
        self.steps += 1  # the TP assembly checks every owner is at the same step
        for rp in self._local:
            assert rp.proxy is not None
            grad = rp.param.grad
            rp.proxy.grad = None if grad is None else local_tensor(grad).view(rp.proxy.shape)
        for dtype, mats in self._buckets().items():
            self._assemble(dtype, mats)

    def _assemble(self, dtype: torch.dtype, mats: list[_Assembled]) -> None:
        """One all-gather over the owners' TP group: every owner gets every matrix whole, and
        its gradient (the header says which gradients exist, the same on every TP owner)."""
        slices = [(a.tp, tuple(a.full.shape)) for a in mats for _ in range(2)]
        mine: list[torch.Tensor] = []
        header: list[float] = []
        for a in mats:
            piece = local_tensor(a.rp.param)
            grad = a.rp.param.grad
            header.append(0.0 if grad is None else 1.0)
            mine.append(piece)
            mine.append(torch.zeros_like(piece) if grad is None else local_tensor(grad))
        group = mats[0].rp.param.device_mesh.get_group(1)  # type: ignore[attr-defined]
        header += step_digits(self.steps)
        headers, whole = assemble(
            group, header, slices, mine, dtype=dtype, device=mats[0].full.device, op="owner_tp_gather"
        )
        check_header_steps(self.steps, headers, who="TP assembly", among="the TP group")
        for i, a in enumerate(mats):
            a.full.copy_(whole[2 * i])
            a.full.grad = whole[2 * i + 1] if headers[a.tp.rank][i] > 0 else None

    def after_step(self) -> None:
        with torch.no_grad():
            for a in self._assembled:
                local_tensor(a.rp.param).copy_(a.tp.narrow(a.full, a.tp.rank))
        self.zero_grad(True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for rp in self.entries:
            if rp.proxy is not None:
                rp.proxy.grad = None

    # -- state dicts -----------------------------------------------------------------------------
    # A matrix stepped whole keeps its state whole on each of its TP owners: its entry is that
    # whole tensor held by the owner over the dp group (``OwnerDTensor.owned``), the form the
    # 1D owner layout and the stock TP path give a matrix's state, so DCP moves it between
    # them (the T owners write the same chunk; DCP keeps one). State stepped on the local piece
    # (AdamW's moments of a TP slice) is a piece of the parameter's own 2D layout. Scalars
    # (``step``) stay plain, as torch keeps them.
    @staticmethod
    def _steps_whole(rp: RoutedParam) -> bool:
        """Whether ``rp`` is a matrix split by TP, assembled and stepped whole (see ``add``)."""
        p = rp.param
        return rp.role is Role.MATRIX and p.dim() == 2 and isinstance(p.placements[1], Shard)  # type: ignore[attr-defined]

    @staticmethod
    def _dp_mesh(rp: RoutedParam, device_type: str) -> Any:
        return mesh_of_group(rp.param.device_mesh.get_group(0), device_type)  # type: ignore[attr-defined]

    def state_entry(self, rp: RoutedParam, key: str, value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            return value
        p = rp.param
        whole = self._steps_whole(rp)
        want = tuple(p.shape) if whole else tuple(local_tensor(p).shape)
        if tuple(value.shape) != want:
            raise ValueError(
                f"optimizer state {key!r} of {rp.label!r} has shape {tuple(value.shape)}; on the owner layout "
                f"on a (dp, tp) mesh its state must be per element of the {'matrix' if whole else 'TP slice'} "
                f"{want}, or a scalar"
            )
        if whole:
            assert rp.owner is not None
            return OwnerDTensor.owned(value, rp.owner, self._dp_mesh(rp, value.device.type), want)
        return wrap_2d(OwnerDTensor, value, p)

    def state_holder(self, rp: RoutedParam) -> tuple[int, Any] | None:
        """Only the owners ``(o, *)`` hold state; the other dp coordinates list it empty."""
        assert rp.owner is not None
        return rp.owner, rp.param.device_mesh.get_group(0)  # type: ignore[attr-defined]

    def empty_state_entry(self, rp: RoutedParam, shape: tuple[int, ...], dtype: torch.dtype, device: str) -> Any:
        if self._steps_whole(rp):
            return None  # the owner's whole matrix: an empty piece held by it (the default)
        p = rp.param
        return wrap_2d(OwnerDTensor, torch.empty(tuple(local_tensor(p).shape), dtype=dtype, device=device), p)

    def state_local(self, rp: RoutedParam, key: str, value: Any) -> Any:
        """This owner's value of state ``key``: the whole matrix's (from its owned entry, a full
        tensor, or a replicated DTensor), or the local TP slice's (from a piece of the
        parameter's layout, or cut out of a full tensor)."""
        what = f"optimizer state {key!r} of {rp.label!r}"
        value = as_owner_dtensor(value)
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            return plain_local(value, what) if isinstance(value, torch.Tensor) else value
        p = rp.param
        if is_owner_dtensor(value) and is_2d(value):
            if not same_spec_2d(value, p):  # type: ignore[arg-type]
                raise ValueError(
                    f"{what}: a piece of layout {tuple(value.placements)} on mesh {tuple(value.device_mesh.shape)}, "
                    f"the parameter's is {tuple(p.placements)} on {tuple(p.device_mesh.shape)}; load a full "  # type: ignore[attr-defined]
                    "state dict or go through DCP"
                )
            return local_tensor(value)
        if is_owner_dtensor(value) and value.holder is not None:
            return holder_local(value, rp.owner if self._steps_whole(rp) else None, what)
        full = plain_local(value, what)
        if self._steps_whole(rp) or tuple(full.shape) == tuple(local_tensor(p).shape) != tuple(p.shape):
            return full
        return spec_piece(full, p)

    def bytes_per_step(self) -> int:
        """Bytes this rank sends plus receives in one step: per dtype, its message (header, its
        weight and gradient slices, padded to the largest TP rank's) to each of the ``T-1``
        other TP owners, and theirs back."""
        total = 0
        for dtype, mats in self._buckets().items():
            T = mats[0].tp.size
            width = max(
                message_sizes(len(mats) + STEP_DIGITS, [(a.tp, tuple(a.full.shape)) for a in mats for _ in range(2)])
            )
            total += 2 * (T - 1) * width * torch.empty((), dtype=dtype).element_size()
        return total

    def extra_resident_bytes(self) -> int:
        """The owners' whole working copies of their TP matrices (and their gradients at a step)."""
        return sum(a.full.numel() * a.full.element_size() for a in self._assembled)

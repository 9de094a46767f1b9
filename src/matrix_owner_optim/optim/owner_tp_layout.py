"""The owner layout on tensor-parallel blocks: TP slices held whole by their dp owner.

On the owners (one TP group), TP-split matrices are assembled (``mesh_slice.assemble``), stepped
whole and cut back to the slice; expert stacks and everything else step on the local piece
(DESIGN.md, "The owner layout x tensor parallel").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import Shard

from ..agreement import STEP_DIGITS, check_header_steps, step_digits
from ..owner_dtensor import mesh_of_group
from ..planning.metadata import Role, chunk_row_sizes, get_shard_rank
from ..tensors import local_tensor
from .layouts import UpdateLayout, give_grads
from .mesh_slice import AxisKind, MeshSlice, assemble, message_sizes
from .routing import RoutedParam
from .state_place import StatePlace

__all__ = ["OwnerTPLayout"]


@dataclass
class _Assembled:
    """A matrix this rank's TP group owns: its TP slice and the owner's whole working copy."""

    rp: RoutedParam
    tp: MeshSlice
    full: torch.Tensor  # the proxy the matrix optimizer steps


def _check_expert_slice(rp: RoutedParam, tp: Shard) -> None:
    """Refuse a >2D matrix on a 2D mesh unless it is a 3D ``"stack"`` split by ``Shard(0)`` on ep."""
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
        """Route ``entries``: on their owners, TP-split matrices to the assembly, the rest local."""
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
        give_grads(self._local)
        for dtype, mats in self._buckets().items():
            self._assemble(dtype, mats)

    def step_groups(self) -> list[tuple[str, Any]]:
        """The TP group of each dtype's assembly (its owners'; the same matrices on each)."""
        groups: list[Any] = []
        for mats in self._buckets().values():
            group = mats[0].rp.param.device_mesh.get_group(1)  # type: ignore[attr-defined]
            if not any(g is group for g in groups):
                groups.append(group)
        return [("the TP group", g) for g in groups]

    def _assemble(self, dtype: torch.dtype, mats: list[_Assembled]) -> None:
        """One all-gather over the TP group: every owner gets every matrix and gradient whole."""
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

    def state_place(self, rp: RoutedParam) -> StatePlace:
        """An assembled matrix's state is held whole by its owner over the dp group (as on the 1D
        layout, so DCP moves it between them); state of a local piece is a piece of its layout."""
        p = rp.param
        whole = rp.role is Role.MATRIX and p.dim() == 2 and isinstance(p.placements[1], Shard)  # type: ignore[attr-defined]
        mesh = mesh_of_group(p.device_mesh.get_group(0), local_tensor(p).device.type)  # type: ignore[attr-defined]
        return StatePlace(mesh, holder=rp.owner, like=None if whole else p, held_elsewhere=True)

    def bytes_per_step(self) -> int:
        """Bytes this rank sends plus receives in one step (the padded TP messages, both ways)."""
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

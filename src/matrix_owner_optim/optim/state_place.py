"""Where a parameter's optimizer state lies: one base rule for every layout, both directions.

A scalar stays plain; a value shaped like the parameter's local piece (``StatePlace.like``) or its
rows (``StatePlace.rows``) is a piece of its layout; anything else is ``StatePlace.holder``'s. A
layout says only where (``UpdateLayout.state_place``); :func:`entry`, :func:`empty_entry` and
:func:`local` apply the rule (DESIGN.md, "State dicts and checkpoints").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.distributed.tensor import DTensor, Replicate

from ..owner_dtensor import OwnerDTensor, as_owner_dtensor, is_owner_dtensor, same_placement
from ..owner_dtensor.placement import spec_piece
from ..owner_dtensor.two_dim import wrap_2d
from ..planning.bands import RowBand, band_holds_key
from ..tensors import is_dtensor, local_tensor

__all__ = ["NOT_HELD", "RowPieces", "StatePlace", "empty_entry", "entry", "holder_local", "local", "plain_local"]


class _NotHeld:
    """What :func:`local` returns for a saved entry another rank holds: the loader keeps nothing."""

    def __repr__(self) -> str:
        return "NOT_HELD"

    def __deepcopy__(self, memo: dict[int, Any]) -> _NotHeld:
        return self


NOT_HELD = _NotHeld()


@dataclass(frozen=True)
class RowPieces:
    """A tensor split by rows over ``mesh`` as ``placement``: ``rows`` in all, here ``[start, stop)``."""

    mesh: Any
    placement: Any
    rows: int
    start: int
    stop: int

    @property
    def device_mesh(self) -> Any:  # read as a DTensor's spec by _same_layout
        return self.mesh

    @property
    def placements(self) -> tuple[Any, ...]:
        return (self.placement,)


@dataclass(frozen=True)
class StatePlace:
    """Where one parameter's state lies (see the module docstring).

    ``holder``: the rank of ``mesh`` holding whole values; ``like``/``rows``: the layouts a value
    may be a piece of; ``band``: per-block keys held here; ``held_elsewhere``: some ranks list its
    keys as empty entries; ``here``: a held entry must be this rank's in its own mesh."""

    mesh: Any
    holder: int | None = None
    like: torch.Tensor | None = None
    rows: RowPieces | None = None
    band: RowBand | None = None
    held_elsewhere: bool = False
    here: bool = True


def _like(value: torch.Tensor, p: Any) -> torch.Tensor:
    """``value`` (shaped like ``p``'s local tensor) as a piece of ``p``'s layout."""
    if is_owner_dtensor(p):
        return wrap_2d(OwnerDTensor, value, p)
    return DTensor.from_local(
        value, p.device_mesh, list(p.placements), run_check=False, shape=p.shape, stride=p.stride()
    )


def _rows_entry(value: torch.Tensor, rows: RowPieces) -> OwnerDTensor:
    return OwnerDTensor.make(value, rows.mesh, rows.placement, (rows.rows, *value.shape[1:]))


def entry(place: StatePlace | None, key: str, value: Any, what: str) -> Any:
    """``value`` (state ``key`` on this rank) as a state-dict entry (``what`` names it)."""
    if place is None or not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    if place.band is not None and band_holds_key(place.band, key) is not None:  # a block: held here
        return OwnerDTensor.owned(value, place.mesh.get_local_rank(), place.mesh, tuple(value.shape))
    if place.rows is not None:
        if int(value.shape[0]) != place.rows.stop - place.rows.start:
            raise ValueError(
                f"{what} has shape {tuple(value.shape)}; state of a tensor split by rows must keep this "
                f"rank's {place.rows.stop - place.rows.start} rows on dim 0, or be a scalar"
            )
        return _rows_entry(value, place.rows)
    if place.like is not None and tuple(value.shape) == tuple(local_tensor(place.like).shape):
        return _like(value, place.like)
    if place.holder is None:
        raise ValueError(
            f"{what} has shape {tuple(value.shape)}; state stepped on a local piece must be per element "
            f"(shape {tuple(local_tensor(place.like).shape) if place.like is not None else '?'}) or a scalar"
        )
    return OwnerDTensor.owned(value, place.holder, place.mesh, tuple(value.shape))


def spec(value: Any) -> tuple[Any, ...]:
    """What another rank needs to list ``value``'s entry empty."""
    if not isinstance(value, torch.Tensor):
        return ("value", value)
    if value.dim() == 0 and not is_dtensor(value):
        return ("value", value.detach().cpu().clone())
    holder = value.holder if is_owner_dtensor(value) else None
    kind = "like" if is_dtensor(value) and value.device_mesh.ndim == 2 else "held"  # type: ignore[attr-defined]
    return (tuple(value.shape), str(value.dtype).removeprefix("torch."), value.device.type, holder, kind)


def empty_entry(place: StatePlace, s: tuple[Any, ...], *, stepped_here: bool, banded: bool) -> Any:
    """The entry this rank lists for a value it holds none of (``s``: :func:`spec` of the holder's)."""
    if s[0] == "value":
        return s[1]
    shape, dtype_name, device, holder, kind = s
    dtype = getattr(torch, dtype_name)
    if kind == "like" and place.like is not None:  # a TP slice's piece: this rank's (empty) piece
        return _like(torch.empty(tuple(local_tensor(place.like).shape), dtype=dtype, device=device), place.like)
    empty = torch.empty((0, *shape[1:]) if shape else (), dtype=dtype, device=device)
    if shape and not stepped_here:
        from ..owner_dtensor import OwnerShard

        return OwnerDTensor.make(empty, place.mesh, OwnerShard(0, ((0, 0),) * place.mesh.size()), shape)
    if banded and holder is not None:  # another owner's block
        return OwnerDTensor.owned(empty, holder, place.mesh, shape)
    if place.rows is not None:  # none of the rows here
        return OwnerDTensor.make(empty, place.rows.mesh, place.rows.placement, shape)
    assert place.holder is not None
    return OwnerDTensor.owned(empty if shape else empty.zero_(), place.holder, place.mesh, shape)


def holder_local(value: OwnerDTensor, owner: int | None, what: str, *, here: bool = True) -> torch.Tensor:
    """The one holder check: ``value``'s local tensor if it is held by ``owner`` (and, with
    ``here``, by this rank), else the error naming both."""
    if value.holder != owner or (here and not value.is_holder):
        raise ValueError(
            f"{what}: held by rank {value.holder} in the state dict, by rank {owner} here; load a full "
            "state dict or go through DCP"
        )
    return local_tensor(value)


def plain_local(value: Any, what: str) -> Any:
    """A full tensor from a plain tensor or a replicated DTensor; other pieces are an error."""
    if is_dtensor(value):
        if all(isinstance(p, Replicate) for p in value.placements):
            return local_tensor(value)
        raise ValueError(
            f"{what}: the state dict holds a piece ({type(value).__name__}, placements "
            f"{tuple(value.placements)}) but this rank keeps the whole tensor; load a full state dict "
            "or go through DCP (dcp.load into get_optimizer_state_dict(model, optimizer))"
        )
    return value


def _same_layout(value: Any, ref: Any, shape: tuple[int, ...]) -> bool:
    """Whether the DTensor ``value`` of global ``shape`` is a piece of ``ref``'s layout here."""
    return (
        is_dtensor(value)
        and tuple(value.shape) == shape
        and len(value.placements) == len(ref.placements)
        and all(same_placement(a, b) for a, b in zip(value.placements, ref.placements, strict=True))
        and tuple(value.device_mesh.shape) == tuple(ref.device_mesh.shape)
        and value.device_mesh.get_coordinate() == ref.device_mesh.get_coordinate()
    )


def local(place: StatePlace | None, key: str, value: Any, what: str) -> Any:
    """This rank's value of state ``key`` from a state-dict entry (:data:`NOT_HELD`: another's block)."""
    value = as_owner_dtensor(value)
    if not isinstance(value, torch.Tensor):
        return value
    held = isinstance(value, OwnerDTensor) and value.holder is not None
    if place is None or (value.dim() == 0 and not held):
        return plain_local(value, what)
    if place.band is not None and (mine := band_holds_key(place.band, key)) is not None:
        if held:
            return local_tensor(value) if cast(OwnerDTensor, value).holder == place.mesh.get_local_rank() else NOT_HELD
        return plain_local(value, what) if mine else NOT_HELD
    rows = place.rows
    if rows is not None and _same_layout(value, rows, (rows.rows, *value.shape[1:])):
        return local_tensor(value)
    if place.like is not None and _same_layout(value, place.like, tuple(place.like.shape)):
        return local_tensor(value)
    full = (
        holder_local(cast(OwnerDTensor, value), place.holder, what, here=place.here)
        if held
        else plain_local(value, what)
    )
    if rows is not None and full.dim():
        if int(full.shape[0]) == rows.rows:
            return full[rows.start : rows.stop]
        if int(full.shape[0]) == rows.stop - rows.start:
            return full
        raise ValueError(
            f"{what}: shape {tuple(full.shape)}, expected the {rows.rows} rows of the tensor on dim 0 "
            f"(rows {rows.start}..{rows.stop} here); load a checkpoint of a model built the same way"
        )
    if place.like is not None and tuple(full.shape) == tuple(place.like.shape) != tuple(local_tensor(place.like).shape):
        return spec_piece(full, place.like)
    if place.like is not None and place.holder is None and tuple(full.shape) != tuple(local_tensor(place.like).shape):
        raise ValueError(
            f"{what}: shape {tuple(full.shape)} is neither the parameter's {tuple(place.like.shape)} nor "
            f"its local piece's {tuple(local_tensor(place.like).shape)}"
        )
    return full

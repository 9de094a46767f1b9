"""The holder-local rule's agreement (``dispatch.py``): an error the holder raised on its values,
or a result whose metadata is not what ``meta`` gave the other ranks, known on every rank (one
all-gather of two integers per rank). DESIGN.md, "The representation", has the rules.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from .. import comm
from .base import OwnerTensorBase

__all__ = ["agree"]


# Exceptions an operator raises, by code: the other ranks raise the holder's type (0: none).
_ERRORS: tuple[type[BaseException], ...] = (
    RuntimeError,
    ValueError,
    IndexError,
    TypeError,
    NotImplementedError,
    KeyError,
    ZeroDivisionError,
    OverflowError,
    torch.linalg.LinAlgError,
)


def _error_code(exc: BaseException) -> int:
    for code, kind in reversed(list(enumerate(_ERRORS, start=1))):  # subclasses (LinAlgError) first
        if isinstance(exc, kind):
            return code
    return 1  # RuntimeError


def _metadata_digest(out: Any, written: set[int]) -> int:
    """A digest of a result's structure: every new tensor's shape, stride, dtype and conjugate /
    negative bits, other values' reprs (what must be the same on every rank; never a tensor's
    data). A written argument returned (``ids`` in ``written``) counts by position only: the
    caller gets its own tensor back, whose layout is its spec's."""
    leaves, spec = tree_flatten(out)
    parts = [str(spec)]
    for t in leaves:
        if isinstance(t, torch.Tensor) and id(t) in written:
            parts.append("W")
        elif isinstance(t, torch.Tensor):
            parts.append(f"T{tuple(t.shape)}{tuple(t.stride())}{t.dtype}{t.is_conj():d}{t.is_neg():d}")
        else:
            parts.append(f"{type(t).__name__}:{t!r}")
    return zlib.crc32("|".join(parts).encode())


def agree(
    mesh: Any,
    func: Any,
    args_flat: list,
    written_ids: set[int],
    holder: int,
    error: BaseException | None,
    out: Any,
    converted: list,
) -> bool:
    """Every rank's (error code, result digest) gathered: raises the holder's error on every
    rank; False where the holder's result differs in metadata from the others' (meta) result."""
    written = {id(c) for a, c in zip(args_flat, converted, strict=True) if id(a) in written_ids}
    mine = torch.tensor(
        [_error_code(error) if error is not None else 0, _metadata_digest(out, written) if error is None else 0],
        dtype=torch.int64,
        device=_device(args_flat),
    )
    flat = torch.empty(2 * mesh.size(), dtype=torch.int64, device=mine.device)
    comm.all_gather_into_tensor(flat, mine, group=mesh.get_group(), name="holder_agreement")
    table = flat.view(mesh.size(), 2)
    code, digest = (int(v) for v in table[holder].tolist())
    if code:  # every rank learns the holder's message, then raises
        said = comm.all_gather_object(str(error) if error is not None else None, group=mesh.get_group())
        if error is not None:
            raise error
        raise _ERRORS[code - 1](f"{func} raised on rank {holder}, which holds its tensors: {said[holder]}")
    other = next(r for r in range(mesh.size()) if r != holder)
    return digest == int(table[other, 1])


def _device(flat: list) -> torch.device:
    """Where the agreement's integers live: the first owner-layout argument's piece's device."""
    return next(a._local_tensor.device for a in flat if isinstance(a, OwnerTensorBase))

"""Row bands: the rows of one matrix that one owner steps when a plan cut the matrix between
owners at block boundaries (blocked Shampoo's blocks as ownable units).

The router declares a band on the tensor it hands the matrix optimizer
(:func:`declare_row_band`): which rows ``[start, stop)`` of a whole matrix of ``rows`` rows it
is. An optimizer that accepts bands (``accepts_row_bands``: Shampoo) steps a band as the whole
matrix's blocks it holds, names their state with the whole matrix's block indices (``L_3_0`` is
block row 3 wherever it lives, so a state dict reads the same at every world size) and records
its block rows on the band (``RowBand.block``); :func:`band_holds_key` then says whether a state
key names a block of this band. Pure metadata: no process group, no tensor data.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

__all__ = ["RowBand", "declare_row_band", "row_band_of", "block_row_of_key", "band_holds_key"]

_BAND_ATTR = "_moo_row_band"
# a per-block state key: a name, then the block's row and column indices ("L_root_3_0")
_BLOCK_KEY = re.compile(r"^(?P<name>[A-Za-z_]+?)_(?P<i>\d+)_(?P<j>\d+)$")


@dataclass
class RowBand:
    """Rows ``[start, stop)`` of a matrix of ``rows`` rows; ``block``: the rows of the blocks
    its optimizer cuts it into, once the optimizer has read the band (None before)."""

    start: int
    stop: int
    rows: int
    block: int | None = None

    def check_block(self, block: int, what: str) -> None:
        """Raise ``ValueError`` unless the band's cuts fall on multiples of ``block``."""
        if self.start % block or (self.stop % block and self.stop != self.rows):
            raise ValueError(
                f"{what}: rows [{self.start}, {self.stop}) of a {self.rows}-row matrix are not whole blocks "
                f"of {block} rows; the plan was priced with another block size. Let the optimizer fix the "
                "plan (build OwnerRoutedOptimizer before the first forward) or name it in fully_shard("
                "preconditioner=shampoo_cost(max_preconditioner_dim=...))"
            )


def declare_row_band(tensor: torch.Tensor, start: int, stop: int, rows: int) -> RowBand:
    """Record on ``tensor`` (a band's rows, as the optimizer will update them) which rows of a
    ``rows``-row matrix it holds."""
    if not 0 <= start <= stop <= rows or stop - start != (tensor.shape[0] if tensor.dim() else 0):
        raise ValueError(f"declare_row_band: rows [{start}, {stop}) of {rows} do not fit a {tuple(tensor.shape)}")
    band = RowBand(int(start), int(stop), int(rows))
    setattr(tensor, _BAND_ATTR, band)
    return band


def row_band_of(tensor: torch.Tensor) -> RowBand | None:
    """The band declared on ``tensor``, or None (a whole matrix)."""
    band = getattr(tensor, _BAND_ATTR, None)
    return band if isinstance(band, RowBand) else None


def block_row_of_key(key: str) -> int | None:
    """The block row index of a per-block state key (``"L_3_0"`` -> 3), None for other keys."""
    match = _BLOCK_KEY.match(key)
    return int(match.group("i")) if match else None


def band_holds_key(band: RowBand, key: str) -> bool | None:
    """Whether the block a per-block state key names lies in ``band`` (None: not a per-block
    key, e.g. per-element state). ``ValueError`` before the optimizer recorded its block rows."""
    i = block_row_of_key(key)
    if i is None:
        return None
    if band.block is None:
        raise ValueError(f"state key {key!r}: the band's block rows are unknown (no optimizer has read the band)")
    return band.start <= i * band.block < band.stop

"""Matrix views: how a parameter is read as the ``[out, in]`` matrices a matrix optimizer steps.

One rule for the roles (:mod:`.roles`), the cost model (:mod:`.cost`) and the preconditioners. A
:class:`MatrixView` is ``"matrix"`` (a 2D ``[out, in]``), ``"stack"`` (leading dims index
independent matrices: fused experts ``[E, 2I, H]``) or ``"conv"`` (a kernel ``[out, in, *k]``,
one ``(out, in * prod(k))`` matrix), optionally with ``row_blocks``/``block_rows`` splitting each
matrix's rows into blocks stepped as separate matrices (a fused ``wqkv`` as q, k, v). The
default (:func:`default_matrix_view`), the ``matrix_views=`` glob overrides and the
:class:`MatrixLayout` a routed tensor carries (:func:`declare_matrix_view`) are DESIGN.md's
("Matrix views").
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from .globs import GlobOverrides

__all__ = [
    "MatrixView",
    "MatrixLayout",
    "MATRIX",
    "STACK",
    "CONV",
    "VIEW_KINDS",
    "CONV_NAME_HINTS",
    "parse_matrix_view",
    "default_matrix_view",
    "ViewOverrides",
    "declare_matrix_view",
    "matrix_layout_of",
]

VIEW_KINDS = ("matrix", "stack", "conv")
# Substrings of a parameter name that mark a convolution kernel when no module type is known.
CONV_NAME_HINTS: tuple[str, ...] = ("conv",)


@dataclass(frozen=True)
class MatrixView:
    """How a tensor is read as matrices: ``kind`` and an optional split of each matrix's rows.

    Args:
        kind: ``"matrix"`` (2D), ``"stack"`` (leading dims are a batch of ``[out, in]``
            matrices) or ``"conv"`` (``(out, rest)``).
        row_blocks: row counts of the fused blocks of each matrix (sum = its rows), e.g.
            ``(d, d_kv, d_kv)`` for a GQA ``wqkv``; empty: one block.
        block_rows: equal blocks of this many rows (per head: the head dim); exclusive with
            ``row_blocks``.
    """

    kind: str = "matrix"
    row_blocks: tuple[int, ...] = ()
    block_rows: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in VIEW_KINDS:
            raise ValueError(f"MatrixView kind must be one of {VIEW_KINDS}, got {self.kind!r}")
        object.__setattr__(self, "row_blocks", tuple(int(b) for b in self.row_blocks))
        if any(b < 1 for b in self.row_blocks):
            raise ValueError(f"MatrixView row_blocks must be positive, got {self.row_blocks}")
        if self.block_rows is not None and (self.row_blocks or int(self.block_rows) < 1):
            raise ValueError("MatrixView: give row_blocks or a positive block_rows, not both")

    @property
    def label(self) -> str:
        """A short name for reports: ``stack``, ``matrix/blocks(64,64,64)``, ``conv``."""
        if self.row_blocks:
            return f"{self.kind}/blocks{self.row_blocks}"
        if self.block_rows is not None:
            return f"{self.kind}/blocks of {self.block_rows} rows"
        return self.kind

    def resolve(self, shape: Sequence[int], name: str | None = None) -> MatrixLayout:
        """The concrete layout of a tensor of ``shape``; ``ValueError`` naming it if it does not fit."""
        shape = tuple(int(s) for s in shape)
        what = f"parameter {name!r}" if name else "tensor"
        if len(shape) < 2:
            raise ValueError(
                f"{what} with shape {shape} cannot be read as matrices ({self.label}): matrix "
                "optimizers need at least 2 dims; route it to the tail"
            )
        if self.kind == "matrix" and len(shape) != 2:
            raise ValueError(
                f"{what} with shape {shape} is not 2D; view it as 'stack' (leading dims a batch "
                "of [out, in] matrices) or 'conv' ((out, rest)) in matrix_views="
            )
        if self.kind == "stack":
            batch, rows, cols = math.prod(shape[:-2]), shape[-2], shape[-1]
        elif self.kind == "conv":
            batch, rows, cols = 1, shape[0], math.prod(shape[1:])
        else:
            batch, rows, cols = 1, shape[0], shape[1]
        blocks = self.row_blocks
        if self.block_rows is not None:
            if rows % self.block_rows:
                raise ValueError(
                    f"{what} with shape {shape}: {rows} rows do not split into blocks of "
                    f"{self.block_rows} ({self.label})"
                )
            blocks = (int(self.block_rows),) * (rows // self.block_rows)
        if blocks and sum(blocks) != rows:
            raise ValueError(
                f"{what} with shape {shape}: row blocks {blocks} sum to {sum(blocks)}, not to its "
                f"{rows} rows ({self.label})"
            )
        runs: list[tuple[int, int, int]] = []  # (first row, blocks, rows per block)
        start = 0
        for size in blocks or (rows,):
            if runs and runs[-1][2] == size:
                first, count, _ = runs[-1]
                runs[-1] = (first, count + 1, size)
            else:
                runs.append((start, 1, size))
            start += size
        return MatrixLayout(shape, self.kind, batch, rows, cols, tuple(runs))


MATRIX = MatrixView("matrix")
STACK = MatrixView("stack")
CONV = MatrixView("conv")


@dataclass(frozen=True)
class MatrixLayout:
    """A :class:`MatrixView` applied to one shape: ``batch`` matrices of ``rows x cols``, each
    cut into ``runs`` of equal row blocks ``(first row, number of blocks, rows per block)``.

    The matrices, in order: run by run, then batch index, then block (what :meth:`run_views`
    flattens); every one is a ``rows-per-block x cols`` matrix of its own.
    """

    shape: tuple[int, ...]
    kind: str
    batch: int
    rows: int
    cols: int
    runs: tuple[tuple[int, int, int], ...]

    @property
    def single(self) -> bool:
        """One plain matrix (no batch, no blocks): optimizer state keeps the matrix's own shape."""
        return self.batch == 1 and len(self.runs) == 1 and self.runs[0][1] == 1

    @property
    def num_matrices(self) -> int:
        return self.batch * sum(count for _, count, _ in self.runs)

    def matrix_shapes(self) -> list[tuple[int, int, int]]:
        """Per run: ``(how many matrices, rows, cols)``, the unit the cost model prices."""
        return [(self.batch * count, size, self.cols) for _, count, size in self.runs]

    def grid(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (this layout's numel, any shape that views so) as ``(batch, rows, cols)``."""
        if tensor.numel() != self.batch * self.rows * self.cols:
            raise ValueError(
                f"tensor of shape {tuple(tensor.shape)} does not hold a matrix layout of shape {self.shape}"
            )
        return tensor.view(self.batch, self.rows, self.cols)

    def run_views(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Per run, a view ``(batch, blocks, rows per block, cols)`` of ``tensor``'s storage."""
        grid = self.grid(tensor)
        return [grid[:, first : first + count * size].unflatten(1, (count, size)) for first, count, size in self.runs]

    def matrices(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every matrix of ``tensor`` as a 2D view, in this layout's order."""
        return (
            [m for run in self.run_views(tensor) for m in run.flatten(0, 1).unbind(0)]
            if not self.single
            else [self.grid(tensor)[0]]
        )

    def state_key(self, key: str, run: int) -> str:
        """Key of run ``run``'s per-matrix optimizer state: ``key`` for one run, else suffixed."""
        return key if len(self.runs) == 1 else f"{key}_m{run}"


def parse_matrix_view(value: str | MatrixView, where: str = "matrix_views") -> MatrixView:
    """A :class:`MatrixView` from itself or its kind's name, or a ``ValueError`` naming ``where``."""
    if isinstance(value, MatrixView):
        return value
    if isinstance(value, str) and value.lower() in VIEW_KINDS:
        return MatrixView(value.lower())
    raise ValueError(
        f"{where}: expected one of {', '.join(repr(k) for k in VIEW_KINDS)} or a MatrixView "
        f"(e.g. MatrixView('matrix', row_blocks=(d, d, d)) for a fused wqkv), got {value!r}"
    )


def default_matrix_view(
    shape: Sequence[int], *, conv: bool | None = None, name: str | None = None
) -> MatrixView | None:
    """The default reading of a tensor (the module docstring's rule); None when ambiguous.

    ``conv`` says whether its module is a convolution (None: no module known, then the name
    decides with :data:`CONV_NAME_HINTS`). None for a >3D tensor of unknown origin.
    """
    if len(shape) == 2:
        return MATRIX
    if len(shape) < 2:
        return None
    if conv is None and name is not None:
        conv = any(h in name.lower() for h in CONV_NAME_HINTS) or None
    if conv:
        return CONV
    if conv is False or len(shape) == 3:
        return STACK
    return None


def ambiguous_view_error(name: str | None, shape: Sequence[int]) -> ValueError:
    what = f"parameter {name!r}" if name else "a tensor"
    glob = name or "<its fqn>"
    return ValueError(
        f"{what} with shape {tuple(shape)} takes the matrix role, but a >3D tensor of unknown "
        "origin may be a stack of matrices or a conv kernel; say which with "
        f"matrix_views={{{glob!r}: 'stack' | 'conv'}} (or declare_matrix_view(tensor, ...)), or "
        "route it to the tail"
    )


class ViewOverrides(GlobOverrides[MatrixView]):
    """``matrix_views={"fqn-glob": view}`` (:class:`~.globs.GlobOverrides`: the last match wins,
    an unmatched glob is an error)."""

    what = "matrix_views"
    scope = "parameter of the matrix role"
    example = "layers.0.mlp.experts.down_proj"

    def __init__(self, views: Mapping[str, str | MatrixView] | None) -> None:
        super().__init__(views, lambda v, where: parse_matrix_view(v, where=where))  # type: ignore[arg-type]

    def view_for(self, names: Sequence[str], shape: Sequence[int], conv: bool | None) -> MatrixView:
        """The override, else the default; ``ValueError`` when neither decides."""
        view = self.lookup(names) or default_matrix_view(shape, conv=conv, name=names[0] if names else None)
        if view is None:
            raise ambiguous_view_error(names[0] if names else None, shape)
        return view


_LAYOUT_ATTR = "_moo_matrix_layout"


def declare_matrix_view(
    tensor: torch.Tensor,
    view: str | MatrixView,
    *,
    shape: Sequence[int] | None = None,
    name: str | None = None,
) -> MatrixLayout:
    """Record on ``tensor`` how matrix optimizers read it; returns the resolved layout.

    ``shape`` is the shape the view applies to (default ``tensor.shape``): the router declares a
    stack's layout on the ``(out, rest)`` 2D view of its storage it hands the optimizer.
    """
    layout = parse_matrix_view(view).resolve(tuple(tensor.shape) if shape is None else shape, name)
    if math.prod(layout.shape) != tensor.numel():
        raise ValueError(
            f"declare_matrix_view: a view of shape {layout.shape} does not fit a tensor of shape {tuple(tensor.shape)}"
        )
    setattr(tensor, _LAYOUT_ATTR, layout)
    return layout


def matrix_layout_of(tensor: torch.Tensor, name: str | None = None) -> MatrixLayout:
    """The layout declared on ``tensor``, else the default from its shape alone (2D: a matrix,
    3D: a stack); ``ValueError`` naming ``name`` for anything else."""
    layout = getattr(tensor, _LAYOUT_ATTR, None)
    if isinstance(layout, MatrixLayout) and math.prod(layout.shape) == tensor.numel():
        return layout
    view = default_matrix_view(tuple(tensor.shape))
    if view is None and tensor.dim() >= 2:
        raise ambiguous_view_error(name, tuple(tensor.shape))
    return (view or MATRIX).resolve(tuple(tensor.shape), name)  # <2D: resolve says what to do

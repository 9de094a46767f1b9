"""Helpers shared by the single-tensor matrix optimizers (Muon, Shampoo, SOAP): the non-2D error,
Shampoo's inverse roots, the state dtype, and :class:`MatrixOptimizer`, the base that checks
every parameter reads as matrices and keeps state dtypes across ``load_state_dict``. Nothing in
``preconditioners`` imports ``torch.distributed``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from itertools import chain
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from ..planning.bands import row_band_of
from ..planning.views import _LAYOUT_ATTR, MatrixLayout, default_matrix_view, matrix_layout_of

__all__ = [
    "require_2d",
    "matrix_inverse_root",
    "state_dtype_for",
    "as_float",
    "check_nonnegative",
    "MatrixOptimizer",
    "MatrixState",
    "matrix_positions",
]


def require_2d(
    tensor: Tensor,
    optimizer: str = "Muon/Shampoo/SOAP",
    name: str | None = None,
    what: str = "parameter",
) -> None:
    """Raise ``ValueError`` unless ``tensor`` is 2D, naming ``optimizer``, the shape, ``what``
    (``"parameter"`` or ``"gradient"``) and ``name`` when given, and saying what to do: a conv
    kernel goes as a 2D view ``(out, rest)`` (the router does this) or to the AdamW tail."""
    if tensor.ndim == 2:
        return
    label = f"{what} {name!r}" if name else what
    raise ValueError(
        f"{optimizer} only accepts 2D tensors; got a {label} of shape {tuple(tensor.shape)}. "
        "Give conv kernels a 2D view (out, rest) or route them to the tail."
    )


def state_dtype_for(param: Tensor) -> torch.dtype:
    """Precision for a matrix optimizer's state: float64 for float64 params, else float32."""
    return torch.float64 if param.dtype == torch.float64 else torch.float32


def check_nonnegative(lr: float | Tensor, **values: float) -> None:
    """``ValueError`` for a tensor ``lr`` of more than one element, or ``lr`` or any of ``values``
    (by name) below 0: the checks every matrix optimizer's constructor shares with torch's."""
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    for name, value in {"lr": lr, **values}.items():
        if not 0.0 <= value:
            raise ValueError(f"{name} must be >= 0, got {value}")


def as_float(value: float | Tensor) -> float:
    """A Python float from a float or a one-element tensor (torch.optim allows tensor ``lr``)."""
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"expected a one-element tensor, got shape {tuple(value.shape)}")
        return float(value.item())
    return float(value)


def eigh_with_retry(a: Tensor) -> tuple[Tensor, Tensor]:
    """``torch.linalg.eigh(a)``, retried in float64 on a convergence failure (``a``'s dtype out):
    Distributed Shampoo's "protected eigh". The exception is the only signal (a NaN check would
    need a host sync); a float64 failure propagates."""
    try:
        return torch.linalg.eigh(a)
    except RuntimeError:
        if a.dtype == torch.float64:
            raise
        evals, evecs = torch.linalg.eigh(a.to(torch.float64))
        return evals.to(a.dtype), evecs.to(a.dtype)


def matrix_inverse_root(
    mat: Tensor,
    exponent: float,
    eps: float,
    *,
    root_dtype: torch.dtype = torch.float64,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """``(mat + damping * I) ** (-1 / exponent)`` of a symmetric PSD ``mat`` (Shampoo's roots).

    The damping is relative, ``eps * ||mat||_F``: isotropic (Shampoo stays equivariant under
    rotations of the gradient) and scale-free, as ``L^-1/4 G R^-1/4`` is. An all-zero ``mat``
    (no gradient yet) gives the identity, so a stale root degrades to SGD, not to ``eps^(-1/p)``.
    Eigenvalues are clamped below at the damping, so round-off never gives NaN or inf. No host
    sync (the zero case and the clamp are tensor operations). ``root_dtype``: the
    eigendecomposition's precision; ``out_dtype``: the result's (default ``mat.dtype``).
    """
    if mat.ndim != 2 or mat.shape[0] != mat.shape[1]:
        raise ValueError(f"matrix_inverse_root needs a square matrix, got {tuple(mat.shape)}")
    out_dtype = mat.dtype if out_dtype is None else out_dtype
    a = mat.to(root_dtype)
    scale = torch.linalg.matrix_norm(a)  # Frobenius norm, a 0-dim tensor (no sync)
    damping = eps * scale
    eye = torch.eye(a.shape[0], dtype=root_dtype, device=mat.device)
    evals, evecs = eigh_with_retry(a + damping * eye)
    floor = damping.clamp_min(torch.finfo(root_dtype).tiny)
    evals = torch.maximum(evals, floor).pow(-1.0 / exponent)
    root = (evecs * evals.unsqueeze(0)) @ evecs.T
    root = torch.where(scale > 0, root, eye)
    return root.to(out_dtype)


class MatrixOptimizer(Optimizer):
    """Base class of the matrix optimizers: shape check at construction, dtype-preserving loads.

    Every tensor is stepped as the matrices of its :class:`~..planning.views.MatrixLayout`
    (:meth:`matrix_layout`), each exactly as alone (``accepts_matrix_views``). Subclasses set
    ``_NAME`` (for errors) and implement ``_step_group(group)``; errors name a parameter from
    ``group["param_names"]`` when built from ``named_parameters()``.
    """

    _NAME: str = "Muon/Shampoo/SOAP"
    accepts_matrix_views: bool = True
    # Whether a band of a matrix (rows a plan gave this owner, planning.bands) steps exactly as
    # those rows of the whole matrix: only for blocked optimizers (Shampoo's blocks).
    accepts_row_bands: bool = False

    def __init__(self, params: Any, defaults: dict[str, Any]) -> None:
        super().__init__(params, defaults)
        for group in self.param_groups:
            for i, p in enumerate(group["params"]):
                self._check_shape(p, group, self._param_name(group, i), "parameter")
                if not self.accepts_row_bands and row_band_of(p) is not None:
                    name = self._param_name(group, i)
                    raise ValueError(
                        f"{self._NAME} steps whole matrices, but {'parameter ' + repr(name) if name else 'a parameter'} "
                        "is a band of a matrix cut between owners (a plan priced for blocked Shampoo); "
                        "plan with this optimizer's cost model"
                    )

    def _check_shape(self, tensor: Tensor, group: Mapping[str, Any], name: str | None, what: str) -> None:
        """Raise unless ``tensor`` reads as matrices (its layout, :meth:`matrix_layout`; SOAP widens it)."""
        if self._default_layout(tensor.shape) is not None:
            return  # its shape reads as matrices by default, so it reads as matrices whatever it declares
        try:
            matrix_layout_of(tensor, name)
        except ValueError as exc:
            label = f"{what} {name!r}" if name else what
            raise ValueError(
                f"{self._NAME} steps 2D matrices (and stacks of them); got a {label} of shape "
                f"{tuple(tensor.shape)}: {exc}"
            ) from None

    def _default_layout(self, shape: torch.Size) -> MatrixLayout | None:
        """The layout a tensor of ``shape`` has when it declares none (None: no default reads it).

        Resolved once per shape and kept on the optimizer: resolving costs ~6 us, which every
        parameter and gradient paid twice per step (``torch.optim.Muon`` pays nothing of the kind).
        """
        cache: dict[torch.Size, MatrixLayout | None] = self.__dict__.setdefault("_default_layouts", {})
        if shape not in cache:
            view = default_matrix_view(shape)
            try:
                cache[shape] = None if view is None else view.resolve(shape)
            except ValueError:
                cache[shape] = None
        return cache[shape]

    def matrix_layout(self, tensor: Tensor) -> MatrixLayout:
        """How ``tensor`` is read as matrices: its declared view, else the default by shape
        (:func:`~..planning.views.matrix_layout_of`, with the default resolved once per shape)."""
        declared = getattr(tensor, _LAYOUT_ATTR, None)
        if isinstance(declared, MatrixLayout) and math.prod(declared.shape) == tensor.numel():
            return declared
        layout = self._default_layout(tensor.shape)
        return matrix_layout_of(tensor) if layout is None else layout

    @staticmethod
    def _param_name(group: Mapping[str, Any], index: int) -> str | None:
        names = group.get("param_names")
        if names is not None and index < len(names):
            return str(names[index])
        return None

    def _grads(self, group: Mapping[str, Any]) -> Iterable[tuple[Tensor, Tensor]]:
        """``(param, grad)`` for each param of ``group`` that has a gradient, checking 2D."""
        for i, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            grad = p.grad
            if grad.is_sparse:
                raise RuntimeError(f"{self._NAME} does not support sparse gradients")
            if torch.is_complex(grad):
                raise RuntimeError(f"{self._NAME} does not support complex parameters")
            self._check_shape(grad, group, self._param_name(group, i), "gradient")
            yield p, grad

    def _step_group(self, group: dict[str, Any]) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one optimization step; returns ``closure()``'s loss when a closure is given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._step_group(group)
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As :meth:`torch.optim.Optimizer.load_state_dict`, but each state tensor keeps its saved
        dtype (the stock load casts floating state to the parameter's dtype, which would round
        float32 factors of a bf16 parameter to bf16; see :func:`state_dtype_for`)."""
        saved_state = state_dict.get("state", {})
        saved_ids = list(chain.from_iterable(g["params"] for g in state_dict["param_groups"]))
        super().load_state_dict(state_dict)
        params = list(chain.from_iterable(g["params"] for g in self.param_groups))
        for pid, p in zip(saved_ids, params, strict=True):
            saved = saved_state.get(pid)
            if not isinstance(saved, Mapping):
                continue
            current = self.state[p]
            for key, value in saved.items():
                if (
                    key != "step"
                    and isinstance(value, Tensor)
                    and value.is_floating_point()
                    and isinstance(current.get(key), Tensor)
                    and current[key].dtype != value.dtype
                ):
                    current[key] = value.to(device=p.device, copy=True)


def matrix_positions(layout: MatrixLayout | None) -> list[tuple[int, int]]:
    """``(run, index within the run)`` of every matrix, in :meth:`MatrixLayout.matrices` order
    (``None``: one plain tensor, e.g. SOAP's 1D parameters)."""
    if layout is None:
        return [(0, 0)]
    return [(run, i) for run, (count, _, _) in enumerate(layout.matrix_shapes()) for i in range(count)]


class MatrixState:
    """One matrix's factors and roots: the state entries themselves for a plain matrix, else
    its slice of the run's stacked entries (``(matrices, r, r)``). ``layout`` None: a plain
    tensor (its own entries)."""

    def __init__(self, state: dict[str, Any], layout: MatrixLayout | None, run: int, index: int) -> None:
        self.state, self.layout, self.run, self.index = state, layout, run, index
        self.single = layout is None or layout.single

    def key(self, key: str) -> str:
        return key if self.layout is None else self.layout.state_key(key, self.run)

    def has(self, key: str) -> bool:
        return self.key(key) in self.state

    def get(self, key: str) -> Tensor:
        value: Tensor = self.state[self.key(key)]
        return value if self.single else value[self.index]

    def set(self, key: str, value: Tensor) -> None:
        if self.single:
            self.state[key] = value
        else:
            self.state[self.key(key)][self.index].copy_(value)

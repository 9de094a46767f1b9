"""Newton-Schulz kernels: the iteration on a matrix or a same-shape stack the caller hands over.

:func:`newton_schulz_` is ``torch.optim.Muon``'s ``_zeropower_via_newtonschulz`` iteration
operation for operation (bitwise equal), on a 2D tensor already in the iteration's dtype; on a
``(k, m, n)`` stack it runs the same steps with batched matmuls. On this package's CPUs (oneDNN bfloat16, MKL float32) each matrix of the stack rounds exactly as
it rounds alone (tests/test_preconditioners.py checks it), which is what lets a rank that steps
a lone matrix agree bitwise with a reference that batches it with others.

Each iteration is torch's fused forms: ``A = X X^T``, ``B = b A + c A A`` (``addmm``/``baddbmm`` with
``beta=b, alpha=c``), ``X = a X + B X`` (``beta=a``), a tall matrix through its transpose (a view)
so the Gram matrix is on the short side. The input is scaled in place (no input copy), the
iterates live in two buffers reused across the iterations: what Muon's batched step uses on the
update stack it wrote. :func:`~.muon.newton_schulz` and :func:`~.muon.newton_schulz_batched`
are the copying forms.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["DEFAULT_NS_COEFFICIENTS", "check_ns_args", "newton_schulz_"]

DEFAULT_NS_COEFFICIENTS: tuple[float, float, float] = (3.4445, -4.775, 2.0315)


def check_ns_args(ns_coefficients: tuple[float, float, float], ns_steps: int) -> None:
    """``ValueError`` for an iteration count of 100 or more, or not three coefficients (torch's checks)."""
    if ns_steps >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    if len(ns_coefficients) != 3:
        raise ValueError("Coefficients must be a tuple of exactly 3 values")


def newton_schulz_(
    x: Tensor,
    ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
    ns_steps: int = 5,
    eps: float = 1e-7,
) -> Tensor:
    """:func:`~.muon.newton_schulz` of a 2D ``x``, or of every matrix of a ``(k, m, n)`` stack,
    already in the iteration's dtype, consuming ``x`` (scaled in place, then scratch).

    For a caller whose ``x`` is its own (Muon's Nesterov update, or the stack its batched step
    wrote), so the copy :func:`~.muon.newton_schulz` makes would be one more pass for nothing.
    A 2D ``x`` runs torch's per-matrix operations, a stack (contiguous) their batched forms, each
    matrix normalised by its own norm; the iterates alternate between two buffers, the Gram
    matrix and its update have one each, so an iteration allocates nothing (:func:`_iterate`).
    Returns ``x``'s shape (a transposed view when tall), in one of the buffers.
    """
    check_ns_args(ns_coefficients, ns_steps)
    if x.ndim not in (2, 3):
        raise ValueError(f"Newton-Schulz needs a 2D matrix or a (k, m, n) stack, got shape {tuple(x.shape)}")
    stacked = x.ndim == 3
    if stacked and not x.is_contiguous():
        raise ValueError(f"expected a contiguous (batch, m, n) stack, got strides {x.stride()}")
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    # each matrix by its own Frobenius norm (a stack's through one reduction over its last dims)
    x.div_((x.norm(dim=(-2, -1), keepdim=True) if stacked else x.norm()).clamp(min=eps))
    if ns_steps:
        x = _iterate(x, ns_coefficients, ns_steps, stacked)
    return x.mT if tall else x


def _iterate(x: Tensor, coefficients: tuple[float, float, float], steps: int, stacked: bool) -> Tensor:
    """``steps`` times ``A = X X^T; B = b A + c A A; X = a X + B X`` in torch's fused calls
    (``mm``/``addmm`` on a matrix, ``bmm``/``baddbmm`` on a stack), into buffers reused across the
    iterations: the same kernels (``out=`` changes where a result goes, not how it is summed).
    ``x`` is read in its own layout at the first iteration (a transposed view for a tall matrix,
    as torch reads it); every later iterate is a contiguous ``(..., short, long)`` result."""
    a, b, c = coefficients
    if type(x) is not Tensor:  # a tensor subclass (an owner-layout DTensor): its own ops' rules
        for _ in range(steps):  # know these calls, not out= ones
            gram = x @ x.mT
            gram_update = (torch.baddbmm if stacked else torch.addmm)(gram, gram, gram, beta=b, alpha=c)
            x = (torch.baddbmm if stacked else torch.addmm)(x, gram_update, x, beta=a)
        return x
    mm, addmm = (torch.bmm, torch.baddbmm) if stacked else (torch.mm, torch.addmm)
    *lead, short, long = x.shape
    buffers = (x.new_empty((*lead, short, long)), x.new_empty((*lead, short, long)))
    gram, gram_update = x.new_empty((*lead, short, short)), x.new_empty((*lead, short, short))
    for i in range(steps):
        mm(x, x.mT, out=gram)
        addmm(gram, gram, gram, beta=b, alpha=c, out=gram_update)
        out = buffers[i % 2]
        addmm(x, gram_update, x, beta=a, out=out)
        x = out
    return x

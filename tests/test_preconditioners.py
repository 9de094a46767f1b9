"""Tests of the single-tensor matrix optimizers (Muon, Shampoo, SOAP).

References are written here independently, densely and in float64 where exactness matters:
Muon is compared with ``torch.optim.Muon`` itself (bf16 path) and with a float32
Newton-Schulz written below; Shampoo with a float64 eigh-based dense loop; SOAP with a
straightforward loop following the paper's algorithm / the official code's step order.
"""

from __future__ import annotations

import copy
import io
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from _ref import rel_err_native
from matrix_owner_optim.planning.cost import MUON_COST, SHAMPOO_COST, SOAP_COST
from matrix_owner_optim.preconditioners import SOAP, Muon, Shampoo, require_2d

SHAPES = [(1, 7), (7, 1), (9, 4), (4, 9), (6, 6)]
ALL = [Muon, Shampoo, SOAP]


def _grads(shape: tuple[int, int], steps: int, seed: int, dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen, dtype=dtype) for _ in range(steps)]


def _run(
    opt_cls: Callable[..., torch.optim.Optimizer],
    p0: torch.Tensor,
    grads: list[torch.Tensor],
    **kw: Any,
) -> torch.Tensor:
    p = p0.clone().requires_grad_()
    opt = opt_cls([p], **kw)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach()


def _random_orthogonal(n: int, gen: torch.Generator) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r)).unsqueeze(0)


# --------------------------------------------------------------------------------------------
# Muon
# --------------------------------------------------------------------------------------------
MUON_SETTINGS = [
    {},
    {"nesterov": False},
    {"weight_decay": 0.0, "momentum": 0.9},
    {"lr": 0.02, "adjust_lr_fn": "match_rms_adamw"},
    {"lr": 0.01, "adjust_lr_fn": "original", "weight_decay": 0.3, "ns_steps": 3},
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kw", MUON_SETTINGS)
def test_muon_bf16_matches_torch_muon(shape: tuple[int, int], kw: dict[str, Any]) -> None:
    p0 = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    grads = _grads(shape, 10, seed=2, dtype=torch.float32)
    ours = _run(Muon, p0, grads, **kw)
    theirs = _run(torch.optim.Muon, p0, grads, **kw)
    assert not torch.equal(ours, p0)
    # Same operations in the same order: bitwise equal.
    assert torch.equal(ours, theirs), rel_err_native(ours, theirs, floor=1e-300)


def _ref_muon_fp32(
    p0: torch.Tensor,
    grads: list[torch.Tensor],
    lr: float = 1e-3,
    weight_decay: float = 0.1,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315),
    eps: float = 1e-7,
    ns_steps: int = 5,
    adjust_lr_fn: str | None = None,
) -> torch.Tensor:
    """Muon as published, with a float32 Newton-Schulz iteration."""
    a, b, c = ns_coefficients
    p = p0.clone().float()
    buf = torch.zeros_like(p)
    rows, cols = p.shape
    if adjust_lr_fn == "match_rms_adamw":
        scale = 0.2 * math.sqrt(max(rows, cols))
    else:
        scale = math.sqrt(max(1.0, rows / cols))
    for g in grads:
        buf = momentum * buf + (1 - momentum) * g
        u = (1 - momentum) * g + momentum * buf if nesterov else buf
        x = u.float()
        if rows > cols:
            x = x.T
        x = x / max(float(x.norm()), eps)
        for _ in range(ns_steps):
            gram = x @ x.T
            x = a * x + (b * gram + c * gram @ gram) @ x
        if rows > cols:
            x = x.T
        p = p * (1 - lr * weight_decay) - lr * scale * x
    return p


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kw", MUON_SETTINGS)
def test_muon_fp32_matches_reference(shape: tuple[int, int], kw: dict[str, Any]) -> None:
    p0 = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    grads = _grads(shape, 10, seed=4, dtype=torch.float32)
    ours = _run(Muon, p0, grads, ns_dtype=torch.float32, **kw)
    ref = _ref_muon_fp32(p0, grads, **kw)
    assert rel_err_native(ours, ref, floor=1e-300) <= 1e-5
    # The accumulated update itself agrees to float32 round-off (NS amplifies it a little).
    assert rel_err_native(ours - p0, ref - p0, floor=1e-300) <= 1e-4
    # And the bf16 path really is a different (lower-precision) computation.
    bf16 = _run(Muon, p0, grads, **kw)
    if shape not in [(1, 7), (7, 1)]:  # rank-1: NS of a vector is exact-ish in any dtype
        assert not torch.equal(bf16, ours)


def _muon_both_paths(
    p0: list[torch.Tensor], grads: list[list[torch.Tensor]], **opts: Any
) -> dict[bool, list[torch.Tensor]]:
    """The parameters after Muon(lr=0.02, **opts) steps ``grads`` from ``p0``, batched and not."""
    out = {}
    for batched in (True, False):
        ps = [p.clone().requires_grad_() for p in p0]
        opt = Muon(ps, lr=0.02, batched=batched, **opts)
        for step_grads in grads:
            for p, g in zip(ps, step_grads, strict=True):
                p.grad = g.clone()
            opt.step()
        out[batched] = [p.detach() for p in ps]
    return out


def _muon_each_alone(p0: list[torch.Tensor], grads: list[list[torch.Tensor]], **opts: Any) -> list[torch.Tensor]:
    """The batched parameters of :func:`_muon_both_paths`, each tensor in a Muon of its own."""
    out = []
    for i, p0_i in enumerate(p0):
        p = p0_i.clone().requires_grad_()
        opt = Muon([p], lr=0.02, batched=True, **opts)
        for step_grads in grads:
            p.grad = step_grads[i].clone()
            opt.step()
        out.append(p.detach())
    return out


def _all_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("ns_dtype", [torch.float32, torch.bfloat16])
def test_muon_batched_equals_per_matrix_within_round_off(ns_dtype: torch.dtype) -> None:
    # Three same-shape matrices per bucket (wide and tall) plus a lone one; 6 steps.
    shapes = [(8, 5)] * 3 + [(5, 8)] * 3 + [(4, 4)]
    gen = torch.Generator().manual_seed(25)
    p0 = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(6)]
    out = _muon_both_paths(p0, grads, ns_dtype=ns_dtype)
    # Measured max relative difference of the accumulated update: 1.9e-6 (float32; NS
    # amplifies round-off a little) and 0 (bfloat16, here); bounds: 1e-5 and bf16's 2^-8 scale.
    bound = 1e-5 if ns_dtype == torch.float32 else 4e-3
    for a, b, p in zip(out[True], out[False], p0, strict=True):
        assert rel_err_native(a - p, b - p, floor=1e-300) <= bound
    # Per-matrix is bitwise torch.optim.Muon for several matrices at once.
    ps = [p.clone().requires_grad_() for p in p0]
    ref = torch.optim.Muon(ps, lr=0.02)
    ours = [p.clone().requires_grad_() for p in p0]
    opt = Muon(ours, lr=0.02, batched=False)
    for step_grads in grads:
        for p, q, g in zip(ps, ours, step_grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        ref.step()
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(ps, ours, strict=True))


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("ns_dtype", [torch.float32, torch.bfloat16])
def test_muon_batched_rounds_each_matrix_as_alone_and_per_matrix_as_torch(
    ns_dtype: torch.dtype, nesterov: bool
) -> None:
    # The batched step (updates written into one stack, buffers reused across iterations) must
    # round each matrix as it does alone: a rank stepping a lone matrix and a reference batching
    # it with others then agree bitwise (test_sharding_features relies on it). In float32 its
    # fast form is torch's, so it is the per-matrix path bitwise; per-matrix is bitwise
    # torch.optim.Muon. Wide, tall and square buckets; a float32 and a bfloat16 parameter; 4 steps.
    shapes = [(48, 32)] * 3 + [(32, 48)] * 3 + [(40, 40)] * 2 + [(24, 16)]
    gen = torch.Generator().manual_seed(41)
    p0 = [torch.randn(s, generator=gen) for s in shapes]
    p0[-2] = p0[-2].bfloat16()  # a bf16 parameter in a float32 bucket's neighbour
    grads = [[torch.randn(p.shape, generator=gen).to(p.dtype) for p in p0] for _ in range(4)]
    out = _muon_both_paths(p0, grads, ns_dtype=ns_dtype, nesterov=nesterov)
    assert _all_equal(out[True], _muon_each_alone(p0, grads, ns_dtype=ns_dtype, nesterov=nesterov))
    if ns_dtype == torch.float32:
        assert _all_equal(out[True], out[False])
    else:  # torch.optim.Muon iterates in bfloat16 only
        ref = [p.clone().requires_grad_() for p in p0]
        torch_opt = torch.optim.Muon(ref, lr=0.02, nesterov=nesterov)
        for step_grads in grads:
            for p, g in zip(ref, step_grads, strict=True):
                p.grad = g.clone()
            torch_opt.step()
        # (without Nesterov torch scales a bf16 parameter's momentum buffer in place, its
        # ``.bfloat16()`` being no copy; this package copies, so that one matrix is left out)
        same = [torch.equal(a, b) for a, b in zip(out[False], ref, strict=True)]
        assert all(same if nesterov else same[:-2] + same[-1:])


def test_muon_batched_bf16_within_the_reference_noise_floor() -> None:
    # The batched bfloat16 step's fast form (on a CPU without bfloat16 matmuls: other layouts,
    # other summation orders) against torch.optim.Muon, beside the reference against itself
    # with each matrix's long side permuted (Muon is equivariant under it; only the Gram's
    # summation order changes). Measured relative difference of the accumulated update, 4
    # steps: at 48 x 32-sized matrices fast vs torch 3e-6..3.6e-3, permuted 0..2.3e-3; at 256 x
    # 1024, 256 x 256: 7e-4..2e-3 and 5e-4..1e-3. Bound 2^-7: two bfloat16 ulps of scale.
    shapes = [(48, 32)] * 2 + [(32, 48)] * 2 + [(96, 160), (40, 40)]
    gen = torch.Generator().manual_seed(43)
    p0 = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(4)]
    perms = [torch.randperm(max(s), generator=gen) for s in shapes]

    def permute(t: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
        return t[:, perm] if t.shape[1] >= t.shape[0] else t[perm]

    def torch_muon(p0: list[torch.Tensor], grads: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        ps = [p.clone().requires_grad_() for p in p0]
        opt = torch.optim.Muon(ps, lr=0.02)
        for step_grads in grads:
            for p, g in zip(ps, step_grads, strict=True):
                p.grad = g.clone()
            opt.step()
        return [p.detach() for p in ps]

    ref = torch_muon(p0, grads)
    permuted_p0 = [permute(p, q) for p, q in zip(p0, perms, strict=True)]
    permuted = torch_muon(permuted_p0, [[permute(g, q) for g, q in zip(gs, perms, strict=True)] for gs in grads])
    noise = [permute(r, torch.argsort(q)) for r, q in zip(permuted, perms, strict=True)]
    batched = _muon_both_paths(p0, grads)[True]
    for p, r, n, b in zip(p0, ref, noise, batched, strict=True):
        assert rel_err_native(n - p, r - p, floor=1e-300) <= 2**-7
        assert rel_err_native(b - p, r - p, floor=1e-300) <= 2**-7


@pytest.mark.parametrize("ns_dtype", [torch.float32, torch.bfloat16])
def test_muon_cpu_stacks_stay_within_the_cache_budget(ns_dtype: torch.dtype) -> None:
    # On a CPU a bucket goes in stacks whose Newton-Schulz working set fits _CPU_STACK_BYTES (a
    # stack streaming out of cache made float32 batched 16% slower than per matrix): 40 plain
    # matrices in full stacks and a remainder, a 30-expert stack (over the cap) alone and uncut,
    # and the result bitwise each tensor's stepped alone, as one stack's would be.
    from matrix_owner_optim.preconditioners.muon import _CPU_STACK_BYTES, _MuonStep

    per_matrix = (2 * 96 * 128 + 2 * 96 * 96) * ns_dtype.itemsize  # tall 128 x 96: short side 96
    cap = _CPU_STACK_BYTES // per_matrix
    assert 1 < cap < 40
    gen = torch.Generator().manual_seed(7)
    p0 = [torch.randn(128, 96, generator=gen) for _ in range(40)] + [torch.randn(cap + 5, 128, 96, generator=gen)]
    grads = [[torch.randn(p.shape, generator=gen) for p in p0] for _ in range(2)]
    pieces = [(i, 0, 1) for i in range(40)] + [(40, 0, cap + 5)]
    step = _MuonStep(
        p0, p0, p0, [], lr=0.0, weight_decay=0.0, momentum=0.0, nesterov=True,
        adjust_lr_fn=None, ns_args=((3.4445, -4.775, 2.0315), 5, 1e-7), ns_dtype=ns_dtype,
    )  # fmt: skip
    stacks = step.batches(pieces, (128, 96), torch.device("cpu"))
    assert [sum(c for *_, c in st) for st in stacks] == [cap] * (40 // cap) + [40 % cap] + [cap + 5]
    assert stacks[-1] == [(40, 0, cap + 5)]
    assert step.batches(pieces, (128, 96), torch.device("meta")) == [pieces]  # off the CPU: one stack
    batched = _muon_both_paths(p0, grads, ns_dtype=ns_dtype)[True]
    assert _all_equal(batched, _muon_each_alone(p0, grads, ns_dtype=ns_dtype))


def test_newton_schulz_stack_equals_batched_and_single() -> None:
    from matrix_owner_optim.preconditioners.muon import newton_schulz, newton_schulz_batched
    from matrix_owner_optim.preconditioners.newton_schulz import newton_schulz_, transposed_forms_pay

    gen = torch.Generator().manual_seed(3)
    for shape in [(4, 24, 16), (4, 16, 24), (3, 20, 20)]:
        g = torch.randn(shape, generator=gen)
        for dtype in (torch.float32, torch.bfloat16):
            stack = g.to(dtype, copy=True)
            ortho = newton_schulz_(stack, ns_steps=5)  # consumes stack
            assert ortho.shape == shape and ortho.dtype == dtype
            assert torch.equal(ortho, newton_schulz_batched(g, ns_dtype=dtype))
            assert torch.equal(ortho, torch.stack([newton_schulz(m, ns_dtype=dtype) for m in g]))
            # the fast form: each matrix of a stack as alone too (float32: torch's form itself)
            fast = newton_schulz_(g.to(dtype, copy=True), torch_forms=False)
            assert fast.shape == shape and fast.dtype == dtype
            alone = torch.stack([newton_schulz_(m.to(dtype, copy=True), torch_forms=False) for m in g])
            assert torch.equal(fast, alone)
            if dtype == torch.float32 or not transposed_forms_pay(g.device, dtype):
                assert torch.equal(fast, ortho)  # no other form there
    with pytest.raises(ValueError, match="contiguous"):
        newton_schulz_(torch.randn(2, 3, 4).mT)


def test_muon_does_not_modify_momentum_buffer_in_fp32_ns() -> None:
    # ns_dtype == param dtype: the NS input must be copied, not scaled in place.
    p = torch.randn(5, 3, requires_grad=True)
    opt = Muon([p], nesterov=False, ns_dtype=torch.float32, momentum=0.5)
    g = torch.randn(5, 3)
    p.grad = g.clone()
    opt.step()
    torch.testing.assert_close(opt.state[p]["momentum_buffer"], 0.5 * g, rtol=0, atol=0)


# --------------------------------------------------------------------------------------------
# Shampoo
# --------------------------------------------------------------------------------------------
# Shampoo against an independent float64 reference of Distributed Shampoo's algorithm (betas,
# grafting, blocking, schedule): tests/test_shampoo_reference.py.


def test_shampoo_one_sided_keeps_only_small_factor() -> None:
    p = torch.randn(3, 12, requires_grad=True)
    opt = Shampoo([p], max_aspect_ratio=2.0)
    p.grad = torch.randn(3, 12)
    opt.step()
    assert "L" in opt.state[p] and "R" not in opt.state[p]
    q = torch.randn(12, 3, requires_grad=True)
    opt = Shampoo([q], max_aspect_ratio=2.0)
    q.grad = torch.randn(12, 3)
    opt.step()
    assert "R" in opt.state[q] and "L" not in opt.state[q]
    assert opt.state[q]["R"].shape == (3, 3)


def test_shampoo_adagrad_grafting_matches_graft_norm() -> None:
    p = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    p0 = p.detach().clone()
    opt = Shampoo([p], lr=1.0, grafting="adagrad", grafting_eps=1e-10)
    g = torch.randn(4, 6, dtype=torch.float64)
    p.grad = g.clone()
    opt.step()
    graft = g / (g.abs() + 1e-10)
    step = p0 - p.detach()
    torch.testing.assert_close(step.norm(), graft.norm(), rtol=1e-12, atol=0)
    # ... but its direction is Shampoo's, not the graft's.
    assert rel_err_native(step / step.norm(), graft / graft.norm(), floor=1e-300) > 1e-3


def test_shampoo_roots_follow_distributed_shampoos_schedule() -> None:
    # Roots are recomputed at t == start and at t > start with t % frequency == 0; reused between.
    p = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    opt = Shampoo([p], precondition_frequency=3, start_preconditioning_step=1)
    roots = [opt.state[p].get("L_root")]
    changed = []
    for t in range(1, 8):
        p.grad = torch.randn(4, 5, dtype=torch.float64)
        opt.step()
        root = opt.state[p]["L_root"].clone()
        if roots[-1] is None or not torch.equal(root, roots[-1]):
            changed.append(t)
        roots.append(root)
    assert changed == [1, 3, 6]


def test_shampoo_float32_root_dtype_close_to_float64() -> None:
    shape = (6, 4)
    p0 = torch.randn(shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    grads = _grads(shape, 5, seed=8, dtype=torch.float64)
    a = _run(Shampoo, p0, grads, eps=1e-6, root_dtype=torch.float64)
    b = _run(Shampoo, p0, grads, eps=1e-6, root_dtype=torch.float32)
    assert rel_err_native(b - p0, a - p0, floor=1e-300) <= 1e-3
    assert torch.isfinite(b).all()


# --------------------------------------------------------------------------------------------
# SOAP
# --------------------------------------------------------------------------------------------
def _ref_soap(
    p0: torch.Tensor,
    grads: list[torch.Tensor],
    lr: float = 3e-3,
    betas: tuple[float, float] = (0.95, 0.95),
    shampoo_beta: float | None = None,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    precondition_frequency: int = 10,
    max_precond_dim: int = 10000,
    merge_dims: bool = False,
    normalize_grads: bool = False,
) -> torch.Tensor:
    """SOAP (Vyas et al. 2024, Algorithm 3 + the official code's step order), dense float64.

    A side longer than ``max_precond_dim`` has no factor (identity basis); with ``merge_dims``
    a matrix of at most ``max_precond_dim`` elements is one vector with one factor.
    """
    beta1, beta2 = betas
    sb = beta2 if shampoo_beta is None else shampoo_beta
    p = p0.clone().double()
    shape = p.shape
    m, n = shape
    if merge_dims and m * n <= max_precond_dim:
        m, n = m * n, 1
        sides = [m <= max_precond_dim, False]
    else:
        sides = [m <= max_precond_dim, n <= max_precond_dim]
    factors = [torch.zeros(d, d, dtype=torch.float64) for d in (m, n)]
    exp_avg = torch.zeros(m, n, dtype=torch.float64)
    exp_avg_sq = torch.zeros(m, n, dtype=torch.float64)
    bases: list[torch.Tensor | None] = [None, None]
    t = 0

    def eig_desc(a: torch.Tensor) -> torch.Tensor:
        w, v = torch.linalg.eigh(a)
        return v[:, torch.argsort(w, descending=True)]

    def rot(x: torch.Tensor, back: bool = False) -> torch.Tensor:
        ql, qr = bases
        if ql is not None:
            x = (ql if back else ql.T) @ x
        if qr is not None:
            x = x @ (qr.T if back else qr)
        return x

    def accumulate(g: torch.Tensor) -> None:
        for i, outer in ((0, g @ g.T), (1, g.T @ g)):
            if sides[i]:
                factors[i] = sb * factors[i] + (1 - sb) * outer

    started = False
    for g in grads:
        g = g.double().reshape(m, n)
        if not started:  # first step: bases only, no update
            started = True
            accumulate(g)
            bases = [eig_desc(factors[i]) if sides[i] else None for i in range(2)]
            continue
        t += 1
        g_rot = rot(g)
        exp_avg = beta1 * exp_avg + (1 - beta1) * g
        exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * g_rot**2
        n_rot = rot(exp_avg) / (exp_avg_sq.sqrt() + eps)
        step_size = lr * math.sqrt(1 - beta2**t) / (1 - beta1**t)
        update = rot(n_rot, back=True)
        if normalize_grads:
            update = update / (1e-30 + update.pow(2).mean().sqrt())
        p = p - step_size * update.reshape(shape)
        p = p * (1 - lr * weight_decay)
        accumulate(g)
        if t % precondition_frequency == 0:
            for i in range(2):
                q = bases[i]
                if q is None:
                    continue
                order = torch.argsort(torch.diag(q.T @ factors[i] @ q), descending=True)
                exp_avg_sq = exp_avg_sq[order, :] if i == 0 else exp_avg_sq[:, order]
                bases[i] = torch.linalg.qr(factors[i] @ q[:, order]).Q
    return p


SOAP_SETTINGS = [
    {"precondition_frequency": 2},
    {"precondition_frequency": 3, "betas": (0.9, 0.99), "shampoo_beta": 0.8, "lr": 0.01},
    {"precondition_frequency": 1, "weight_decay": 0.0},
    {},
]


# Shapes whose first-step factors have at most a 1-dimensional null space. For thinner shapes
# (e.g. 1xN, or m > n + 1) the first factor L = G G^T has a degenerate zero eigenspace whose
# eigh basis is fixed by round-off alone, and Adam-in-that-basis depends on it: SOAP itself
# (and the official code) is ill-defined there, so no two implementations agree bitwise.
@pytest.mark.parametrize("shape", [(5, 5), (6, 5), (5, 6), (4, 4), (7, 6)])
@pytest.mark.parametrize("kw", SOAP_SETTINGS)
def test_soap_matches_reference(shape: tuple[int, int], kw: dict[str, Any]) -> None:
    p0 = torch.randn(shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    grads = _grads(shape, 12, seed=10, dtype=torch.float64)
    ours = _run(SOAP, p0, grads, **kw)
    ref = _ref_soap(p0, grads, **kw)
    assert not torch.equal(ours, p0)
    assert rel_err_native(ours - p0, ref - p0, floor=1e-300) <= 1e-8


@pytest.mark.parametrize(
    "shape,kw",
    [
        ((6, 12), {"max_precond_dim": 8, "precondition_frequency": 2}),  # columns unrotated
        ((12, 5), {"max_precond_dim": 8, "precondition_frequency": 3}),  # rows unrotated
        ((10, 12), {"max_precond_dim": 8, "precondition_frequency": 2}),  # neither side
        ((6, 5), {"merge_dims": True, "max_precond_dim": 20, "precondition_frequency": 2}),
        ((5, 6), {"normalize_grads": True, "precondition_frequency": 2}),
    ],
)
def test_soap_cap_merge_normalize_match_reference(shape: tuple[int, int], kw: dict[str, Any]) -> None:
    p0 = torch.randn(shape, generator=torch.Generator().manual_seed(19), dtype=torch.float64)
    grads = _grads(shape, 12, seed=20, dtype=torch.float64)
    p = p0.clone().requires_grad_()
    opt = SOAP([p], **kw)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    ref = _ref_soap(p0, grads, **kw)
    assert not torch.equal(p.detach(), p0)
    # Same tolerance as test_soap_matches_reference (measured round-off there: ~1e-12).
    assert rel_err_native(p.detach() - p0, ref - p0, floor=1e-300) <= 1e-8
    cap = kw.get("max_precond_dim", 10000)
    square = [t for k, t in opt.state[p].items() if k in ("L", "R", "QL", "QR")]
    assert all(t.shape[0] <= cap for t in square)
    nbytes = sum(t.numel() * t.element_size() for k, t in opt.state[p].items() if k != "step")
    assert nbytes == opt.cost_model.state_bytes(shape, torch.float64)


def test_soap_merge_dims_preconditions_a_small_matrix_as_one_vector() -> None:
    # A 3x4 matrix (12 <= max_precond_dim) is one vector with a 12x12 factor: the same update
    # as SOAP on the 12x1 matrix (whose 1x1 right basis is +-1 and cancels). A vector's first
    # factor is rank 1, so an independent reference would disagree on the arbitrary null-space
    # basis (see the note above test_soap_matches_reference); this compares equal bases.
    gen = torch.Generator().manual_seed(24)
    p0 = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    grads = [torch.randn(3, 4, generator=gen, dtype=torch.float64) for _ in range(8)]
    merged = p0.clone().requires_grad_()
    column = p0.reshape(12, 1).clone().requires_grad_()
    opt_m = SOAP([merged], merge_dims=True, max_precond_dim=16, precondition_frequency=2)
    opt_c = SOAP([column], precondition_frequency=2)
    for g in grads:
        merged.grad, column.grad = g.clone(), g.reshape(12, 1).clone()
        opt_m.step()
        opt_c.step()
    assert opt_m.state[merged]["L"].shape == (12, 12) and "R" not in opt_m.state[merged]
    flat = p0.reshape(12, 1)
    assert rel_err_native(merged.detach().reshape(12, 1) - flat, column.detach() - flat, floor=1e-300) < 1e-12
    assert not torch.equal(merged.detach(), p0)


def test_soap_vocabulary_side_gets_no_factor() -> None:
    w = torch.randn(50, 8, requires_grad=True)  # a "vocabulary" of 50 rows, cap 16
    opt = SOAP([w], max_precond_dim=16)
    for _ in range(3):
        w.grad = torch.randn(50, 8)
        opt.step()
    assert "L" not in opt.state[w] and "QL" not in opt.state[w]
    assert opt.state[w]["R"].shape == (8, 8)
    assert SOAP.cost_model.state_bytes((50, 8), torch.float32) > opt.cost_model.state_bytes((50, 8), torch.float32)


def test_soap_precondition_1d_accepts_vectors() -> None:
    with pytest.raises(ValueError, match=r"\(4,\)"):
        SOAP([torch.nn.Parameter(torch.randn(4))])
    b = torch.nn.Parameter(torch.randn(6))
    opt = SOAP([b], precondition_1d=True, precondition_frequency=2)
    for _ in range(4):
        b.grad = torch.randn(6)
        opt.step()
    assert opt.state[b]["L"].shape == (6, 6) and "R" not in opt.state[b]
    assert torch.isfinite(b).all()


@pytest.mark.parametrize("shape", [(1, 7), (7, 1), (9, 2)])
def test_soap_thin_shapes_run_and_reduce_loss(shape: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(17)
    target = torch.randn(shape, generator=gen)
    w = torch.zeros(shape, requires_grad=True)
    opt = SOAP([w], lr=0.05, precondition_frequency=2, weight_decay=0.0)
    losses = []
    for _ in range(25):
        opt.zero_grad()
        loss = (w - target).square().sum()
        losses.append(float(loss.detach()))
        loss.backward()
        opt.step()
    assert torch.isfinite(w).all()
    assert losses[-1] < 0.5 * losses[0]


def test_soap_first_step_only_builds_bases() -> None:
    p = torch.randn(4, 3, requires_grad=True)
    p0 = p.detach().clone()
    opt = SOAP([p])
    p.grad = torch.randn(4, 3)
    opt.step()
    assert torch.equal(p.detach(), p0)
    assert int(opt.state[p]["step"]) == 0 and "QL" in opt.state[p]
    p.grad = torch.randn(4, 3)
    opt.step()
    assert not torch.equal(p.detach(), p0)
    assert int(opt.state[p]["step"]) == 1


# --------------------------------------------------------------------------------------------
# Rotation equivariance (float64): update(U G V^T) = U update(G) V^T
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "opt_cls,kw,shape",
    [
        # float64 roots: the default float32 roots leave ~6e-7 of round-off in this check.
        (Shampoo, {"root_dtype": torch.float64}, (5, 5)),
        (Shampoo, {"root_dtype": torch.float64}, (6, 3)),
        (Shampoo, {"momentum": 0.9, "weight_decay": 0.1, "beta2": 0.95, "root_dtype": torch.float64}, (3, 7)),
        (
            Shampoo,
            {"precondition_frequency": 2, "root_dtype": torch.float64, "grafting": "sgd", "betas": (0.5, 0.99)},
            (4, 6),
        ),
        (SOAP, {"precondition_frequency": 2}, (5, 5)),
        (SOAP, {"precondition_frequency": 2}, (6, 5)),
        (SOAP, {"precondition_frequency": 3, "betas": (0.9, 0.99)}, (4, 5)),
    ],
)
def test_rotation_equivariance(
    opt_cls: type[torch.optim.Optimizer], kw: dict[str, Any], shape: tuple[int, int]
) -> None:
    gen = torch.Generator().manual_seed(11)
    m, n = shape
    u, v = _random_orthogonal(m, gen), _random_orthogonal(n, gen)
    p0 = torch.randn(shape, generator=gen, dtype=torch.float64)
    grads = [torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(9)]
    plain = _run(opt_cls, p0, grads, **kw)
    rotated = _run(opt_cls, u @ p0 @ v.T, [u @ g @ v.T for g in grads], **kw)
    assert not torch.equal(plain, p0)
    assert rel_err_native(rotated - u @ p0 @ v.T, u @ (plain - p0) @ v.T, floor=1e-300) <= 1e-7


def test_adam_is_not_rotation_equivariant_sanity() -> None:
    """The equivariance test above can fail: a coordinate-wise optimizer does fail it."""
    gen = torch.Generator().manual_seed(12)
    u, v = _random_orthogonal(5, gen), _random_orthogonal(5, gen)
    p0 = torch.randn(5, 5, generator=gen, dtype=torch.float64)
    grads = [torch.randn(5, 5, generator=gen, dtype=torch.float64) for _ in range(4)]
    plain = _run(torch.optim.Adam, p0, grads, lr=1e-2)
    rotated = _run(torch.optim.Adam, u @ p0 @ v.T, [u @ g @ v.T for g in grads], lr=1e-2)
    assert rel_err_native(rotated - u @ p0 @ v.T, u @ (plain - p0) @ v.T, floor=1e-300) > 1e-2


# --------------------------------------------------------------------------------------------
# Non-2D tensors
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("opt_cls", ALL)
@pytest.mark.parametrize("shape", [(4,), (2, 3, 4, 5), ()])  # 3D is a stack of matrices
def test_non_2d_param_rejected_at_construction(opt_cls: type, shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError) as info:
        opt_cls([torch.nn.Parameter(torch.randn(shape))])
    msg = str(info.value)
    assert str(tuple(shape)) in msg
    assert opt_cls.__name__ in msg and "2D" in msg and "tail" in msg


@pytest.mark.parametrize("opt_cls", ALL)
def test_non_2d_named_param_error_names_param(opt_cls: type) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4))
    with pytest.raises(ValueError, match=r"0\.bias.*\(4,\)"):
        opt_cls(model.named_parameters())


@pytest.mark.parametrize("opt_cls", ALL)
def test_non_2d_grad_rejected_at_step(opt_cls: type) -> None:
    p = torch.nn.Parameter(torch.randn(3, 4))
    opt = opt_cls([p])
    p.data = torch.randn(3, 2, 2, 1)  # e.g. a conv kernel swapped in behind the optimizer's back
    p.grad = torch.randn(3, 2, 2, 1)
    with pytest.raises(ValueError, match=r"\(3, 2, 2, 1\)"):
        opt.step()


def test_require_2d_helper() -> None:
    require_2d(torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"'conv.weight'.*\(8, 3, 3, 3\)"):
        require_2d(torch.zeros(8, 3, 3, 3), "Muon", "conv.weight")


# --------------------------------------------------------------------------------------------
# torch.optim conventions
# --------------------------------------------------------------------------------------------
OPT_KW: list[tuple[type, dict[str, Any]]] = [
    (Muon, {"lr": 0.02, "ns_dtype": torch.float32}),
    (Shampoo, {"lr": 0.01, "precondition_frequency": 3, "momentum": 0.5, "grafting": "adagrad"}),
    (SOAP, {"lr": 0.01, "precondition_frequency": 2}),
]


@pytest.mark.parametrize("opt_cls,kw", OPT_KW)
def test_state_dict_round_trip_continues_trajectory(opt_cls: type, kw: dict[str, Any]) -> None:
    shapes = [(5, 3), (4, 4)]
    gen = torch.Generator().manual_seed(13)
    params = [torch.randn(s, generator=gen, dtype=torch.float64, requires_grad=True) for s in shapes]
    grads = [[torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes] for _ in range(9)]
    opt = opt_cls(params, **kw)
    for step_grads in grads[:4]:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
        opt.step()
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    clones = [p.detach().clone().requires_grad_() for p in params]
    opt2 = opt_cls(clones, lr=123.0)  # hyperparameters come back from the state dict
    buffer.seek(0)
    opt2.load_state_dict(torch.load(buffer, weights_only=True))
    assert opt2.param_groups[0]["lr"] == kw["lr"]
    for step_grads in grads[4:]:
        for p, q, g in zip(params, clones, step_grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        opt2.step()
    for p, q in zip(params, clones, strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("opt_cls", [Shampoo, SOAP])
def test_load_state_dict_keeps_float32_state_of_bf16_params(opt_cls: type) -> None:
    p = torch.randn(4, 3, dtype=torch.bfloat16, requires_grad=True)
    opt = opt_cls([p])
    for _ in range(2):
        p.grad = torch.randn(4, 3, dtype=torch.bfloat16)
        opt.step()
    q = p.detach().clone().requires_grad_()
    opt2 = opt_cls([q])
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    for key, value in opt.state[p].items():
        loaded = opt2.state[q][key]
        if not isinstance(value, torch.Tensor):  # Shampoo's step count is a Python int
            assert loaded == value, key
            continue
        assert loaded.dtype == value.dtype, key
        assert torch.equal(loaded, value), key
    assert opt2.state[q]["L"].dtype == torch.float32


@pytest.mark.parametrize("opt_cls,kw", OPT_KW)
def test_lr_scheduler_changes_lr_used(opt_cls: type, kw: dict[str, Any]) -> None:
    shape = (5, 4)
    p0 = torch.randn(shape, generator=torch.Generator().manual_seed(14), dtype=torch.float64)
    grads = _grads(shape, 6, seed=15, dtype=torch.float64)

    def run(schedule: str) -> torch.Tensor:
        p = p0.clone().requires_grad_()
        opt = opt_cls([p], **kw)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        for k, g in enumerate(grads):
            if schedule == "manual":
                opt.param_groups[0]["lr"] = kw["lr"] * 0.5**k
            p.grad = g.clone()
            opt.step()
            if schedule == "steplr":
                sched.step()
        return p.detach()

    scheduled, manual, constant = run("steplr"), run("manual"), run("none")
    assert torch.equal(scheduled, manual)
    assert rel_err_native(scheduled - p0, constant - p0, floor=1e-300) > 1e-2


@pytest.mark.parametrize("opt_cls", ALL)
def test_closure_loss_and_params_without_grad_skipped(opt_cls: type) -> None:
    a = torch.randn(4, 3, requires_grad=True)
    b = torch.randn(3, 3, requires_grad=True)
    b0 = b.detach().clone()
    opt = opt_cls([{"params": [a]}, {"params": [b], "lr": 0.5}])
    x = torch.randn(3)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = (a @ x).square().sum()
        loss.backward()
        return loss

    for _ in range(2):
        loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and loss.ndim == 0
    assert a.grad is not None and b.grad is None
    assert torch.equal(b.detach(), b0) and len(opt.state[b]) == 0
    assert len(opt.state[a]) > 0
    assert opt.param_groups[1]["lr"] == 0.5


@pytest.mark.parametrize(
    "opt_cls,cost,kw",
    [(Muon, MUON_COST, {}), (Shampoo, SHAMPOO_COST, {}), (SOAP, SOAP_COST, {})],
)
def test_cost_model_matches_state_bytes(opt_cls: type, cost: Any, kw: dict[str, Any]) -> None:
    assert opt_cls.cost_model is cost
    p = torch.randn(6, 4, requires_grad=True)
    opt = opt_cls([p], **kw)
    p.grad = torch.randn(6, 4)
    opt.step()
    state_bytes = sum(
        t.numel() * t.element_size() for k, t in opt.state[p].items() if isinstance(t, torch.Tensor) and k != "step"
    )
    assert state_bytes == cost.state_bytes(p.shape, p.dtype)
    assert cost.flops(p.shape) > 0


@pytest.mark.parametrize("opt_cls", [Shampoo, SOAP])
def test_bf16_params_train_and_stay_finite(opt_cls: type) -> None:
    torch.manual_seed(16)
    target = torch.randn(6, 5)
    w = torch.zeros(6, 5, dtype=torch.bfloat16, requires_grad=True)
    opt = opt_cls([w], lr=0.5 if opt_cls is Shampoo else 0.05)
    x = torch.randn(64, 5)
    first = None
    for _ in range(30):
        opt.zero_grad()
        loss = (x @ w.float().T - x @ target.T).square().mean()
        first = float(loss.detach()) if first is None else first
        loss.backward()
        opt.step()
    assert torch.isfinite(w).all()
    assert float(loss.detach()) < 0.5 * first

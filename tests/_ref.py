"""Shared test helpers: tiny GPT, data, sharding a model (:func:`fully_shard_model`, the one
blocks-then-root loop), reference optimizers, and the error measures every test compares with
(one definition each; tolerances are in tests/_tolerances.py).

The reference is the same optimizer on the unsharded model over the global batch (the
concatenation of every rank's micro-batch), so DDP-averaged gradients equal its gradients.
Every rank runs the reference itself, which needs no communication.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from matrix_owner_optim.lazy_plan import fix_lazy_plans
from matrix_owner_optim.planning import Role, get_matrix_shard, get_shard_rank
from matrix_owner_optim.tensors import local_tensor
from matrix_owner_optim.toolbox.models.gpt import GPT, GPTConfig

T = TypeVar("T")
M = TypeVar("M", bound=torch.nn.Module)

CFG = GPTConfig(vocab_size=64, seq_len=16, n_layers=2, d_model=32, n_heads=2)
CFG4 = GPTConfig(vocab_size=64, seq_len=16, n_layers=2, d_model=32, n_heads=4)  # CFG with 4 heads of 8
MICRO = 2  # sequences per rank per step
MUON_OPTS = {"lr": 0.02, "weight_decay": 0.01, "ns_dtype": torch.float32}
# eps 1e-5, not 1e-8: the attention key bias has a gradient that is zero up to round-off
# (softmax ignores a per-row constant), and Adam with a tiny eps turns that noise into full
# +-lr steps, which no summation order reproduces. Every other tensor agrees to ~3e-6 either way.
ADAMW_OPTS = {"lr": 1e-2, "weight_decay": 0.01, "eps": 1e-5}
# Shampoo's default eps (1e-12) inverts the near-null directions of rank-deficient G G^T
# factors; 1e-4 keeps its inverse roots well conditioned so round-off does not grow.
SHAMPOO_OPTS = {"lr": 1e-2, "eps": 1e-4}
# Shampoo with a small eps, at W=3/4 (test_sharding_trajectory, test_ddp_world_sizes) and in
# test_state_dict: against the whole-batch reference it drifts 3.2e-4 (eps 1e-6) / 1.2e-5 (eps
# 1e-4) in 20 steps at W=3, round-off that its inverse roots amplify, so those runs compare with
# the lockstep (rank-order) reference: bitwise.
SHAMPOO_SMALL_EPS = {"lr": 1e-2, "eps": 1e-6}
SOAP_OPTS = {"lr": 1e-2, "precondition_frequency": 2}


def fully_shard_model(
    model: M,
    *,
    blocks: Iterable[Any] | None = None,
    stock: bool = False,
    root: bool = True,
    block_options: Mapping[str, Any] | None = None,
    root_options: Mapping[str, Any] | None = None,
    **options: Any,
) -> M:
    """``model`` sharded as FSDP2 is applied: ``fully_shard`` on each block, then on the root.

    The one home of the blocks-then-root loop every test shards with.

    * ``blocks``: what is sharded before the root, in order: modules, or lists of modules
      sharded as one unit (``fully_shard([norm, head])``). Default ``model.layers`` (the
      toolbox GPT's blocks, and torchtitan's ModuleDict, whose values are taken); ``()`` for none.
    * ``stock``: torch's own ``fully_shard`` (stock FSDP2) instead of this package's; a
      ProcessGroup given as ``mesh`` becomes its ``DeviceMesh`` (the package takes either).
    * ``options``: keyword arguments of every call (``mesh``, ``mp_policy``,
      ``reshard_after_forward``, ...); ``block_options`` / ``root_options`` are added to the
      block calls / the root call only (e.g. ``plan=`` or ``ignored_params=`` on the root).
    * ``root``: False shards the blocks only (a tree whose root is never sharded).
    """
    if stock:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        if isinstance(options.get("mesh"), dist.ProcessGroup):
            options["mesh"] = DeviceMesh.from_group(options["mesh"], "cpu")
    else:
        from matrix_owner_optim import fully_shard
    if blocks is None:
        layers = model.layers  # type: ignore[attr-defined]
        blocks = layers.values() if isinstance(layers, torch.nn.ModuleDict) else layers
    for block in blocks:
        fully_shard(block, **options, **(block_options or {}))
    if root:
        fully_shard(model, **options, **(root_options or {}))
    return model


def make_models(seed: int = 0, cfg: GPTConfig = CFG) -> tuple[GPT, GPT]:
    """The model to shard and an identical unsharded reference."""
    torch.manual_seed(seed)
    model = GPT(cfg)
    return model, copy.deepcopy(model)


def global_batch(
    step: int, world_size: int, micro: int = MICRO, cfg: GPTConfig = CFG
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    idx = torch.randint(0, cfg.vocab_size, (world_size * micro, cfg.seq_len), generator=g)
    tgt = torch.randint(0, cfg.vocab_size, (world_size * micro, cfg.seq_len), generator=g)
    return idx, tgt


def rank_batch(
    step: int, rank: int = 0, world_size: int = 1, batch: int = 6, cfg: GPTConfig = CFG
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s rows of a ``batch``-sequence global batch (the draw of :func:`global_batch`,
    which depends only on ``cfg``'s vocab_size and seq_len); ``batch`` divisible by ``world_size``."""
    idx, tgt = global_batch(step, 1, batch, cfg)
    n = batch // world_size
    return idx[rank * n : (rank + 1) * n], tgt[rank * n : (rank + 1) * n]


def run_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, steps, rank: int = 0, world_size: int = 1) -> None:
    """Forward, backward, step and zero_grad on :func:`rank_batch` for each step in ``steps``
    (a model called as ``model(idx, tgt)`` returns its loss)."""
    for s in steps:
        idx, tgt = rank_batch(s, rank, world_size)
        model(idx, tgt).backward()
        opt.step()
        opt.zero_grad()


def local_batch(step: int, rank: int, world_size: int, micro: int = MICRO) -> tuple[torch.Tensor, torch.Tensor]:
    idx, tgt = global_batch(step, world_size, micro)
    return idx[rank * micro : (rank + 1) * micro], tgt[rank * micro : (rank + 1) * micro]


def train_adamw_beside(model: torch.nn.Module, ref: torch.nn.Module, steps: int, rank: int, world_size: int) -> None:
    """``steps`` AdamW steps (:data:`ADAMW_OPTS`) of a sharded ``model`` on this rank's
    :func:`local_batch` and of the one-process ``ref`` on the :func:`global_batch` they make up."""
    opt, ref_opt = (
        torch.optim.AdamW(model.parameters(), **ADAMW_OPTS),
        torch.optim.AdamW(ref.parameters(), **ADAMW_OPTS),
    )
    for step in range(steps):
        model(*local_batch(step, rank, world_size)).backward()
        ref(*global_batch(step, world_size)).backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()


def optimizer_in_backward(model: torch.nn.Module) -> list[torch.optim.Optimizer]:
    """One AdamW per parameter, stepped by the parameter's post-accumulate-grad hook, which then
    drops the gradient (optimizer in backward); keep the returned optimizers alive."""
    opts = []
    for p in model.parameters():
        opt = torch.optim.AdamW([p], **ADAMW_OPTS)

        def step(q: torch.Tensor, opt: torch.optim.Optimizer = opt) -> None:
            opt.step()
            q.grad = None

        p.register_post_accumulate_grad_hook(step)
        opts.append(opt)
    return opts


def roles_by_fqn(sharded_model: torch.nn.Module) -> dict[str, Role]:
    """The planned role of every parameter (fixes a pending plan first: reading does not)."""
    fix_lazy_plans(sharded_model.parameters())
    return {n: get_matrix_shard(p).role for n, p in sharded_model.named_parameters()}


def _matrix_class(kind: str):
    from matrix_owner_optim.preconditioners import SOAP, Muon, Shampoo

    return {"muon": (Muon, MUON_OPTS), "shampoo": (Shampoo, SHAMPOO_OPTS), "soap": (SOAP, SOAP_OPTS)}[kind]


def reference_optimizers(ref: torch.nn.Module, roles: dict[str, Role], kind: str) -> list[torch.optim.Optimizer]:
    """Per-tensor optimizers on the unsharded model: matrix optimizer on matrices, AdamW else."""
    params = dict(ref.named_parameters())
    if kind == "adamw":
        return [torch.optim.AdamW(list(params.values()), **ADAMW_OPTS)]
    cls, opts = _matrix_class(kind)
    mats = [p for n, p in params.items() if roles[n] is Role.MATRIX]
    rest = [p for n, p in params.items() if roles[n] is not Role.MATRIX]
    return [cls(mats, **opts), torch.optim.AdamW(rest, **ADAMW_OPTS)]


def owner_optimizers(model: torch.nn.Module, kind: str = "muon") -> list[torch.optim.Optimizer]:
    """Plain torch optimizers over what this rank updates (owned tensors, local row blocks);
    fixes the model's pending plan first, as building ``OwnerRoutedOptimizer`` does."""
    fix_lazy_plans(model.parameters())
    mats, rest = [], []
    for p in model.parameters():
        shard, rank = get_matrix_shard(p), get_shard_rank(p)
        if shard.role is Role.ROWS:
            rest.append(p)
        elif shard.is_owned_by(rank):
            (mats if shard.role is Role.MATRIX and kind != "adamw" else rest).append(p)
    opts = []
    if mats:
        cls, o = _matrix_class(kind)
        opts.append(cls(mats, **o))
    if rest:
        opts.append(torch.optim.AdamW(rest, **ADAMW_OPTS))
    return opts


def routed_optimizer(model: torch.nn.Module, kind: str) -> torch.optim.Optimizer:
    from matrix_owner_optim.optim import OwnerRoutedOptimizer

    if kind == "adamw":
        return OwnerRoutedOptimizer(
            model.parameters(), matrix="adamw", matrix_options=ADAMW_OPTS, tail="adamw", tail_options=ADAMW_OPTS
        )
    _, opts = _matrix_class(kind)
    return OwnerRoutedOptimizer(
        model.parameters(), matrix=kind, matrix_options=opts, tail="adamw", tail_options=ADAMW_OPTS
    )


def state_bytes(optimizers: list[torch.optim.Optimizer]) -> int:
    """Optimizer state bytes, the scalar ``step`` counters excluded."""
    total = 0
    seen: set[int] = set()
    for opt in optimizers:
        for state in opt.state.values():
            for key, v in state.items():
                if key == "step" or not isinstance(v, torch.Tensor) or id(v) in seen:
                    continue
                seen.add(id(v))
                v = local_tensor(v)  # this rank's piece of an owner-layout DTensor
                total += v.numel() * v.element_size()
    return total


def mean_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t)  # test bookkeeping only: never inside a counted phase
    return float(t.item()) / dist.get_world_size()


def computed_once(compute: Callable[[], T]) -> T:
    """``compute()`` run on rank 0 only and its result broadcast to every rank.

    For one-process references inside a rank job: every rank used to train the same reference
    model, W times the CPU of one run for the same numbers. Rank 0 runs it; the others wait in
    the broadcast (gloo blocks, it does not spin)."""
    box: list[Any] = [compute() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / max(||b||, 1e-30)`` in float64, over this rank's pieces (an owner-layout
    DTensor compares as its local tensor): the measure for parity with a reference."""
    a, b = local_tensor(a).detach().double(), local_tensor(b).detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def rel_err_native(a: torch.Tensor, b: torch.Tensor, *, floor: float) -> float:
    """``||a - b|| / max(||b||, floor)`` as the tensors are: in their own dtype (no float64 cast,
    unlike :func:`rel_err`), DTensors as DTensors. The floor is cast to that dtype too (1e-300 is 0
    in float32), so each caller keeps the floor it was written with."""
    return ((a - b).norm() / b.norm().clamp_min(floor)).item()  # item(): float() warns on requires_grad


def max_param_rel_err_native(
    model: torch.nn.Module, ref: torch.nn.Module, *, floor: float, gather: bool = False
) -> float:
    """The largest :func:`rel_err_native` between the two modules' parameters, paired in order
    (0.0 for none; NaN if any pair is NaN). ``gather``: ``model``'s parameters are DTensors,
    compared whole (``full_tensor()``, a collective every rank must call)."""
    errs = [
        rel_err_native(p.full_tensor() if gather else p, q, floor=floor)
        for p, q in zip(model.parameters(), ref.parameters(), strict=True)
    ]
    return math.nan if any(math.isnan(e) for e in errs) else max(errs, default=0.0)


def param_copies(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Detached copies of the parameters, by fqn."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def full_param_copies(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (``full_tensor()``: collective on a sharded model), by fqn."""
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def full_optimizer_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """torch's full optimizer state dict (``get_optimizer_state_dict(full_state_dict=True)``),
    flattened to ``"{fqn}.{key}"``: every tensor state (momenta, moments, steps)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    full = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    return {
        f"{fqn}.{key}": value.detach().clone()
        for fqn, state in full["state"].items()
        for key, value in state.items()
        if isinstance(value, torch.Tensor)
    }


def sharded_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """torch's sharded model and optimizer state dicts, as DCP saves and loads them."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def dcp_load(model: torch.nn.Module, opt: torch.optim.Optimizer, path: str, *, via: tuple[Any, Any]) -> None:
    """Load the DCP checkpoint at ``path`` into ``model`` and ``opt`` through
    ``set_model_state_dict`` / ``set_optimizer_state_dict``. DCP loads into the state dicts of
    ``via``, another fresh (model, optimizer) of the same layout: into this optimizer's own it
    would write the state in place and leave set_optimizer_state_dict nothing to do."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    state = sharded_state(*via)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])


def bitwise_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    """The same names, and every tensor bitwise equal (``torch.equal``): for a rank to report."""
    return got.keys() == want.keys() and all(torch.equal(got[n], t) for n, t in want.items())


def assert_bitwise_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    """The same names, and every tensor bitwise equal (``torch.equal``)."""
    assert got.keys() == want.keys(), what
    for n in want:
        assert torch.equal(got[n], want[n]), f"{what}: {n} is not bitwise equal"


def assert_close(a: torch.Tensor, b: torch.Tensor, rtol: float, what: str) -> None:
    """``a`` close to ``b``; an owner-layout DTensor compares as this rank's piece."""
    a, b = local_tensor(a), local_tensor(b)
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
    err = rel_err(a, b)
    assert err <= rtol, f"{what}: relative error {err:.3g} > {rtol}"


def full_grad_rows(shard: Any, rank: int, grad: torch.Tensor) -> torch.Tensor:
    """The part of a reference (full) gradient this rank holds on the owner layout."""
    if shard.role is Role.ROWS:
        a, b = shard.row_range(rank)
        return grad[a:b]
    return grad


def no_gradient_here(p: torch.Tensor) -> bool:
    """A non-owner holds no gradient data: ``.grad`` is None or an empty piece (the owner
    layout gives every rank a ``.grad`` DTensor of each reduced parameter, as FSDP2 does)."""
    g = p.grad
    if g is None:
        return True
    return local_tensor(g).numel() == 0 or (g.dim() == 0 and not getattr(g, "is_holder", True))


def roundtrip(obj):
    """``obj`` through ``torch.save`` / ``torch.load``, as a resumed job would see it."""
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)

"""One torchtitan Llama3 checkpoint carried between meshes: (dp=2, tp=2) and the 1D layouts.

A tiny Llama3 (separate q/k/v: torch's ``get_model_state_dict`` cannot map the fused ``wqkv``'s
state-dict hook names back to parameters, tests/_titan.py) trains under ``OwnerRoutedOptimizer``
(this package's Muon + AdamW, torch's ``clip_grad_norm_`` every step) on one of four layouts of
the same 4 ranks, and moves between them through DCP of torch's ``get_model_state_dict`` /
``get_optimizer_state_dict``, loaded into a fresh model and optimizer with ``set_*_state_dict``:

* ``"tp"``: torchtitan's ``parallelize_llama`` with data_parallel_shard_degree=2 and
  tensor_parallel_degree=2 (stock FSDP2 x TP); dp coordinate ``d`` takes rows ``[2d, 2d + 2)``,
  the loss normalised by the global token count as torchtitan's (its FSDP sums);
* ``"owner_tp"``: the same TP plan (torchtitan's ``model.parallelize``) with this package's
  ``fully_shard`` over the fsdp mesh per torchtitan's units, gradient division off (the 2D
  owner layout, tests/test_tensor_parallel_owner.py); rows and loss as ``"tp"``;
* ``"owner2"``: this package's ``fully_shard`` over the tp mesh dim's groups, ranks {0, 1} and
  {2, 3}: two identical 1D owner layouts at W=2 (shard rank ``s`` takes rows ``[2s, 2s + 2)``,
  as dp coordinate ``s`` did), so the W=2 resume needs no second spawn of torchtitan;
* ``"owner4"``: this package's ``fully_shard`` over all 4 ranks (rank ``r`` takes row ``r``);
* ``"fsdp4"``: stock ``torch.distributed.fsdp.fully_shard`` over all 4 ranks.

The 1D layouts reduce the mean of the ranks' gradients, so their loss is the local mean.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from _ref import (
    assert_bitwise_equal,
    dcp_load,
    full_optimizer_state,
    full_param_copies,
    fully_shard_model,
    rel_err,
    sharded_state,
)
from matrix_owner_optim import OwnerRoutedOptimizer

STEPS, BATCH = 3, 4
SAVE_AT = 1  # the (2, 2) checkpoint holds the state after this many steps
BACK_AT = 2  # the W=4 owner layout's checkpoint, loaded back on (2, 2)


@dataclass
class Run:
    """A model on one layout, its optimizer, the batch rows this rank takes, and whether its loss
    is divided by the global token count (else by this rank's)."""

    model: nn.Module
    opt: OwnerRoutedOptimizer
    rows: slice
    global_tokens: bool


def _model() -> nn.Module:
    import _titan

    return _titan.build(_titan.llama_config(fuse_qkv=False), _titan.parallelism())


def build(layout: str, mesh: Any, options: dict[str, Any]) -> Run:
    """The model on ``layout`` (see the module docstring) with ``OwnerRoutedOptimizer``;
    ``mesh`` is the job's (dp, tp) DeviceMesh."""
    import torch.distributed as dist

    import _titan

    rank = dist.get_rank()
    if layout == "tp":
        from torchtitan.models.llama3.parallelize import parallelize_llama

        par = _titan.parallelism(data_parallel_shard_degree=2, tensor_parallel_degree=2)
        model = _titan.build(_titan.llama_config(fuse_qkv=False), par)
        dims = _titan.parallelize(model, parallelize_llama, par, dist.get_world_size())
        d = dims.get_mesh("fsdp").get_local_rank()
        rows, global_tokens = slice(2 * d, 2 * d + 2), True
    elif layout == "owner_tp":
        model, dp_mesh = _titan.owner_tp_llama(dist.get_world_size(), fuse_qkv=False)
        d = dp_mesh.get_local_rank()
        rows, global_tokens = slice(2 * d, 2 * d + 2), True
    elif layout in ("owner2", "owner4"):
        model = fully_shard_model(_model(), mesh=mesh["tp"] if layout == "owner2" else None)
        s = mesh["tp"].get_local_rank()
        rows, global_tokens = (slice(2 * s, 2 * s + 2) if layout == "owner2" else slice(rank, rank + 1)), False
    elif layout == "fsdp4":
        from torch.distributed.device_mesh import init_device_mesh

        model = fully_shard_model(_model(), stock=True, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
        rows, global_tokens = slice(rank, rank + 1), False
    else:
        raise ValueError(f"unknown layout {layout!r}")
    opt = OwnerRoutedOptimizer(model, **options["optimizer"])
    return Run(model, opt, rows, global_tokens)


def train(run: Run, steps: range, clip: float) -> None:
    """Train ``steps`` of the shared global batches on this rank's rows, clipping with torch's
    ``clip_grad_norm_``."""
    import _titan

    pairs = _titan.batches(STEPS, BATCH)
    for step in steps:
        tokens, targets = pairs[step]
        local = tokens[run.rows]
        count = tokens.numel() if run.global_tokens else local.numel()
        _titan.loss(run.model, local, targets[run.rows], count).backward()
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), clip)
        run.opt.step()
        run.opt.zero_grad()


def save(run: Run, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(sharded_state(run.model, run.opt), checkpoint_id=path)


def resume(layout: str, mesh: Any, options: dict[str, Any], path: str) -> Run:
    """A fresh model and optimizer on ``layout`` loading the DCP checkpoint at ``path``
    (``_ref.dcp_load``, through another fresh pair's state dicts)."""
    run = build(layout, mesh, options)
    via = build(layout, mesh, options)
    dcp_load(run.model, run.opt, path, via=(via.model, via.opt))
    return run


def round_trips(mesh: Any, options: dict[str, Any], ckpt: str, source: str = "tp") -> dict[str, Any]:
    """The (2, 2) run on layout ``source`` (``"tp"`` or ``"owner_tp"``) saved at step ``SAVE_AT``
    and continued; the same checkpoint resumed on ``owner2``, ``owner4``, ``fsdp4`` (and, from
    ``owner_tp``, on ``tp``) and continued; ``owner4``'s own checkpoint at step ``BACK_AT``
    resumed on ``source`` and continued. Every run's final full parameters (under ``source``'s
    name, each resume's layout, and ``"back"``), and the parameters and full optimizer state
    each resume loaded (against the saved ones)."""
    clip = options["clip"]
    out: dict[str, Any] = {"params": {}, "loaded": {}, "loaded_state": {}}
    first = build(source, mesh, options)
    train(first, range(SAVE_AT), clip)
    save(first, f"{ckpt}/{source}")
    out["saved"] = full_param_copies(first.model)
    out["saved_state"] = full_optimizer_state(first.model, first.opt)
    train(first, range(SAVE_AT, STEPS), clip)
    out["params"][source] = full_param_copies(first.model)
    for layout in ("owner2", "owner4", "fsdp4", *(("tp",) if source != "tp" else ())):
        run = resume(layout, mesh, options, f"{ckpt}/{source}")
        out["loaded"][layout] = full_param_copies(run.model)
        out["loaded_state"][layout] = full_optimizer_state(run.model, run.opt)
        train(run, range(SAVE_AT, BACK_AT), clip)
        if layout == "owner4":
            save(run, f"{ckpt}/owner4")
            out["saved_owner4"] = full_param_copies(run.model)
            out["saved_owner4_state"] = full_optimizer_state(run.model, run.opt)
        train(run, range(BACK_AT, STEPS), clip)
        out["params"][layout] = full_param_copies(run.model)
    back = resume(source, mesh, options, f"{ckpt}/owner4")
    out["loaded"]["back"] = full_param_copies(back.model)
    out["loaded_state"]["back"] = full_optimizer_state(back.model, back.opt)
    train(back, range(BACK_AT, STEPS), clip)
    out["params"]["back"] = full_param_copies(back.model)
    return out


def check_round_trips(results: list[dict[str, Any]], source: str, ref: dict[str, torch.Tensor], rtol: float) -> None:
    """Assert on every rank's :func:`round_trips` result (``source`` its first layout): each
    resume loaded the saved parameters and torch's full optimizer state bitwise (``"back"`` the
    W=4 owner layout's), and every run continued to step 3 is within ``rtol`` of ``ref``, the
    uninterrupted one-process run's parameters."""
    layouts = (source, "owner2", "owner4", "fsdp4", *(("tp",) if source != "tp" else ()), "back")
    for rank, got in enumerate(results):
        assert set(got["params"]) == set(layouts), (rank, got["params"].keys())
        for layout in layouts[1:]:
            back = layout == "back"
            params = got["saved_owner4"] if back else got["saved"]
            state = got["saved_owner4_state"] if back else got["saved_state"]
            assert_bitwise_equal(got["loaded"][layout], params, f"rank {rank} {layout}: loaded parameters")
            assert_bitwise_equal(got["loaded_state"][layout], state, f"rank {rank} {layout}: loaded optimizer state")
        for layout in layouts:
            worst = max(rel_err(got["params"][layout][n], p) for n, p in ref.items())
            print(f"rank {rank}: {source} Llama3 checkpoint, {layout}: worst parameter rel err {worst:.2e}")
            assert worst <= rtol, f"rank {rank} {layout}: rel err {worst:.2e}"

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
        from matrix_owner_optim import fully_shard
        from matrix_owner_optim.sharding import OwnerShardedModule

        par = _titan.parallelism(data_parallel_shard_degree=2, tensor_parallel_degree=2)
        model = _titan.build(_titan.llama_config(fuse_qkv=False), par)
        dims = _titan.parallel_dims(par, dist.get_world_size())
        model.parallelize(dims)
        dp_mesh = dims.get_mesh("fsdp")
        fully_shard(model.tok_embeddings, mesh=dp_mesh)
        for layer in model.layers.values():
            fully_shard(layer, mesh=dp_mesh)
        fully_shard([model.norm, model.lm_head], mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
        for m in model.modules():
            if isinstance(m, OwnerShardedModule):
                m.set_gradient_divide_factor(1.0)
        d = dp_mesh.get_local_rank()
        rows, global_tokens = slice(2 * d, 2 * d + 2), True
    elif layout in ("owner2", "owner4"):
        from matrix_owner_optim import fully_shard

        model = _model()
        group = mesh["tp"] if layout == "owner2" else None
        for layer in model.layers.values():
            fully_shard(layer, mesh=group)
        fully_shard(model, mesh=group)
        s = mesh["tp"].get_local_rank()
        rows, global_tokens = (slice(2 * s, 2 * s + 2) if layout == "owner2" else slice(rank, rank + 1)), False
    elif layout == "fsdp4":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard as stock_fully_shard

        model = _model()
        world = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model.layers.values():
            stock_fully_shard(layer, mesh=world)
        stock_fully_shard(model, mesh=world)
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


def _state(run: Run) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(run.model), "optim": get_optimizer_state_dict(run.model, run.opt)}


def save(run: Run, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(_state(run), checkpoint_id=path)


def resume(layout: str, mesh: Any, options: dict[str, Any], path: str) -> Run:
    """A fresh model and optimizer on ``layout`` loading the DCP checkpoint at ``path`` through
    ``set_model_state_dict`` / ``set_optimizer_state_dict``. DCP loads into another fresh pair's
    state dicts (into this optimizer's own it would write the state in place and leave
    set_optimizer_state_dict nothing to do)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    run = build(layout, mesh, options)
    state = _state(build(layout, mesh, options))
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(run.model, state["model"])
    set_optimizer_state_dict(run.model, run.opt, state["optim"])
    return run


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def full_optimizer_state(run: Run) -> dict[str, torch.Tensor]:
    """torch's full optimizer state dict, flattened to ``"{fqn}.{key}"`` (every tensor state:
    Muon's momenta, Adam's moments and steps)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    full = get_optimizer_state_dict(run.model, run.opt, options=StateDictOptions(full_state_dict=True))
    return {
        f"{fqn}.{key}": value.detach().clone()
        for fqn, state in full["state"].items()
        for key, value in state.items()
        if isinstance(value, torch.Tensor)
    }


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
    out["saved"] = full_params(first.model)
    out["saved_state"] = full_optimizer_state(first)
    train(first, range(SAVE_AT, STEPS), clip)
    out["params"][source] = full_params(first.model)
    for layout in ("owner2", "owner4", "fsdp4", *(("tp",) if source != "tp" else ())):
        run = resume(layout, mesh, options, f"{ckpt}/{source}")
        out["loaded"][layout] = full_params(run.model)
        out["loaded_state"][layout] = full_optimizer_state(run)
        train(run, range(SAVE_AT, BACK_AT), clip)
        if layout == "owner4":
            save(run, f"{ckpt}/owner4")
            out["saved_owner4"] = full_params(run.model)
            out["saved_owner4_state"] = full_optimizer_state(run)
        train(run, range(BACK_AT, STEPS), clip)
        out["params"][layout] = full_params(run.model)
    back = resume(source, mesh, options, f"{ckpt}/owner4")
    out["loaded"]["back"] = full_params(back.model)
    out["loaded_state"]["back"] = full_optimizer_state(back)
    train(back, range(BACK_AT, STEPS), clip)
    out["params"]["back"] = full_params(back.model)
    return out

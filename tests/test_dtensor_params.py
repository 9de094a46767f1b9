"""Owner-layout parameters are DTensors that PyTorch's own distributed tools read right.

One gloo job at W=2 and one at W=3, each rank against the unsharded model in one process:

* ``torch.nn.utils.clip_grad_norm_`` (foreach and not; norms 2, 1 and inf) returns the
  single-process global norm on every rank (relative 1e-5) and clips every gradient by the same
  factor; this package's ``clip_grad_norm_`` gives the same value as a plain tensor.
* a run that clips with torch's ``clip_grad_norm_`` every step (OwnerRoutedOptimizer, Muon +
  AdamW) matches one process at the trajectory tests' tolerance, with zero collectives in the
  step (profiler).
* ``torch.optim.AdamW`` and ``torch.optim.SGD`` given the parameters directly match the same
  optimizers on the unsharded model (the step issues no collective either).
* ``isinstance(p, DTensor)``, ``full_tensor()`` and ``redistribute(Replicate())`` give the whole
  tensor; ``get_model_state_dict(full_state_dict=True)`` is bitwise the parameters and
  ``set_model_state_dict`` / ``load_state_dict`` of full tensors and DCP save/load round-trip
  with no state-dict hook of this package; a rank's ``state_dict()`` saved with ``torch.save``
  loads with ``torch.load(weights_only=True)``.
* ``fully_shard([wpe, ln_f])`` (FSDP2's list form, one unit of two modules) trains and matches
  one process.
"""

from __future__ import annotations

import copy
import io
import math
import os
import tempfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor, Replicate

from _ranks import spawn_ranks
from _ref import (
    ADAMW_OPTS,
    CFG,
    MUON_OPTS,
    fully_shard_model,
    global_batch,
    local_batch,
    max_param_rel_err_native,
    mean_over_ranks,
    rel_err_native,
)
from _tolerances import DTENSOR_NORM_RTOL as NORM_RTOL
from _tolerances import TRAJECTORY_PARAM_RTOL as TRAJ_RTOL
from matrix_owner_optim import OwnerRoutedOptimizer, clip_grad_norm_
from matrix_owner_optim.comm import CommCounter, comm_phase
from matrix_owner_optim.sharding.module import units_of
from matrix_owner_optim.tensors import local_tensor
from matrix_owner_optim.toolbox.models.gpt import GPT
from matrix_owner_optim.toolbox.profiling import backend_ops

pytestmark = pytest.mark.multirank

STEPS = 4
MAX_NORM = 0.5  # below the gradient norms of this model: every step clips
CPU = [torch.profiler.ProfilerActivity.CPU]


def _models(seed: int = 0) -> tuple[GPT, GPT]:
    torch.manual_seed(seed)
    model = GPT(CFG)
    return model, copy.deepcopy(model)


def _backward(model: torch.nn.Module, step: int, rank: int, W: int) -> float:
    idx, tgt = local_batch(step, rank, W)
    loss = model(idx, tgt)
    loss.backward()
    return float(loss.item())


def _ref_backward(ref: torch.nn.Module, step: int, W: int) -> float:
    idx, tgt = global_batch(step, W)
    loss = ref(idx, tgt)
    loss.backward()
    return float(loss.item())


def _clip_norms(rank: int, W: int) -> dict:
    model, ref = _models()
    fully_shard_model(model)
    _backward(model, 0, rank, W)
    _ref_backward(ref, 0, W)
    out: dict = {"isinstance": all(isinstance(p, DTensor) for p in model.parameters())}
    saved = {n: local_tensor(p.grad).clone() for n, p in model.named_parameters()}
    ref_saved = {n: p.grad.clone() for n, p in ref.named_parameters()}
    errs = {}
    for norm_type in (2.0, 1.0, math.inf):
        for foreach in (False, True):
            for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
                local_tensor(p.grad).copy_(saved[n])
                q.grad.copy_(ref_saved[n])
            want = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM, norm_type, foreach=foreach)
            got = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, norm_type, foreach=foreach)
            assert isinstance(got, DTensor), type(got)
            value = got.full_tensor()
            errs[f"{norm_type}/{foreach}"] = float(abs(value - want) / want)
            # every gradient scaled by the same factor as the reference's
            for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
                full = p.grad.full_tensor()
                errs[f"{norm_type}/{foreach}/{n}"] = rel_err_native(full, q.grad, floor=1e-30)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        local_tensor(p.grad).copy_(saved[n])
        q.grad.copy_(ref_saved[n])
    ours = clip_grad_norm_(model.parameters(), MAX_NORM)
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
    assert not isinstance(ours, DTensor)
    errs["package"] = float(abs(ours - want) / want)
    out["norm_errs"] = errs
    return out


def _clipped_run(rank: int, W: int) -> dict:
    model, ref = _models()
    fully_shard_model(model)
    opt = OwnerRoutedOptimizer(model, matrix="muon", matrix_options=MUON_OPTS, tail="adamw", tail_options=ADAMW_OPTS)
    ref_opt = OwnerRoutedOptimizer(ref, matrix="muon", matrix_options=MUON_OPTS, tail="adamw", tail_options=ADAMW_OPTS)
    loss_err, step_ops = 0.0, []
    for step in range(STEPS):
        loss = _backward(model, step, rank, W)
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        with CommCounter() as cc, comm_phase("optimizer"), torch.profiler.profile(activities=CPU) as prof:
            opt.step()
        step_ops += backend_ops(prof) + ([f"{cc.calls()} counted"] if cc.calls() else [])
        opt.zero_grad()
        ref_loss = _ref_backward(ref, step, W)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        ref_opt.step()
        ref_opt.zero_grad()
        loss_err = max(loss_err, abs(mean_over_ranks(loss) - ref_loss) / abs(ref_loss))
    return {
        "loss_err": loss_err,
        "param_err": max_param_rel_err_native(model, ref, floor=1e-30, gather=True),
        "step_ops": step_ops,
    }


def _torch_optimizers(rank: int, W: int) -> dict:
    out = {}
    for name, cls, kw in (
        ("adamw", torch.optim.AdamW, ADAMW_OPTS),  # eps 1e-5: see tests/_ref.py
        ("sgd", torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    ):
        model, ref = _models()
        fully_shard_model(model)
        opt, ref_opt = cls(model.parameters(), **kw), cls(ref.parameters(), **kw)
        ops = []
        for step in range(STEPS):
            _backward(model, step, rank, W)
            with torch.profiler.profile(activities=CPU) as prof:
                opt.step()
            ops += backend_ops(prof)
            opt.zero_grad()
            _ref_backward(ref, step, W)
            ref_opt.step()
            ref_opt.zero_grad()
        out[name] = {"param_err": max_param_rel_err_native(model, ref, floor=1e-30, gather=True), "step_ops": ops}
    return out


def _state_dicts(rank: int, W: int, ckpt: str) -> dict:
    model, ref = _models()
    fully_shard_model(model)
    OwnerRoutedOptimizer(model, matrix="muon", tail="adamw")  # fixes the plan
    out: dict = {}
    p = model.layers[0].attn.qkv.weight
    out["full_tensor"] = bool(torch.equal(p.full_tensor(), ref.layers[0].attn.qkv.weight))
    out["redistribute"] = bool(
        torch.equal(p.redistribute(p.device_mesh, [Replicate()]).to_local(), ref.layers[0].attn.qkv.weight)
    )
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    out["full_sd"] = all(torch.equal(full[n], q) for n, q in ref.state_dict().items())
    # load a different model's full tensors, then DCP-save, perturb, DCP-load
    other = GPT(CFG)
    set_model_state_dict(model, other.state_dict(), options=StateDictOptions(full_state_dict=True))
    out["set_full"] = max_param_rel_err_native(model, other, floor=1e-30, gather=True) == 0.0
    model.load_state_dict(ref.state_dict())  # plain full tensors through nn.Module's own path
    out["load_full"] = max_param_rel_err_native(model, ref, floor=1e-30, gather=True) == 0.0
    dcp.save(get_model_state_dict(model), checkpoint_id=ckpt)
    with torch.no_grad():
        for q in model.parameters():
            local_tensor(q).add_(1.0)
    sd = get_model_state_dict(model)
    dcp.load(sd, checkpoint_id=ckpt)
    set_model_state_dict(model, sd)
    out["dcp"] = max_param_rel_err_native(model, ref, floor=1e-30, gather=True) == 0.0
    buf = io.BytesIO()  # a rank's own pieces through torch.save, read back as Accelerate does
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    out["weights_only"] = all(
        isinstance(v, DTensor) and torch.equal(local_tensor(v), local_tensor(q))
        for (n, v), (_, q) in zip(loaded.items(), model.state_dict().items(), strict=True)
    )
    model.load_state_dict(loaded)
    out["weights_only_load"] = max_param_rel_err_native(model, ref, floor=1e-30, gather=True) == 0.0
    return out


def _list_unit(rank: int, W: int) -> dict:
    model, ref = _models()
    fully_shard_model(model, blocks=[*model.layers, [model.wpe, model.ln_f]])
    opt = OwnerRoutedOptimizer(model, matrix="muon", matrix_options=MUON_OPTS, tail="adamw", tail_options=ADAMW_OPTS)
    units = units_of(model)  # the optimizer fixed the plan
    grouped = [u for u in units if len(u.members) == 2]
    ref_opt = OwnerRoutedOptimizer(ref, matrix="muon", matrix_options=MUON_OPTS, tail="adamw", tail_options=ADAMW_OPTS)
    for step in range(STEPS):
        _backward(model, step, rank, W)
        opt.step()
        opt.zero_grad()
        _ref_backward(ref, step, W)
        ref_opt.step()
        ref_opt.zero_grad()
    return {
        "units": len(units),
        "grouped": len(grouped),
        "param_err": max_param_rel_err_native(model, ref, floor=1e-30, gather=True),
    }


def _job(rank: int, W: int, ckpt_root: str) -> dict:
    torch.set_num_threads(1)
    return {
        "clip": _clip_norms(rank, W),
        "run": _clipped_run(rank, W),
        "torch": _torch_optimizers(rank, W),
        "sd": _state_dicts(rank, W, os.path.join(ckpt_root, f"w{W}")),
        "list": _list_unit(rank, W),
    }


@pytest.fixture(scope="module", params=[2, 3])
def results(request):
    with tempfile.TemporaryDirectory() as root:
        return request.param, spawn_ranks(_job, request.param, root, strict_shutdown=True)


@pytest.mark.xdist_group("dtensor_params")
def test_torch_clip_grad_norm_is_global(results):
    W, res = results
    for r in res:
        assert r["clip"]["isinstance"]
        worst = max(r["clip"]["norm_errs"].values())
        assert worst <= NORM_RTOL, {k: v for k, v in r["clip"]["norm_errs"].items() if v > NORM_RTOL}


@pytest.mark.xdist_group("dtensor_params")
def test_clipped_training_matches_one_process(results):
    W, res = results
    for r in res:
        assert r["run"]["step_ops"] == [], r["run"]["step_ops"]
        assert r["run"]["loss_err"] <= TRAJ_RTOL and r["run"]["param_err"] <= TRAJ_RTOL, r["run"]


@pytest.mark.xdist_group("dtensor_params")
def test_torch_optimizers_on_the_parameters(results):
    W, res = results
    for r in res:
        for name, o in r["torch"].items():
            assert o["step_ops"] == [], (name, o["step_ops"])
            assert o["param_err"] <= TRAJ_RTOL, (name, o["param_err"])


@pytest.mark.xdist_group("dtensor_params")
def test_dtensor_tools_and_state_dicts(results):
    W, res = results
    for r in res:
        assert all(r["sd"].values()), r["sd"]


@pytest.mark.xdist_group("dtensor_params")
def test_list_of_modules_is_one_unit(results):
    W, res = results
    for r in res:
        assert r["list"]["grouped"] == 1 and r["list"]["units"] == CFG.n_layers + 2, r["list"]
        assert r["list"]["param_err"] <= TRAJ_RTOL, r["list"]


def test_owner_placements_never_share_a_cache_key_with_other_pieces() -> None:
    """DTensor's sharding-propagation caches key on placements: two owner placements with other
    pieces, or an owner placement and FSDP2's even ``Shard(0)``, must hash and compare apart;
    against a plain ``Shard(0)`` equality stays by dim (DTensorSpec's shard-order check)."""
    from torch.distributed.tensor import Shard

    from matrix_owner_optim.owner_dtensor.placement import OwnerShard

    on0, on1 = OwnerShard(0, ((0, 4), (4, 4))), OwnerShard(0, ((4, 4), (0, 4)))
    assert on0 != on1 and hash(on0) != hash(on1)
    assert on0 == OwnerShard(0, ((0, 4), (4, 4))) and hash(on0) == hash(OwnerShard(0, ((0, 4), (4, 4))))
    assert hash(on0) != hash(Shard(0)) and len({on0, on1, Shard(0)}) == 3
    assert not (on0 != Shard(0))  # DTensorSpec._verify_shard_order: placements[d] != Shard(dim)

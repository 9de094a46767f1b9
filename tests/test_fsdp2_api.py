"""FSDP2's API surface on the owner layout: what FSDP2 scripts call, each against one process.

One gloo job at W=2 (every scenario on both ranks, each against the same model trained in one
process on the global batch with the same optimizer):

* a model whose blocks return a **dataclass** (FSDP2's ``test_structured_input_output``): the
  blocks re-gather before their backward (the output's fields get the hook) and training equals
  one process (it crashed in backward before: the freed weights were read);
* ``reset_iter_state()`` after an exception **mid-backward** (a block's backward raises on the
  second step): the next steps match one process that never saw the failed step; on a block it
  is refused (FSDP2: root only);
* **integer** ``reshard_after_forward``: at W=2, 1 (keep the gathered copy: no all-gather in
  backward) and 2 (the shard size: free, gather again), both equal to one process; 3 refused;
* ``ignored_params``: left a plain tensor (not sharded, not reduced), trained by its own SGD
  on gradients the script averages, as with FSDP2; everything equals one process;
* ``load_state_dict(assign=True)`` (torchtune's meta-init path) before and after the plan, and
  ``set_model_state_dict(full_state_dict=True)`` into a meta-built model: adopted, trained equal
  to one process;
* the optimizer's ``state_dict()`` keeps AdamW's ``step`` a plain tensor (as torch does), the
  same value on every rank, and the full optimizer state dict loads back;
* the refusals: ``CPUOffloadPolicy``, ``shard_placement_fn``, ``set_post_optim_event``, ... name
  the call and the alternative.

Without processes: ``fsdp_api``'s tables list every ``fully_shard`` argument and ``FSDPModule``
method of the installed torch (the documentation's parity page is generated from them at build
time; tests/test_docs.py checks the page has every row).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _ranks import spawn_ranks
from _ref import ADAMW_OPTS, CFG, MUON_OPTS, fully_shard_model, global_batch, local_batch
from _tolerances import TRAJECTORY_LOSS_RTOL as LOSS_RTOL
from _tolerances import TRAJECTORY_PARAM_RTOL as PARAM_RTOL
from matrix_owner_optim import CommCounter, OwnerRoutedOptimizer, fully_shard
from matrix_owner_optim.sharding.fsdp_api import FSDP_MODULE_METHODS, FULLY_SHARD_ARGUMENTS
from matrix_owner_optim.sharding.module import context_of
from matrix_owner_optim.tensors import local_tensor
from matrix_owner_optim.toolbox.models.gpt import GPT

# one xdist worker runs the module, so the module fixture's gloo job spawns once per run
pytestmark = pytest.mark.xdist_group("fsdp2_api")

STEPS = 3
W = 2
OPTIM: dict[str, Any] = dict(matrix="muon", matrix_options=MUON_OPTS, tail="adamw", tail_options=ADAMW_OPTS)


# -- models ----------------------------------------------------------------------------------------
@dataclasses.dataclass
class BlockOut:
    hidden: torch.Tensor
    aux: torch.Tensor


class DataclassBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> BlockOut:
        h = x + self.fc2(F.gelu(self.fc1(self.norm(x))))
        return BlockOut(hidden=h, aux=h.pow(2).mean())


class DataclassNet(nn.Module):
    """Blocks return ``BlockOut`` (a plain dataclass, unknown to pytree)."""

    def __init__(self, vocab: int = 64, d: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(DataclassBlock(d) for _ in range(layers))
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        x, aux = self.emb(idx), 0.0
        for b in self.blocks:
            out = b(x)
            x, aux = out.hidden, aux + out.aux
        return F.cross_entropy(self.head(x).flatten(0, 1), tgt.flatten()) + 0.01 * aux


class _FailOnce(torch.autograd.Function):
    """Identity whose backward raises while ``armed`` (an exception mid-backward)."""

    armed = False

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if _FailOnce.armed:
            _FailOnce.armed = False
            raise RuntimeError("injected failure in backward")
        return g


class FailingMLP(nn.Module):
    """A GPT block's MLP whose backward can be made to raise once."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.inner = mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(_FailOnce.apply(x))


UNTIED = dataclasses.replace(CFG, tie_embeddings=False)  # assign=True unties, as on a plain model


def _gpt(seed: int = 0, cfg: Any = CFG) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg)


# -- measures --------------------------------------------------------------------------------------
def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _param_err(model: nn.Module, ref: nn.Module) -> float:
    """The largest relative error of any parameter (sharded ones whole: collective)."""
    errs = []
    for (n, p), (m, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert n == m, (n, m)
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        errs.append(_rel(full, q))
    return max(errs)


def _train(model: nn.Module, opt: torch.optim.Optimizer, rank: int, world: int, steps: range) -> list[float]:
    losses = []
    for s in steps:
        idx, tgt = local_batch(s, rank, world) if world > 1 else global_batch(s, W)
        loss = model(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def _reference(model: nn.Module, steps: range = range(STEPS)) -> tuple[nn.Module, list[float]]:
    ref = copy.deepcopy(model)
    losses = _train(ref, OwnerRoutedOptimizer(ref, **copy.deepcopy(OPTIM)), 0, 1, steps)
    return ref, losses


def _loss_err(got: list[float], want: list[float]) -> float:
    assert len(got) == len(want)
    return max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))


def _mean_losses(losses: list[float]) -> list[float]:
    t = torch.tensor(losses, dtype=torch.float64)
    torch.distributed.all_reduce(t)
    return (t / torch.distributed.get_world_size()).tolist()


# -- scenarios (each on every rank) ----------------------------------------------------------------
def _dataclass_outputs(rank: int, world: int) -> dict[str, float]:
    torch.manual_seed(3)
    model = DataclassNet()
    ref, ref_losses = _reference(model)
    fully_shard_model(model, blocks=model.blocks)
    opt = OwnerRoutedOptimizer(model, **copy.deepcopy(OPTIM))
    losses = _mean_losses(_train(model, opt, rank, world, range(STEPS)))
    return {"loss": _loss_err(losses, ref_losses), "param": _param_err(model, ref)}


def _reset_after_failed_backward(rank: int, world: int) -> dict[str, Any]:
    model = _gpt(4)
    for block in model.layers:
        block.mlp = FailingMLP(block.mlp)
    ref, ref_losses = _reference(model)
    fully_shard_model(model)
    opt = OwnerRoutedOptimizer(model, **copy.deepcopy(OPTIM))
    losses = _mean_losses(_train(model, opt, rank, world, range(1)))
    idx, tgt = local_batch(1, rank, world)
    _FailOnce.armed = True
    failed = False
    try:
        model(idx, tgt).backward()  # block 1's MLP raises: block 1's reduction may be in flight
    except RuntimeError as e:
        failed = "injected failure" in str(e)
    with pytest.raises(RuntimeError, match=r"reset_iter_state\(\) was called on .*not the root"):
        model.layers[0].reset_iter_state()  # type: ignore[operator]
    opt.zero_grad()
    model.reset_iter_state()  # type: ignore[operator]
    states = {u.state.value for u in context_of(model).units}  # type: ignore[operator]
    losses += _mean_losses(_train(model, opt, rank, world, range(1, STEPS)))
    return {
        "failed": failed,
        "states": sorted(states),
        "loss": _loss_err(losses, ref_losses),
        "param": _param_err(model, ref),
    }


def _int_reshard(rank: int, world: int, value: int) -> dict[str, Any]:
    model = _gpt(5)
    ref, ref_losses = _reference(model)
    fully_shard_model(model, reshard_after_forward=value)
    opt = OwnerRoutedOptimizer(model, **copy.deepcopy(OPTIM))
    with CommCounter() as cc:
        losses = _mean_losses(_train(model, opt, rank, world, range(STEPS)))
    gathers = sum(1 for r in cc.records if r.phase == "backward" and "gather" in r.op)
    return {"loss": _loss_err(losses, ref_losses), "param": _param_err(model, ref), "backward_gathers": gathers}


def _ignored(rank: int, world: int) -> dict[str, Any]:
    model = _gpt(6)
    ref = copy.deepcopy(model)
    ref_opts = [
        OwnerRoutedOptimizer([(n, p) for n, p in ref.named_parameters() if n != "ln_f.weight"], **copy.deepcopy(OPTIM)),
        torch.optim.SGD([ref.ln_f.weight], lr=0.1),
    ]
    ignored = {model.ln_f.weight}
    fully_shard_model(model, root_options={"ignored_params": ignored})
    kept_plain = type(model.ln_f.weight) is nn.Parameter
    opts = [
        OwnerRoutedOptimizer(
            [(n, p) for n, p in model.named_parameters() if n != "ln_f.weight"], **copy.deepcopy(OPTIM)
        ),
        torch.optim.SGD([model.ln_f.weight], lr=0.1),
    ]
    for s in range(STEPS):
        idx, tgt = global_batch(s, world)
        ref(idx, tgt).backward()
        idx, tgt = local_batch(s, rank, world)
        model(idx, tgt).backward()
        g = model.ln_f.weight.grad
        assert g is not None and type(g) is torch.Tensor  # not reduced by the package
        torch.distributed.all_reduce(g)  # the script averages it, as with FSDP2's ignored_params
        g.div_(world)
        for o in (*opts, *ref_opts):
            o.step()
            o.zero_grad()
    return {"plain": kept_plain, "param": _param_err(model, ref)}


def _assign_loads(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    source = _gpt(7, UNTIED)
    ref, ref_losses = _reference(source)

    def full() -> dict[str, torch.Tensor]:  # a fresh copy per load: assign=True aliases what it loads
        return {k: v.detach().clone() for k, v in source.state_dict().items()}

    out: dict[str, Any] = {}
    # torchtune's recipe: meta init, fully_shard, set_model_state_dict(full, broadcast from rank 0)
    meta = GPT(UNTIED, device="meta")
    fully_shard_model(meta)
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(meta, full() if rank == 0 else {}, options=opts)
    opt = OwnerRoutedOptimizer(meta, **copy.deepcopy(OPTIM))
    losses = _mean_losses(_train(meta, opt, rank, world, range(STEPS)))
    out["dsd"] = (_loss_err(losses, ref_losses), _param_err(meta, ref))
    # load_state_dict(assign=True) of full tensors before the plan, then again after it
    model = fully_shard_model(_gpt(8, UNTIED))
    model.load_state_dict(full(), assign=True)
    opt = OwnerRoutedOptimizer(model, **copy.deepcopy(OPTIM))
    held = [id(p) for p in model.parameters()]
    model.load_state_dict(full(), assign=True)  # after the plan: copied into the planned parameters
    out["same_objects"] = held == [id(p) for p in model.parameters()]
    losses = _mean_losses(_train(model, opt, rank, world, range(STEPS)))
    out["assign"] = (_loss_err(losses, ref_losses), _param_err(model, ref))
    return out


def _plain_step(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    model = fully_shard_model(_gpt(9))
    opt = OwnerRoutedOptimizer(model, **copy.deepcopy(OPTIM))
    _train(model, opt, rank, world, range(2))
    sd = opt.state_dict()
    steps = [v["step"] for v in sd["state"].values() if "step" in v]
    plain = all(type(s) is torch.Tensor and s.dim() == 0 for s in steps)
    values = sorted({float(s) for s in steps})
    full = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    before = {k: {n: local_tensor(v).clone() for n, v in st.items()} for k, st in opt.state_dict()["state"].items()}
    fresh = OwnerRoutedOptimizer(model, **copy.deepcopy(OPTIM))
    set_optimizer_state_dict(model, fresh, full, options=StateDictOptions(full_state_dict=True))
    after = fresh.state_dict()["state"]
    same = all(torch.equal(local_tensor(after[k][n]), v) for k, st in before.items() for n, v in st.items())
    return {"plain": plain, "values": values, "roundtrip": same}


def _refusals(rank: int, world: int) -> dict[str, str]:
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    out = {}
    with pytest.raises(
        NotImplementedError, match=r"offload_policy=CPUOffloadPolicy.*OffloadPolicy\(\) or nothing"
    ) as e:
        fully_shard(_gpt(), offload_policy=CPUOffloadPolicy())
    out["offload"] = str(e.value)
    fully_shard(_gpt(), offload_policy=OffloadPolicy())  # FSDP2's default: accepted
    with pytest.raises(NotImplementedError, match=r"shard_placement_fn=.*roles= or plan=") as e:
        fully_shard(_gpt(), shard_placement_fn=lambda p: None)
    out["placement"] = str(e.value)
    model = fully_shard_model(_gpt())
    with pytest.raises(NotImplementedError, match=r"set_post_optim_event\(\) is not supported .*drop the call"):
        model.set_post_optim_event(None)  # type: ignore[operator]
    with pytest.raises(NotImplementedError, match=r"set_unshard_in_backward\(False\)"):
        model.set_unshard_in_backward(False)  # type: ignore[operator]
    model.set_unshard_in_backward(True)  # type: ignore[operator]
    model.set_requires_all_reduce(True)  # type: ignore[operator]
    with pytest.raises(NotImplementedError, match=r"set_requires_all_reduce\(False\).*set_requires_gradient_sync"):
        model.set_requires_all_reduce(False)  # type: ignore[operator]
    with pytest.raises(ValueError, match=r"reshard_after_forward=3\): an int .* must divide the shard size 2"):
        fully_shard(_gpt(), reshard_after_forward=3)
    with pytest.raises(ValueError, match=r"ignored_params=.*not a parameter of the module"):
        fully_shard(_gpt().layers[0], ignored_params={nn.Parameter(torch.zeros(2))})
    return out


def _job(rank: int, world: int) -> dict[str, Any]:
    return {
        "dataclass": _dataclass_outputs(rank, world),
        "reset": _reset_after_failed_backward(rank, world),
        "rsf1": _int_reshard(rank, world, 1),
        "rsf2": _int_reshard(rank, world, 2),
        "ignored": _ignored(rank, world),
        "assign": _assign_loads(rank, world),
        "step": _plain_step(rank, world),
        "refusals": _refusals(rank, world),
    }


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return spawn_ranks(_job, W, strict_shutdown=True)


@pytest.mark.multirank
def test_dataclass_outputs_get_backward_hooks(results: list[dict[str, Any]]) -> None:
    for r in results:
        print("dataclass outputs W=2:", r["dataclass"])
        assert r["dataclass"]["loss"] <= LOSS_RTOL and r["dataclass"]["param"] <= PARAM_RTOL, r["dataclass"]


@pytest.mark.multirank
def test_reset_iter_state_after_failed_backward(results: list[dict[str, Any]]) -> None:
    for r in results:
        res = r["reset"]
        print("reset_iter_state W=2:", res)
        assert res["failed"] and res["states"] == ["sharded"], res
        assert res["loss"] <= LOSS_RTOL and res["param"] <= PARAM_RTOL, res


@pytest.mark.multirank
def test_integer_reshard_after_forward(results: list[dict[str, Any]]) -> None:
    for r in results:
        for key in ("rsf1", "rsf2"):
            print(f"reshard_after_forward={key[-1]} W=2:", r[key])
            assert r[key]["loss"] <= LOSS_RTOL and r[key]["param"] <= PARAM_RTOL, (key, r[key])
        assert r["rsf1"]["backward_gathers"] == 0  # 1: the gathered copy stays for backward
        assert r["rsf2"]["backward_gathers"] == STEPS * 2  # 2 == W: both blocks gather again


@pytest.mark.multirank
def test_ignored_params_are_left_alone(results: list[dict[str, Any]]) -> None:
    for r in results:
        print("ignored_params W=2:", r["ignored"])
        assert r["ignored"]["plain"] and r["ignored"]["param"] <= PARAM_RTOL, r["ignored"]


@pytest.mark.multirank
def test_assigned_parameters_are_adopted(results: list[dict[str, Any]]) -> None:
    for r in results:
        a = r["assign"]
        print("assign loads W=2 (loss, param):", a)
        assert a["same_objects"], a
        for key in ("dsd", "assign"):
            loss, param = a[key]
            assert loss <= LOSS_RTOL and param <= PARAM_RTOL, (key, a[key])


@pytest.mark.multirank
def test_optimizer_step_stays_plain(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["step"]["plain"] and r["step"]["values"] == [2.0] and r["step"]["roundtrip"], r["step"]


@pytest.mark.multirank
def test_refusals_name_the_alternative(results: list[dict[str, Any]]) -> None:
    assert all(r["refusals"]["offload"] for r in results)


def test_tables_cover_torch_api() -> None:
    """Every ``fully_shard`` argument and public ``FSDPModule`` method of the installed torch is
    in ``fsdp_api``'s tables (and so on the docs' parity page, generated from them)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    args = set(inspect.signature(torch_fully_shard).parameters)
    methods = {n for n, v in vars(FSDPModule).items() if callable(v) and not n.startswith("__")}
    methods -= {"_apply", "_get_fsdp_state", "_orig_cls_mro_index"}  # internals, no API
    assert args <= set(FULLY_SHARD_ARGUMENTS), sorted(args - set(FULLY_SHARD_ARGUMENTS))
    assert methods <= set(FSDP_MODULE_METHODS), sorted(methods - set(FSDP_MODULE_METHODS))

"""PyTorch's own checkpointing on the owner layout: ``state_dict()``, DCP, ``get/set_*_state_dict``.

One gloo job at W=2 and one at W=3 (module fixture) write and read every checkpoint:

* model, W=2 owner -> W=3 stock FSDP2, W=2 stock FSDP2 -> W=3 owner, W=2 owner -> W=3 owner:
  ``dcp.save(get_model_state_dict(m))`` then ``dcp.load`` + ``set_model_state_dict``; the
  loaded parameters are bitwise the saved ones.
* ``full_state_dict=True, cpu_offload=True``: rank 0 gets the full tensors (bitwise the
  unsharded parameters), the other ranks nothing (torch's ``ranks_only=(0,)``).
* model and optimizer (Shampoo eps 1e-6 on matrices, AdamW elsewhere; and AdamW everywhere)
  saved at W=2 on the owner layout, resumed at W=3 (owner layout; AdamW also on stock FSDP2)
  and in one process, then trained on: within 1e-6 of the uninterrupted one-process run that
  sums the ranks' gradients in the same order (see ``LOCKSTEP_RTOL``), AdamW also within 1e-4
  of the whole-batch run. Resuming at the same W=2 is bitwise the uninterrupted W=2 run.
* DDP (``replicated="owner"``) at W=2 and W=3: ``state_dict()`` refuses before
  ``consolidate_state_dict()``; rank 0 saves ``torch.save(opt.state_dict())`` after it, every
  rank loads it, and training goes on bitwise as the uninterrupted run.

One process: a bf16 model's Shampoo/SOAP state stays fp32 through a load and SOAP runs past
its eigenbasis refresh; a Prodigy-like optimizer's own group values keep evolving and survive a
save and load; missing state is an error naming the parameter.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from itertools import pairwise

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from _ranks import spawn_ranks
from _ref import (
    ADAMW_OPTS,
    CFG4,
    SHAMPOO_SMALL_EPS,
    assert_bitwise_equal,
    fully_shard_model,
    param_copies,
    rank_batch,
    rel_err,
    roundtrip,
    run_steps,
)
from _tolerances import DDP_W3_RESUME_RTOL, LOCKSTEP_RTOL, WHOLE_BATCH_RTOL
from matrix_owner_optim import OwnerRoutedOptimizer
from matrix_owner_optim.toolbox.models.gpt import GPT

CFG = CFG4
K = 3  # steps before the checkpoint, and after it (batches: _ref.rank_batch, 6 sequences, divisible by 2 and 3)
ADAMW = ADAMW_OPTS
KINDS = {
    "shampoo": dict(matrix="shampoo", matrix_options=SHAMPOO_SMALL_EPS, tail="adamw", tail_options=ADAMW),
    "adamw": dict(matrix="adamw", matrix_options=ADAMW, tail="adamw", tail_options=ADAMW),
}

# one xdist worker runs the whole module, so the module fixture's gloo jobs run once
pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning"),
    pytest.mark.xdist_group("state_dict"),
]


# -- helpers (module level: the spawned ranks import them) -------------------------------------
def _model(seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(CFG)


def _owner(seed: int) -> GPT:
    model = fully_shard_model(_model(seed))
    model.fix_plan()  # fix the lazy plan (the optimizer or a forward would too)
    return model


def _fsdp2(seed: int, W: int) -> GPT:
    from torch.distributed.device_mesh import init_device_mesh

    return fully_shard_model(_model(seed), stock=True, mesh=init_device_mesh("cpu", (W,)))


def _full(model) -> dict[str, torch.Tensor]:
    """Every parameter whole, by fqn, on every rank (collective on the sharded layouts)."""
    from matrix_owner_optim.sharding import OwnerShardedModule

    if isinstance(model, OwnerShardedModule):
        model.unshard()
        out = {n: p.detach().clone() for n, p in model.named_parameters()}
        model.reshard()
        return out
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()
    }


def _save(path: str, model, opt=None) -> None:
    state = {"model": get_model_state_dict(model)}
    if opt is not None:
        state["optim"] = get_optimizer_state_dict(model, opt)
    dcp.save(state, checkpoint_id=path)


def _load(path: str, model, opt=None) -> None:
    state = {"model": get_model_state_dict(model)}
    if opt is not None:
        state["optim"] = get_optimizer_state_dict(model, opt)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    if opt is not None:
        set_optimizer_state_dict(model, opt, state["optim"])


def _ddp_job(rank: int, W: int, d: str) -> dict:
    """DDP + OwnerRoutedOptimizer(replicated='owner'): the usual rank-0 torch.save resume."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_model(0))
    opt = OwnerRoutedOptimizer(model.module, **KINDS["shampoo"])
    run_steps(model, opt, range(K), rank, W)
    with pytest.raises(RuntimeError, match="consolidate_state_dict"):
        opt.state_dict()
    opt.consolidate_state_dict(to=0)
    path = os.path.join(d, f"ddp{W}.pt")
    if rank == 0:
        torch.save({"model": model.module.state_dict(), "optim": opt.state_dict()}, path)
    dist.barrier()
    saved = torch.load(path, weights_only=False)
    resumed = DDP(_model(1))
    resumed.module.load_state_dict(saved["model"])
    opt2 = OwnerRoutedOptimizer(resumed.module, **KINDS["shampoo"])
    opt2.load_state_dict(saved["optim"])
    run_steps(model, opt, range(K, 2 * K), rank, W)
    run_steps(resumed, opt2, range(K, 2 * K), rank, W)
    return {
        "n_states": sum(1 for st in saved["optim"]["state"].values() if st),
        "equal": all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed.parameters(), strict=True)),
        "err": max(rel_err(a, b) for a, b in zip(resumed.parameters(), model.parameters(), strict=True)),
    }


def _rank_job(rank: int, W: int, d: str) -> dict:
    out: dict = {}
    if W == 2:
        model = _owner(0)
        _save(os.path.join(d, "model_own2"), model)
        out["own2_params"] = _full(model)
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        out["full_keys"] = sorted(full)
        out["full_equal"] = rank != 0 or all(torch.equal(full[n], t) for n, t in out["own2_params"].items())
        out["full_on_cpu"] = all(t.device.type == "cpu" for t in full.values())
        fsdp = _fsdp2(5, W)
        _save(os.path.join(d, "model_fsdp2"), fsdp)
        out["fsdp2_params"] = _full(fsdp)
        for kind, opts in KINDS.items():
            model = _owner(0)
            opt = OwnerRoutedOptimizer(model.parameters(), **opts)
            run_steps(model, opt, range(K), rank, W)
            _save(os.path.join(d, f"own2_{kind}"), model, opt)
            out[f"own2_{kind}_params"] = _full(model)
            run_steps(model, opt, range(K, 2 * K), rank, W)  # uninterrupted
            again = _owner(8)
            opt2 = OwnerRoutedOptimizer(again.parameters(), **opts)
            _load(os.path.join(d, f"own2_{kind}"), again, opt2)
            run_steps(again, opt2, range(K, 2 * K), rank, W)
            out[f"{kind}_same_w_resume_exact"] = all(
                torch.equal(a, b) for a, b in zip(_full(model).values(), _full(again).values(), strict=True)
            )
    else:
        # the model alone, bitwise: owner W=2 -> FSDP2 W=3, FSDP2 W=2 -> owner W=3, owner -> owner
        fsdp = _fsdp2(1, W)
        _load(os.path.join(d, "model_own2"), fsdp)
        out["own2_to_fsdp2"] = _full(fsdp)
        model = _owner(2)
        _load(os.path.join(d, "model_fsdp2"), model)
        out["fsdp2_to_own3"] = _full(model)
        model = _owner(3)
        _load(os.path.join(d, "model_own2"), model)
        out["own2_to_own3"] = _full(model)
        # model and optimizer, resumed and trained on
        for kind, opts in KINDS.items():
            model = _owner(4)
            opt = OwnerRoutedOptimizer(model.parameters(), **opts)
            _load(os.path.join(d, f"own2_{kind}"), model, opt)
            out[f"{kind}_own3_loaded"] = _full(model)
            run_steps(model, opt, range(K, 2 * K), rank, W)
            out[f"{kind}_own3_cont"] = _full(model)
        fsdp = _fsdp2(6, W)
        opt = OwnerRoutedOptimizer(fsdp, **KINDS["adamw"])
        _load(os.path.join(d, "own2_adamw"), fsdp, opt)
        run_steps(fsdp, opt, range(K, 2 * K), rank, W)
        out["adamw_fsdp3_cont"] = _full(fsdp)
    out["ddp"] = _ddp_job(rank, W, d)
    dist.barrier()
    return out


def _assert_follows(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str, rtol: float) -> None:
    assert got.keys() == want.keys(), what
    worst = max(got, key=lambda n: rel_err(got[n], want[n]))
    assert rel_err(got[worst], want[worst]) <= rtol, f"{what}: {worst} off by {rel_err(got[worst], want[worst]):.3g}"


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """The ranks compute with one intra-op thread each (``threads_per_rank=1``); the thread count
    changes the reduction order inside a matmul, so the one-process runs use one thread too."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _lockstep(kind: str, world_sizes: list[int]) -> dict[str, torch.Tensor]:
    """One process, uninterrupted: step ``s`` takes the ``world_sizes[s]`` ranks' micro-batch
    gradients summed in rank order and divided by that world size (the reduce-scatter's sum)."""
    model = _model(0)
    opt = OwnerRoutedOptimizer(model, **KINDS[kind])
    for step, W in enumerate(world_sizes):
        for r in range(W):
            model(*rank_batch(step, r, W)).backward()
        if W > 1:
            for p in model.parameters():
                p.grad.div_(W)
        opt.step()
        opt.zero_grad()
    return param_copies(model)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("sd"))
    res: dict = {"dir": d}
    with _one_thread():
        for kind in KINDS:  # the uninterrupted one-process runs
            res[f"ref_{kind}"] = _lockstep(kind, [1] * 2 * K)
            res[f"lockstep3_{kind}"] = _lockstep(kind, [2] * K + [3] * K)
            res[f"lockstep1_{kind}"] = _lockstep(kind, [2] * K + [1] * K)
    res["w2"] = spawn_ranks(_rank_job, 2, d, threads_per_rank=1)
    res["w3"] = spawn_ranks(_rank_job, 3, d, threads_per_rank=1)
    return res


@pytest.mark.multirank
def test_model_bitwise_across_layouts_and_world_sizes(runs):
    own2, fsdp2 = runs["w2"][0]["own2_params"], runs["w2"][0]["fsdp2_params"]
    assert_bitwise_equal(own2, param_copies(_model(0)), "owner W=2 saved the initial model")
    for r in runs["w3"]:
        assert_bitwise_equal(r["own2_to_fsdp2"], own2, "owner W=2 -> stock FSDP2 W=3")
        assert_bitwise_equal(r["fsdp2_to_own3"], fsdp2, "stock FSDP2 W=2 -> owner W=3")
        assert_bitwise_equal(r["own2_to_own3"], own2, "owner W=2 -> owner W=3")


@pytest.mark.multirank
def test_full_state_dict_cpu_offload_on_rank0(runs):
    r0, r1 = runs["w2"]
    assert r0["full_equal"] and r0["full_on_cpu"]
    assert set(r0["full_keys"]) >= set(r0["own2_params"])  # every fqn, tied names included
    assert r1["full_keys"] == []  # ranks_only=(0,): the others get nothing


@pytest.mark.multirank
@pytest.mark.parametrize("kind", list(KINDS))
def test_resume_at_w3_and_in_one_process(runs, kind):
    whole = runs[f"ref_{kind}"]
    saved = runs["w2"][0][f"own2_{kind}_params"]
    assert all(r[f"{kind}_same_w_resume_exact"] for r in runs["w2"]), f"{kind}: W=2 resume is not bitwise"
    for r in runs["w3"]:
        assert_bitwise_equal(r[f"{kind}_own3_loaded"], saved, f"{kind}: owner W=2 -> owner W=3, loaded")
        what = f"{kind}: owner W=2 -> owner W=3, continued"
        _assert_follows(r[f"{kind}_own3_cont"], runs[f"lockstep3_{kind}"], what, LOCKSTEP_RTOL)
        if kind == "adamw":
            _assert_follows(r[f"{kind}_own3_cont"], whole, what, WHOLE_BATCH_RTOL)
    if kind == "adamw":
        for r in runs["w3"]:
            what = "adamw: owner W=2 -> FSDP2 W=3, continued"
            _assert_follows(r["adamw_fsdp3_cont"], whole, what, WHOLE_BATCH_RTOL)
    model = _model(7)
    opt = OwnerRoutedOptimizer(model, **KINDS[kind])
    _load(os.path.join(runs["dir"], f"own2_{kind}"), model, opt)
    assert_bitwise_equal(param_copies(model), saved, f"{kind}: owner W=2 -> one process, loaded")
    with _one_thread():
        run_steps(model, opt, range(K, 2 * K))
    what = f"{kind}: owner W=2 -> one process, continued"
    _assert_follows(param_copies(model), runs[f"lockstep1_{kind}"], what, LOCKSTEP_RTOL)
    if kind == "adamw":
        _assert_follows(param_copies(model), whole, what, WHOLE_BATCH_RTOL)


@pytest.mark.multirank
def test_ddp_rank0_torch_save_resume(runs):
    n_params = len(list(_model(0).parameters()))  # lm_head is tied to wte: counted once
    for key in ("w2", "w3"):
        for r in runs[key]:
            # W=2: bitwise. W=3: a fresh DDP's first all-reduce buckets differ from the rebuilt
            # ones of the uninterrupted run, so gloo sums 3 ranks in another order (round-off).
            assert r["ddp"]["equal"] or (key == "w3" and r["ddp"]["err"] <= DDP_W3_RESUME_RTOL), (
                f"DDP {key}: resumed run off by {r['ddp']['err']:.3g}"
            )
            assert r["ddp"]["n_states"] == n_params, f"DDP {key}: the rank-0 state dict is partial"


# -- one process: dtypes, inner optimizers' group values, errors ---------------------------------------
def _bf16_mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).to(torch.bfloat16)


def _mlp_steps(model, opt, steps) -> None:
    for s in steps:
        g = torch.Generator().manual_seed(s)
        x = torch.randn(5, 8, generator=g).to(torch.bfloat16)
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize(
    "matrix, options",
    [("soap", {"lr": 1e-2, "precondition_frequency": 2}), ("shampoo", {"lr": 1e-2, "eps": 1e-6})],
)
def test_bf16_model_keeps_fp32_state_through_load(matrix, options):
    model = _bf16_mlp(0)
    opt = OwnerRoutedOptimizer(model, matrix=matrix, matrix_options=options, tail="adamw")
    _mlp_steps(model, opt, range(3))
    saved = roundtrip({"model": model.state_dict(), "optim": opt.state_dict()})
    dtypes = {
        (i, k): v.dtype
        for i, st in saved["optim"]["state"].items()
        for k, v in st.items()
        if isinstance(v, torch.Tensor)
    }
    assert torch.float32 in dtypes.values()  # the preconditioner keeps fp32 factors
    model2 = _bf16_mlp(1)
    model2.load_state_dict(saved["model"])
    opt2 = OwnerRoutedOptimizer(model2, matrix=matrix, matrix_options=options, tail="adamw")
    opt2.load_state_dict(saved["optim"])
    got = {
        (i, k): v.dtype
        for i, st in opt2.state_dict()["state"].items()
        for k, v in st.items()
        if isinstance(v, torch.Tensor)
    }
    assert got == dtypes
    _mlp_steps(model, opt, range(3, 8))  # past SOAP's refresh (every 2 steps)
    _mlp_steps(model2, opt2, range(3, 8))
    assert_bitwise_equal(param_copies(model2), param_copies(model), f"bf16 {matrix} resumed")


def _square_loss_steps(model, opt, rng) -> None:
    """A step of ``opt`` on ``model(x).square().mean()`` for each seed in ``rng`` (x: 4 x 6)."""
    for s in rng:
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(s))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


class _DLike(torch.optim.Optimizer):
    """A Prodigy-like optimizer: SGD scaled by a group value ``d`` that it updates itself each
    step, and a step counter ``k`` in the group (schedule-free keeps one)."""

    def __init__(self, params, lr: float = 0.1, d: float = 1e-3, k: int = 0) -> None:
        super().__init__(params, {"lr": lr, "d": d, "k": k})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            norm = sum(float(p.grad.norm()) for p in group["params"] if p.grad is not None)
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] * group["d"])
            group["d"] = group["d"] * 1.5 + 1e-4 * norm
            group["k"] = group["k"] + 1


def test_inner_group_values_evolve_and_survive_a_load():
    def build(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Linear(6, 3))
        return model, OwnerRoutedOptimizer(model, matrix=_DLike, matrix_options={"lr": 0.1}, tail="adamw")

    model, opt = build(0)
    ds = []
    for s in range(5):
        _square_loss_steps(model, opt, [s])
        ds.append(opt.param_groups[0]["d"])
    assert opt.param_groups[0]["role"] == "matrix" and opt.param_groups[0]["k"] == 5
    assert all(b > a for a, b in pairwise(ds)) and ds[0] > 1e-3  # it evolves
    assert opt.matrix_optimizer.param_groups[0]["d"] == ds[-1]
    saved = roundtrip(opt.state_dict())
    assert saved["param_groups"][0]["d"] == ds[-1] and saved["param_groups"][0]["k"] == 5
    model2, opt2 = build(1)
    model2.load_state_dict(model.state_dict())
    opt2.load_state_dict(saved)
    _square_loss_steps(model, opt, range(5, 7))
    _square_loss_steps(model2, opt2, range(5, 7))
    assert opt2.param_groups[0]["k"] == 7 and opt2.param_groups[0]["d"] == opt.param_groups[0]["d"]
    assert_bitwise_equal(param_copies(model2), param_copies(model), "Prodigy-like resumed")
    opt.param_groups[0]["lr"] = 0.05  # the outer group still sets hyperparameters
    _square_loss_steps(model, opt, [7])
    assert opt.matrix_optimizer.param_groups[0]["lr"] == 0.05


def test_missing_state_names_the_parameter():
    model = _model(0)
    opt = OwnerRoutedOptimizer(model, **KINDS["adamw"])
    run_steps(model, opt, range(1))
    sd = opt.state_dict()
    names = [n for n, _ in model.named_parameters()]
    index = names.index("layers.1.mlp.fc.weight")
    ordered = [p for g in opt.param_groups for p in g["params"]]
    pid = next(i for i, p in enumerate(ordered) if p is model.layers[1].mlp.fc.weight)
    del sd["state"][pid]
    opt2 = OwnerRoutedOptimizer(_model(1), **KINDS["adamw"])
    with pytest.raises(KeyError, match=r"layers\.1\.mlp\.fc\.weight"):
        opt2.load_state_dict(sd)
    assert index >= 0


def _as_0_1_0(sd: dict, opt: OwnerRoutedOptimizer, model: torch.nn.Module, user_of: list[int]) -> dict:
    """``sd`` as version 0.1.0 wrote it: one group per optimizer of each user group (``user_of``:
    the user group of each live group), ``"role": "tail"`` holding the tail and ``rows`` tensors
    in the model's order, no ``"optimizer"`` key, state keyed by position in those groups."""
    order = {id(p): n for n, p in enumerate(model.parameters())}
    entries: dict[tuple[int, str], list] = {}
    options = {}
    for u, g, sg in zip(user_of, opt.param_groups, sd["param_groups"], strict=True):
        names = sg.get("param_names", [None] * len(sg["params"]))
        key = (u, sg["optimizer"])
        entries.setdefault(key, []).extend(
            (order[id(p)], k, n) for p, k, n in zip(g["params"], sg["params"], names, strict=True)
        )
        options.setdefault(key, {k: v for k, v in sg.items() if k not in ("params", "param_names", "optimizer")})
    groups, state = [], {}
    for key, rows in sorted(entries.items(), key=lambda kv: (kv[0][0], kv[0][1] != "matrix")):
        rows.sort()
        group = {**options[key], "role": key[1], "params": list(range(len(state), len(state) + len(rows)))}
        if "param_names" in sd["param_groups"][0]:
            group["param_names"] = [n for _, _, n in rows]
        for new, (_, old, _) in zip(group["params"], rows, strict=True):
            if old in sd["state"]:
                state[new] = sd["state"][old]
        groups.append(group)
    return {"state": state, "param_groups": groups}


@pytest.mark.parametrize("named", [False, True], ids=["params", "named_params"])
def test_loads_a_0_1_0_state_dict(named):
    """A save of version 0.1.0 (``rows`` tensors in the tail group) loads and training goes on
    bitwise as before the save: its groups are split by tensor role on load. Named: one user
    group, the role by glob; unnamed: two user groups, the second's tensors all ``rows``."""

    def build(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.LayerNorm(6), torch.nn.Linear(6, 8))
        if named:
            return model, OwnerRoutedOptimizer(
                model.named_parameters(), matrix_options={"lr": 0.02}, roles={"2.weight": "rows"}
            )
        first = [*model[0].parameters(), *model[1].parameters(), model[2].bias]
        groups = [{"params": first}, {"params": [model[2].weight], "role": "rows", "weight_decay": 0.1}]
        return model, OwnerRoutedOptimizer(groups, matrix_options={"lr": 0.02})

    model, opt = build(0)
    _square_loss_steps(model, opt, range(2))
    roles = [(g["role"], g["optimizer"]) for g in opt.param_groups]
    assert roles == [("matrix", "matrix"), ("tail", "tail"), ("rows", "tail")]
    old = roundtrip(_as_0_1_0(opt.state_dict(), opt, model, [0, 0, 0] if named else [0, 0, 1]))
    assert [g["role"] for g in old["param_groups"]] == (["matrix", "tail"] if named else ["matrix", "tail", "tail"])
    model2, opt2 = build(1)
    model2.load_state_dict(model.state_dict())
    opt2.load_state_dict(old)
    assert [(g["role"], g["optimizer"]) for g in opt2.param_groups] == roles
    assert [g.get("weight_decay") for g in opt2.param_groups] == [g.get("weight_decay") for g in opt.param_groups]
    _square_loss_steps(model, opt, range(2, 4))
    _square_loss_steps(model2, opt2, range(2, 4))
    assert_bitwise_equal(param_copies(model2), param_copies(model), "0.1.0 state dict resumed")

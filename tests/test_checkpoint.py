"""``matrix_owner_optim.checkpoint``: DCP save/load keyed by fqn, across world sizes and layouts.

One spawned gloo job at W=2 and one at W=3 produce and consume every checkpoint (module
fixture), so the file stays fast. Layouts: one process (plain GPT + OwnerRoutedOptimizer),
owner-shaped ``fully_shard`` (W=2, W=3) and stock FSDP2 (W=2, DTensors), all with Muon
(float32 Newton-Schulz) on matrices and AdamW on the rest.

* one process -> one process: resuming after 3 steps is bitwise the uninterrupted run.
* owner W=2 -> one process: loaded parameters and optimizer state are bitwise what the ranks
  held; the continued run follows the uninterrupted single-process run.
* one process -> owner W=3, owner W=2 -> owner W=3, owner W=2 -> stock FSDP2 W=2 (model and
  optimizer state), owner W=3 -> one process, stock FSDP2 W=2 -> one process: loaded tensors
  are bitwise the saved ones and continued runs follow the uninterrupted reference.
* errors: shape mismatch (fqn, both shapes, file), missing key (strict and strict=False),
  missing path, mismatched optimizer param groups.

"Follows" means within 1e-5 relative, the bar of the sharding trajectory tests: the W-rank
runs themselves differ from the single-process run by float32 reduction round-off
(~2e-6 after 3 steps), which no checkpoint can remove; the checkpoint itself is exact.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from matrix_owner_optim import OwnerRoutedOptimizer
from matrix_owner_optim import checkpoint as ckpt
from matrix_owner_optim.launch import spawn_ranks
from matrix_owner_optim.models.gpt import GPT, GPTConfig

CFG = GPTConfig(vocab_size=64, seq_len=16, n_layers=2, d_model=32, n_heads=4)
BATCH = 6  # global batch, divisible by 2 and 3
K = 3  # steps before the checkpoint, and after it
OPTS = dict(matrix="muon", matrix_options={"lr": 0.02, "weight_decay": 0.01, "ns_dtype": torch.float32},
            tail="adamw", tail_options={"lr": 1e-2, "weight_decay": 0.01, "eps": 1e-5})
RTOL = 1e-5

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


# -- helpers (module level: the spawned ranks import them) -------------------------------------
def _batch(step: int, rank: int = 0, world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    idx = torch.randint(0, CFG.vocab_size, (BATCH, CFG.seq_len), generator=g)
    tgt = torch.randint(0, CFG.vocab_size, (BATCH, CFG.seq_len), generator=g)
    n = BATCH // world_size
    return idx[rank * n:(rank + 1) * n], tgt[rank * n:(rank + 1) * n]


def _model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(CFG)


def _optimizer(model: torch.nn.Module, params=None) -> OwnerRoutedOptimizer:
    return OwnerRoutedOptimizer(model if params is None else params, **OPTS)


def _steps(model, opt, steps, rank: int = 0, world_size: int = 1) -> None:
    for s in steps:
        idx, tgt = _batch(s, rank, world_size)
        model(idx, tgt).backward()
        opt.step()
        opt.zero_grad()


def _owner_model(seed: int) -> GPT:
    from matrix_owner_optim.sharding import fully_shard

    model = _model(seed)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    return model


def _owner_full(model) -> dict[str, torch.Tensor]:
    model.unshard()
    out = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.reshard()
    return out


def _fsdp2_model(seed: int, W: int) -> GPT:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (W,))
    model = _model(seed)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _fsdp2_full(model) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def _local_state(model, opt) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's optimizer state by fqn (row blocks for sharded-role tensors)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: {k: v.clone() for k, v in st.items() if isinstance(v, torch.Tensor)}
            for p, st in opt.state.items() if st}


class _Toy(torch.nn.Module):
    """A 4-row embedding: at W=3 its torch.chunk rows are 2, 2, 0 (rank 2 holds none)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(4, 8)
        self.lin = torch.nn.Linear(8, 5)
        self.register_buffer("scale", torch.ones(5))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)

    def forward(self, idx: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        return (self.lin(self.emb(idx % 4)) * self.scale).square().mean()


def _toy(seed: int) -> _Toy:
    torch.manual_seed(seed)
    return _Toy()


def _rank_job(rank: int, W: int, d: str) -> dict:
    """Everything the multi-rank side does for one world size."""
    out: dict = {}
    if W == 2:
        # owner layout W=2: train K steps, save
        model = _owner_model(seed=0)
        opt = _optimizer(model, model.parameters())
        _steps(model, opt, range(K), rank, W)
        ckpt.save(os.path.join(d, "own2"), model, opt)
        out["own2_state"] = _local_state(model, opt)
        out["own2_full"] = _owner_full(model)
        del model, opt
        # stock FSDP2 W=2: load the owner checkpoint into another initialisation, continue
        model = _fsdp2_model(seed=1, W=W)
        opt = _optimizer(model)
        assert any(r["layout"] == "dtensor" for r in opt.routes())
        assert ckpt.load(os.path.join(d, "own2"), model, opt) == []
        full = _fsdp2_full(model)
        for n, t in out["own2_full"].items():
            assert torch.equal(full[n], t), f"FSDP2 load of {n} is not bitwise the saved tensor"
        _steps(model, opt, range(K, 2 * K), rank, W)
        out["fsdp2_cont"] = _fsdp2_full(model)
        ckpt.save(os.path.join(d, "fsdp2"), model, opt)
        del model, opt
        # stock FSDP2 + plain torch.optim.AdamW (DTensor state), saved for a one-process load
        model = _fsdp2_model(seed=0, W=W)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        _steps(model, opt, range(K), rank, W)
        ckpt.save(os.path.join(d, "fsdp2_adamw"), model, opt)
        out["fsdp2_adamw_full"] = _fsdp2_full(model)
        names = {id(p): n for n, p in model.named_parameters()}
        out["fsdp2_adamw_state"] = {names[id(p)]: {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
                                                   for k, v in st.items()} for p, st in opt.state.items()}
    else:
        # one process -> owner W=3
        model = _owner_model(seed=1)
        opt = _optimizer(model, model.parameters())
        ckpt.load(os.path.join(d, "one"), model, opt)
        out["from_one_loaded"] = _owner_full(model)
        _steps(model, opt, range(K, 2 * K), rank, W)
        out["from_one_cont"] = _owner_full(model)
        del model, opt
        # owner W=2 -> owner W=3 (resharding), continue, save at W=3
        model = _owner_model(seed=2)
        opt = _optimizer(model, model.parameters())
        ckpt.load(os.path.join(d, "own2"), model, opt)
        out["from_own2_loaded"] = _owner_full(model)
        _steps(model, opt, range(K, 2 * K), rank, W)
        out["from_own2_cont"] = _owner_full(model)
        ckpt.save(os.path.join(d, "own3"), model, opt)
        del model, opt
        # uneven rows with an empty rank (4 rows over 3 ranks), both directions
        from matrix_owner_optim.sharding import fully_shard

        toy = fully_shard(_toy(seed=7))
        opt = _optimizer(toy, toy.parameters())
        ckpt.load(os.path.join(d, "toy1"), toy, opt)
        out["toy_loaded"] = _owner_full(toy)
        out["toy_scale"] = toy.scale.clone()
        out["toy_rows"] = tuple(toy.emb.weight.shape)
        _steps(toy, opt, range(K, 2 * K), rank, W)
        ckpt.save(os.path.join(d, "toy3"), toy, opt)
        out["toy_cont"] = _owner_full(toy)
    dist.barrier()
    return out


# -- fixtures --------------------------------------------------------------------------------
def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _assert_follows(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == want.keys()
    worst = max(got, key=lambda n: _rel(got[n], want[n]))
    assert _rel(got[worst], want[worst]) <= RTOL, f"{what}: {worst} off by {_rel(got[worst], want[worst]):.3g}"


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == want.keys()
    for n in want:
        assert torch.equal(got[n], want[n]), f"{what}: {n} is not bitwise equal"


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("ckpt"))
    torch.manual_seed(0)
    model = _model(0)
    opt = _optimizer(model)
    _steps(model, opt, range(K))
    ckpt.save(os.path.join(d, "one"), model, opt)
    at_k = _params(model)
    _steps(model, opt, range(K, 2 * K))
    res = {"dir": d, "ref_k": at_k, "ref_2k": _params(model)}
    toy = _toy(0)
    toy.scale.fill_(0.5)  # a persistent buffer travels with the model
    toy_opt = _optimizer(toy)
    _steps(toy, toy_opt, range(K))
    ckpt.save(os.path.join(d, "toy1"), toy, toy_opt)
    res["toy_k"] = _params(toy)
    _steps(toy, toy_opt, range(K, 2 * K))
    res["toy_2k"] = _params(toy)
    res["w2"] = spawn_ranks(_rank_job, 2, d, threads_per_rank=1)
    res["w3"] = spawn_ranks(_rank_job, 3, d, threads_per_rank=1)
    return res


# -- one process --------------------------------------------------------------------------------
def test_one_process_resume_is_bitwise(tmp_path):
    model = _model(0)
    opt = _optimizer(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    for s in range(K):
        _steps(model, opt, [s])
        sched.step()
    ckpt.save(tmp_path / "c", model, opt)
    model2 = _model(5)
    opt2 = _optimizer(model2)
    assert ckpt.load(tmp_path / "c", model2, opt2) == []
    for g, g2 in zip(opt.param_groups, opt2.param_groups):
        assert {k: v for k, v in g.items() if k != "params"} == {k: v for k, v in g2.items() if k != "params"}
        assert "initial_lr" in g2
    _steps(model, opt, range(K, 2 * K))
    _steps(model2, opt2, range(K, 2 * K))
    _assert_equal(_params(model2), _params(model), "resumed run")
    # the parent's state dict is the child's (shared), so state_dict() sees the loaded state
    for p in model2.parameters():
        shared = [c.state[p] for c in (opt2.matrix_optimizer, opt2.tail_optimizer) if p in c.state]
        assert len(shared) == 1 and shared[0] is opt2.state[p]


def test_plain_torch_optimizer_one_process(tmp_path):
    model = _model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _steps(model, opt, range(K))
    ckpt.save(tmp_path / "c", model, opt)
    model2 = _model(1)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    ckpt.load(tmp_path / "c", model2, opt2)
    _steps(model, opt, range(K, 2 * K))
    _steps(model2, opt2, range(K, 2 * K))
    _assert_equal(_params(model2), _params(model), "plain AdamW resume")


def test_tied_parameters_resolve(tmp_path):
    tied = _model(0)
    opt = _optimizer(tied)
    _steps(tied, opt, range(1))
    ckpt.save(tmp_path / "tied", tied, opt)
    keys = ckpt.dcp.FileSystemReader(str(tmp_path / "tied")).read_metadata().state_dict_metadata
    assert "model.wte.weight" in keys and "model.lm_head.weight" not in keys  # saved once
    torch.manual_seed(1)
    untied = GPT(GPTConfig(**{**CFG.__dict__, "tie_embeddings": False}))
    opt2 = _optimizer(untied)
    assert ckpt.load(tmp_path / "tied", untied, opt2) == []  # lm_head.weight via the alias
    assert torch.equal(untied.lm_head.weight, tied.wte.weight)
    assert torch.equal(opt2.state[untied.lm_head.weight]["exp_avg"], opt.state[tied.wte.weight]["exp_avg"])
    ckpt.save(tmp_path / "untied", untied)
    back = _model(2)
    assert ckpt.load(tmp_path / "untied", back) == []
    assert torch.equal(back.lm_head.weight, tied.wte.weight)


def test_errors(tmp_path):
    model = _model(0)
    opt = _optimizer(model)
    _steps(model, opt, range(1))
    path = str(tmp_path / "c")
    ckpt.save(path, model, opt)

    bigger = GPT(GPTConfig(vocab_size=72, seq_len=16, n_layers=2, d_model=32, n_heads=4))
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.load(path, bigger)
    msg = str(err.value)
    assert "'wte.weight'" in msg and "(64, 32)" in msg and "(72, 32)" in msg and path in msg

    extra = _model(1)
    extra.register_parameter("extra", torch.nn.Parameter(torch.ones(3)))
    before = extra.wte.weight.detach().clone()
    with pytest.raises(ckpt.CheckpointError, match=r"model\.extra.*strict=False"):
        ckpt.load(path, extra)
    assert torch.equal(extra.wte.weight, before)  # nothing was read before the error
    assert ckpt.load(path, extra, strict=False) == ["model.extra"]
    assert torch.equal(extra.wte.weight, model.wte.weight)
    assert torch.equal(extra.extra, torch.ones(3))

    with pytest.raises(FileNotFoundError, match="nope"):
        ckpt.load(str(tmp_path / "nope"), model)

    other = _model(0)
    with pytest.raises(ckpt.CheckpointError, match="param group 0 holds different parameters"):
        ckpt.load(path, other, OwnerRoutedOptimizer(other, roles={"wte.weight": "matrix"}, **OPTS))

    ckpt.save(str(tmp_path / "model_only"), model)
    with pytest.raises(ckpt.CheckpointError, match="no optimizer state"):
        ckpt.load(str(tmp_path / "model_only"), other, _optimizer(other))


# -- across layouts and world sizes --------------------------------------------------------------
def test_owner_w2_to_one_process(runs):
    full = runs["w2"][0]["own2_full"]
    _assert_follows(full, runs["ref_k"], "owner W=2 after K steps")  # sanity of the W=2 run
    model = _model(3)
    opt = _optimizer(model)
    assert ckpt.load(os.path.join(runs["dir"], "own2"), model, opt) == []
    _assert_equal(_params(model), full, "owner W=2 -> one process")
    # optimizer state: bitwise what the ranks held (owners whole, sharded rows concatenated)
    names = {id(p): n for n, p in model.named_parameters()}
    loaded = {names[id(p)]: st for p, st in opt.state.items() if st}
    assert loaded.keys() == set(full) - {"lm_head.weight"}
    for fqn, st in loaded.items():
        parts = [r["own2_state"][fqn] for r in runs["w2"] if fqn in r["own2_state"]]
        for key, value in st.items():
            if key == "step" or len(parts) == 1:
                want = parts[0][key]
            else:
                want = torch.cat([p[key] for p in parts])
            assert torch.equal(value, want), f"optimizer state {fqn}.{key}"
    assert loaded["layers.0.attn.qkv.weight"].keys() == {"momentum_buffer"}
    assert loaded["wte.weight"].keys() == {"step", "exp_avg", "exp_avg_sq"}
    _steps(model, opt, range(K, 2 * K))
    _assert_follows(_params(model), runs["ref_2k"], "owner W=2 -> one process, continued")


def test_one_process_to_owner_w3(runs):
    for r in runs["w3"]:
        _assert_equal(r["from_one_loaded"], runs["ref_k"], "one process -> owner W=3")
        _assert_follows(r["from_one_cont"], runs["ref_2k"], "one process -> owner W=3, continued")


def test_owner_w2_to_owner_w3(runs):
    for r in runs["w3"]:
        _assert_equal(r["from_own2_loaded"], runs["w2"][0]["own2_full"], "owner W=2 -> owner W=3")
        _assert_follows(r["from_own2_cont"], runs["ref_2k"], "owner W=2 -> owner W=3, continued")


def test_owner_w2_to_stock_fsdp2_w2(runs):
    # bitwise load checked on the ranks; here the continued trajectory (model + optimizer state)
    _assert_follows(runs["w2"][0]["fsdp2_cont"], runs["ref_2k"], "owner W=2 -> FSDP2 W=2, continued")


@pytest.mark.parametrize("name, key", [("own3", "from_own2_cont"), ("fsdp2", "fsdp2_cont")])
def test_back_to_one_process(runs, name, key):
    source = runs["w3" if name == "own3" else "w2"][0][key]
    model = _model(4)
    opt = _optimizer(model)
    assert ckpt.load(os.path.join(runs["dir"], name), model, opt) == []
    _assert_equal(_params(model), source, f"{name} -> one process")
    assert all(st for p, st in opt.state.items() if p is not model.lm_head.weight)


def test_uneven_rows_with_an_empty_rank(runs):
    assert [r["toy_rows"] for r in runs["w3"]] == [(2, 8), (2, 8), (0, 8)]
    for r in runs["w3"]:
        _assert_equal(r["toy_loaded"], runs["toy_k"], "one process -> owner W=3 (empty rank)")
        assert torch.equal(r["toy_scale"], torch.full((5,), 0.5))
        _assert_follows(r["toy_cont"], runs["toy_2k"], "one process -> owner W=3 (empty rank), continued")
    model = _toy(9)
    opt = _optimizer(model)
    ckpt.load(os.path.join(runs["dir"], "toy3"), model, opt)
    _assert_equal(_params(model), runs["w3"][0]["toy_cont"], "owner W=3 (empty rank) -> one process")
    assert torch.equal(model.scale, torch.full((5,), 0.5))
    saved = ckpt.dcp.FileSystemReader(os.path.join(runs["dir"], "toy3")).read_metadata().state_dict_metadata
    assert "model.scratch" not in saved  # non-persistent buffers are not saved
    assert opt.state[model.emb.weight]["exp_avg"].shape == (4, 8)


def test_stock_fsdp2_plain_adamw_to_one_process(runs):
    r0 = runs["w2"][0]
    model = _model(6)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt.load(os.path.join(runs["dir"], "fsdp2_adamw"), model, opt)
    _assert_equal(_params(model), r0["fsdp2_adamw_full"], "FSDP2 + AdamW -> one process")
    names = {id(p): n for n, p in model.named_parameters()}
    got = {names[id(p)]: st for p, st in opt.state.items()}
    assert got.keys() == r0["fsdp2_adamw_state"].keys()
    for n, st in got.items():
        for k, v in st.items():
            assert torch.equal(v, r0["fsdp2_adamw_state"][n][k]), f"{n}.{k}"


def test_checkpoint_entries_the_model_lacks_are_an_error_unless_not_strict(tmp_path) -> None:
    import torch.nn as nn

    big = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    ckpt.save(tmp_path / "big", big)
    small = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ckpt.CheckpointError, match=r"'model\.1\.weight'.*no parameter or buffer"):
        ckpt.load(tmp_path / "big", small)
    assert ckpt.load(tmp_path / "big", small, strict=False) == ["model.1.bias", "model.1.weight"]
    assert torch.equal(small[0].weight, big[0].weight)

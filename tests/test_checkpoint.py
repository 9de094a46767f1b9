"""``matrix_owner_optim.checkpoint``: the thin convenience over DCP and ``get/set_*_state_dict``.

Across world sizes and layouts (owner layout, stock FSDP2, DDP, one process) the tools it wraps
are tested in ``test_state_dict.py``; here, in one process: a resume is bitwise, tied and untied
models load each other's checkpoints, and bad checkpoints fail with errors naming the file, the
parameter and both shapes (or skip explicitly with ``strict=False``).

"""

from __future__ import annotations

import copy

import pytest
import torch

from _ranks import spawn_ranks
from _ref import (
    ADAMW_OPTS,
    CFG4,
    MUON_OPTS,
    assert_bitwise_equal,
    fully_shard_model,
    param_copies,
    rank_batch,
    run_steps,
)
from matrix_owner_optim import OwnerRoutedOptimizer
from matrix_owner_optim import checkpoint as ckpt
from matrix_owner_optim.toolbox.models.gpt import GPT, GPTConfig

CFG = CFG4
K = 3  # steps before the checkpoint, and after it (batches: _ref.rank_batch, 6 sequences)
OPTS = dict(matrix="muon", matrix_options=MUON_OPTS, tail="adamw", tail_options=ADAMW_OPTS)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


# -- helpers (module level: the spawned ranks import them) -------------------------------------
def _model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(CFG)


def _optimizer(model: torch.nn.Module, params=None) -> OwnerRoutedOptimizer:
    return OwnerRoutedOptimizer(model if params is None else params, **OPTS)


# -- one process --------------------------------------------------------------------------------
def test_one_process_resume_is_bitwise(tmp_path):
    model = _model(0)
    opt = _optimizer(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    for s in range(K):
        run_steps(model, opt, [s])
        sched.step()
    ckpt.save(tmp_path / "c", model, opt)
    model2 = _model(5)
    opt2 = _optimizer(model2)
    torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 1.0)  # built before the load, as a resume does
    assert ckpt.load(tmp_path / "c", model2, opt2) == []
    for g, g2 in zip(opt.param_groups, opt2.param_groups, strict=True):
        assert {k: v for k, v in g.items() if k != "params"} == {k: v for k, v in g2.items() if k != "params"}
        assert "initial_lr" in g2
    run_steps(model, opt, range(K, 2 * K))
    run_steps(model2, opt2, range(K, 2 * K))
    assert_bitwise_equal(param_copies(model2), param_copies(model), "resumed run")
    # the parent's state dict is the child's (shared), so state_dict() sees the loaded state
    for p in model2.parameters():
        shared = [c.state[p] for c in (opt2.matrix_optimizer, opt2.tail_optimizer) if p in c.state]
        assert len(shared) == 1 and shared[0] is opt2.state[p]


def test_plain_torch_optimizer_one_process(tmp_path):
    model = _model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run_steps(model, opt, range(K))
    ckpt.save(tmp_path / "c", model, opt)
    model2 = _model(1)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    ckpt.load(tmp_path / "c", model2, opt2)
    run_steps(model, opt, range(K, 2 * K))
    run_steps(model2, opt2, range(K, 2 * K))
    assert_bitwise_equal(param_copies(model2), param_copies(model), "plain AdamW resume")


def test_tied_parameters_resolve(tmp_path):
    tied = _model(0)
    opt = _optimizer(tied)
    run_steps(tied, opt, range(1))
    ckpt.save(tmp_path / "tied", tied, opt)
    keys = ckpt.dcp.FileSystemReader(str(tmp_path / "tied")).read_metadata().state_dict_metadata
    assert "model.wte.weight" in keys and "optim.state.wte.weight.exp_avg" in keys  # keyed by fqn
    torch.manual_seed(1)
    untied = GPT(GPTConfig(**{**CFG.__dict__, "tie_embeddings": False}))
    assert ckpt.load(tmp_path / "tied", untied) == []  # state_dict() names both fqns
    assert torch.equal(untied.lm_head.weight, tied.wte.weight)
    with pytest.raises(ckpt.CheckpointError, match=r"lm_head\.weight\.exp_avg"):  # state saved once
        ckpt.load(tmp_path / "tied", untied, _optimizer(untied))
    ckpt.save(tmp_path / "untied", untied)
    back = _model(2)
    assert ckpt.load(tmp_path / "untied", back) == []
    assert torch.equal(back.lm_head.weight, tied.wte.weight)


def test_errors(tmp_path):
    model = _model(0)
    opt = _optimizer(model)
    run_steps(model, opt, range(1))
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
    with pytest.raises(ckpt.CheckpointError, match=r"no optimizer state.*wte\.weight\.momentum_buffer"):
        ckpt.load(path, other, OwnerRoutedOptimizer(other, roles={"wte.weight": "matrix"}, **OPTS))

    ckpt.save(str(tmp_path / "model_only"), model)
    with pytest.raises(ckpt.CheckpointError, match="no optimizer state"):
        ckpt.load(str(tmp_path / "model_only"), other, _optimizer(other))


def test_checkpoint_entries_the_model_lacks_are_an_error_unless_not_strict(tmp_path) -> None:
    import torch.nn as nn

    big = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    ckpt.save(tmp_path / "big", big)
    small = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(
        ckpt.CheckpointError,
        match=r"no parameter or buffer for: \['model\.1\.bias', 'model\.1\.weight'\]",
    ):
        ckpt.load(tmp_path / "big", small)
    assert ckpt.load(tmp_path / "big", small, strict=False) == ["model.1.bias", "model.1.weight"]
    assert torch.equal(small[0].weight, big[0].weight)


# -- HSDP: a (2, 2) save loads at W=4 and W=2 (1D) -------------------------------------------------
# The checkpoint holds every matrix's optimizer state once (its global owner's); a 1D layout
# loads it and continues. Loaded parameters and state are bitwise the saved ones; the continued
# run follows the uninterrupted (2, 2) run at the parity tolerance (only the order in which the
# gradients of the same 4 micro-batches are summed differs). A resume on the same (2, 2) mesh is
# bitwise, and a W=4 1D checkpoint loads into a (2, 2) mesh bitwise.
HSDP_BATCH = 8  # sequences per step: 2 per rank at W=4, 4 at W=2


def _sharded_gpt(mesh, seed: int, group=None):
    model = fully_shard_model(_model(seed), mesh=mesh)
    return model, OwnerRoutedOptimizer(model, process_group=group, **OPTS)


def _steps(model, opt, steps, rank: int, world: int) -> None:
    for s in steps:
        idx, tgt = rank_batch(s, rank, world, batch=HSDP_BATCH, cfg=CFG)
        model(idx, tgt).backward()
        opt.step()
        opt.zero_grad()


def _full_params(model) -> dict[str, torch.Tensor]:
    model.unshard()
    try:
        return param_copies(model)
    finally:
        model.reshard()


def _held_state(model, opt, group=None) -> dict:
    """Every optimizer-state tensor as the pieces ranks hold: (fqn, key) -> {first row: piece},
    gathered over ``group``; a piece held by several ranks (HSDP's redundant tail) must agree."""
    from matrix_owner_optim.planning import get_matrix_shard, get_shard_rank
    from matrix_owner_optim.tensors import local_tensor

    mine = {}
    for name, p in model.named_parameters():
        shard, rank = get_matrix_shard(p), get_shard_rank(p)
        start = shard.row_range(rank)[0] if shard.holds_rows else 0
        for key, v in opt.state.get(p, {}).items():
            v = local_tensor(v)
            if torch.is_tensor(v) and v.dim() and v.numel():
                mine[(name, key, start)] = v.detach().clone()
    merged: dict = {}
    for part in _all_gather(mine, group):
        for (name, key, start), v in part.items():
            held = merged.setdefault((name, key), {})
            if start in held:
                assert torch.equal(held[start], v), (name, key, "replicas disagree")
            held[start] = v
    return merged


def _all_gather(obj, group):
    out = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(out, obj, group=group)
    return out


def _whole_state(held: dict) -> dict[tuple[str, str], torch.Tensor]:
    return {k: torch.cat([pieces[s] for s in sorted(pieces)]) for k, pieces in held.items()}


def _full_state_dicts(model, opt) -> tuple[dict, dict]:
    """torch's full state dicts (every rank gets whole tensors) of ``model`` and ``opt``."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    full = StateDictOptions(full_state_dict=True)
    return get_model_state_dict(model, options=full), get_optimizer_state_dict(model, opt, options=full)


def _hsdp_full_state_dicts(model, opt, mesh, rank: int, W: int) -> float:
    """``get_model_state_dict`` / ``get_optimizer_state_dict`` with ``full_state_dict=True`` on
    the (2, 2) mesh after K steps: the same keys as one process's (OwnerRoutedOptimizer on the
    unsharded model, the global batches), every tensor within the parity tolerance (state held
    by one global owner arrives whole on every rank); loading them with ``set_*_state_dict``
    into a fresh (2, 2) model gives back bitwise the same full state dicts."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from _tolerances import PARITY_PARAM_RTOL

    ref = _model(0)
    ref_opt = OwnerRoutedOptimizer(ref, replicated="redundant", **OPTS)  # plain tensors, as one process
    for s in range(K):
        ref(*rank_batch(s, 0, 1, batch=HSDP_BATCH, cfg=CFG)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    msd, osd = _full_state_dicts(model, opt)
    ref_msd, ref_osd = _full_state_dicts(ref, ref_opt)
    assert msd.keys() == ref_msd.keys()
    worst = 0.0

    def close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
        nonlocal worst
        assert not hasattr(a, "device_mesh") and a.shape == b.shape, what  # whole plain tensors
        err = float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))
        assert err <= PARITY_PARAM_RTOL, (what, err)
        worst = max(worst, err)

    for k, v in ref_msd.items():
        close(msd[k], v, f"model {k}")
    assert osd["state"].keys() == ref_osd["state"].keys()
    for fqn, st in ref_osd["state"].items():
        assert st.keys() == osd["state"][fqn].keys(), fqn
        for key, v in st.items():
            if torch.is_tensor(v) and v.dim():
                close(osd["state"][fqn][key], v, f"optimizer {fqn} {key}")
            else:
                assert float(osd["state"][fqn][key]) == float(v), (fqn, key)
    fresh, fresh_opt = _sharded_gpt(mesh, 21)
    full = StateDictOptions(full_state_dict=True)
    # torch's loaders lay the given dicts out in place: load copies, compare with the originals
    set_model_state_dict(fresh, copy.deepcopy(msd), options=full)
    set_optimizer_state_dict(fresh, fresh_opt, copy.deepcopy(osd), options=full)
    msd2, osd2 = _full_state_dicts(fresh, fresh_opt)
    for k, v in msd.items():
        assert torch.equal(msd2[k], v), f"reloaded model {k}"
    for fqn, st in osd["state"].items():
        for key, v in st.items():
            assert torch.equal(torch.as_tensor(osd2["state"][fqn][key]), torch.as_tensor(v)), (fqn, key)
    return worst


def _hsdp_checkpoint_job(rank: int, W: int, d: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from _tolerances import PARITY_PARAM_RTOL

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model, opt = _sharded_gpt(mesh, 0)
    _steps(model, opt, range(K), rank, W)
    ckpt.save(d, model, opt)
    saved, saved_held = _full_params(model), _held_state(model, opt)
    full_sd_err = _hsdp_full_state_dicts(model, opt, mesh, rank, W)
    # a matrix's state is held by one rank (its global owner), the tail's by both replicas' holders
    matrices = {n for n, p in model.named_parameters() if p.dim() == 2 and (n, "momentum_buffer") in saved_held}
    assert matrices, "no matrix state saved"
    _steps(model, opt, range(K, 2 * K), rank, W)
    want = _full_params(model)
    out: dict = {"worst": {}, "full_state_dicts": full_sd_err}
    # (2, 2) -> (2, 2): a resume on the same mesh is bitwise the uninterrupted run
    ckpt.save(d + "-again", model, opt)
    again, again_opt = _sharded_gpt(mesh, 11)
    assert ckpt.load(d + "-again", again, again_opt) == []
    for m, o in ((model, opt), (again, again_opt)):
        _steps(m, o, [2 * K], rank, W)
    assert_bitwise_equal(_full_params(again), _full_params(model), "(2, 2) -> (2, 2) resume")
    two = torch.distributed.new_group([0, 1])
    one_d = None
    for world, group in ((4, None), (2, two)):
        if world == 2 and rank >= 2:
            continue
        model1, opt1 = _sharded_gpt(group, 9, group)
        assert ckpt.load(d, model1, opt1, process_group=group) == []
        assert_bitwise_equal(_full_params(model1), saved, f"(2, 2) -> W={world}: loaded parameters")
        got_state = _whole_state(_held_state(model1, opt1, group))
        want_state = _whole_state(saved_held)
        assert got_state.keys() == want_state.keys(), f"W={world}: state keys"
        for k, v in want_state.items():
            assert torch.equal(got_state[k], v), f"(2, 2) -> W={world}: loaded state {k}"
        _steps(model1, opt1, range(K, 2 * K), rank, world)
        got = _full_params(model1)
        worst = 0.0
        for n, v in want.items():
            err = float((got[n].double() - v.double()).norm() / v.double().norm().clamp_min(1e-30))
            assert err <= PARITY_PARAM_RTOL, (world, n, err)
            worst = max(worst, err)
        out["worst"][world] = worst
        if world == 4:
            one_d = (model1, opt1)
    # and back: the W=4 1D run's checkpoint loads into a (2, 2) mesh, parameters and state bitwise
    assert one_d is not None
    ckpt.save(d + "-1d", *one_d)
    back, back_opt = _sharded_gpt(mesh, 13)
    assert ckpt.load(d + "-1d", back, back_opt) == []
    assert_bitwise_equal(_full_params(back), _full_params(one_d[0]), "W=4 -> (2, 2): loaded parameters")
    want_state, got_state = _whole_state(_held_state(*one_d)), _whole_state(_held_state(back, back_opt))
    assert got_state.keys() == want_state.keys()
    for k, v in want_state.items():
        assert torch.equal(got_state[k], v), f"W=4 -> (2, 2): loaded state {k}"
    return out


@pytest.mark.multirank
def test_hsdp_save_loads_at_w4_and_w2(tmp_path):
    results = spawn_ranks(_hsdp_checkpoint_job, 4, str(tmp_path / "hsdp"), threads_per_rank=1)
    print("continued after (2, 2) -> 1D, worst relative error by world size:", [r["worst"] for r in results])
    print("(2, 2) full state dicts vs one process:", max(r["full_state_dicts"] for r in results))

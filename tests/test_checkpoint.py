"""``matrix_owner_optim.checkpoint``: the thin convenience over DCP and ``get/set_*_state_dict``.

Across world sizes and layouts (owner layout, stock FSDP2, DDP, one process) the tools it wraps
are tested in ``test_state_dict.py``; here, in one process: a resume is bitwise, tied and untied
models load each other's checkpoints, and bad checkpoints fail with errors naming the file, the
parameter and both shapes (or skip explicitly with ``strict=False``).

"""

from __future__ import annotations

import pytest
import torch

from _ref import ADAMW_OPTS, CFG4, MUON_OPTS, assert_bitwise_equal, param_copies, run_steps
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

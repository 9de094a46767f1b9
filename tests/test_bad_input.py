"""Bad input fails fast with an error that names the parameter, rank, file or argument and says
what to do; non-finite gradients are skipped on every rank together when asked.

One process: roles, optimizer names and options, non-finite hyperparameters (at construction
and from a scheduler at ``step()``), two models in one optimizer, mixed-precision policies the
owner layout cannot honour, and checkpoints that do not fit, are truncated or foreign.
One W=2 job (one spawn, ~5 s): everything that needs a process group -- a mesh whose size
differs from the plan's, units of one model on two meshes, ranks with different models,
``fully_shard`` twice, a shared parameter across units, parameters added after the plan was
fixed, plain tensors next to owner-sharded ones in one optimizer, a unit mixing dtypes, a
checkpoint whose shapes do not match (every rank raises), the opt-in non-finite gradient check
(one scalar all-reduce, a step skipped on both ranks though only one rank saw the NaN), and a
save that fails half-way (rank 1 hits a file-size limit) leaving the previous checkpoint loadable.
"""

from __future__ import annotations

import gc
import math
import os
import resource
import signal
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from _ranks import spawn_ranks
from _ref import fully_shard_model
from matrix_owner_optim import OwnerRoutedOptimizer, fully_shard, plan_model
from matrix_owner_optim import checkpoint as ckpt
from matrix_owner_optim.comm import CommCounter
from matrix_owner_optim.planning import get_matrix_shard
from matrix_owner_optim.sharding import MixedPrecisionPolicy
from matrix_owner_optim.tensors import local_tensor
from matrix_owner_optim.toolbox.models.gpt import GPT, GPTConfig

# The smallest GPT with matrices (Linear weights), tail (norms, biases) and sharded tensors
# (embeddings); two blocks so that there are block units and a root unit.
CFG = GPTConfig(vocab_size=32, seq_len=8, n_layers=2, d_model=16, n_heads=2)
OPTS = dict(
    matrix="muon",
    matrix_options={"lr": 0.02, "ns_dtype": torch.float32},
    tail="adamw",
    tail_options={"lr": 1e-2},
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def _model(seed: int = 0, cfg: GPTConfig = CFG) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg)


def _batch(step: int, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return (
        torch.randint(0, CFG.vocab_size, (2, CFG.seq_len), generator=g),
        torch.randint(0, CFG.vocab_size, (2, CFG.seq_len), generator=g),
    )


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    # owner-layout DTensors compare as this rank's pieces (no collective)
    return a.keys() == b.keys() and all(torch.equal(local_tensor(a[k]), local_tensor(b[k])) for k in a)


# -- one process: the optimizer ------------------------------------------------------------------
def test_roles_names_and_options_are_checked() -> None:
    model = _model()
    # 1. a non-2D tensor forced to the matrix role: by glob, and by a param group's "role"
    with pytest.raises(
        ValueError,
        match=r"'layers\.0\.attn\.qkv\.bias' with shape \(48,\) cannot "
        r"take role 'matrix'.*route it to 'tail'",
    ):
        OwnerRoutedOptimizer(model, roles={"layers.0.attn.qkv.bias": "matrix"}, **OPTS)
    with pytest.raises(ValueError, match=r"'layers\.0\.ln1\.weight' with shape \(16,\).*'matrix'"):
        OwnerRoutedOptimizer(
            [{"params": [("layers.0.ln1.weight", model.layers[0].ln1.weight)], "role": "matrix"}],
            **OPTS,
        )
    # 2. unknown role names, in roles= and in a param group
    with pytest.raises(ValueError, match=r"unknown role 'vector' for roles\['layers\.\*'\]; use one of"):
        OwnerRoutedOptimizer(model, roles={"layers.*": "vector"}, **OPTS)
    with pytest.raises(ValueError, match=r"unknown role 'vector' for param group 'role'"):
        OwnerRoutedOptimizer([{"params": list(model.parameters()), "role": "vector"}], **OPTS)
    # 3. a roles glob that matches nothing (a typo must not pass silently)
    with pytest.raises(ValueError, match=r"glob 'layer\.0\.\*' matches no parameter"):
        OwnerRoutedOptimizer(model, roles={"layer.0.*": "tail"}, **OPTS)
    # 4. unknown optimizer names, listing the known ones
    with pytest.raises(ValueError, match=r"unknown matrix optimizer 'lion'; available: .*muon"):
        OwnerRoutedOptimizer(model, **{**OPTS, "matrix": "lion"})
    with pytest.raises(ValueError, match=r"unknown tail optimizer 'adamm'"):
        OwnerRoutedOptimizer(model, **{**OPTS, "tail": "adamm"})
    # 5. an option the optimizer does not take, and a value it refuses
    with pytest.raises(ValueError, match=r"matrix_options \{'betas': .*Muon.*'betas'.*Pass only"):
        OwnerRoutedOptimizer(model, **{**OPTS, "matrix_options": {"betas": (0.9, 0.99)}})
    with pytest.raises(ValueError, match=r"tail_options \{'lr': -1\.0\}.*AdamW.*Invalid learning rate"):
        OwnerRoutedOptimizer(model, **{**OPTS, "tail_options": {"lr": -1.0}})
    with pytest.raises(ValueError, match=r"param group option 'frobnicate' is accepted by neither"):
        OwnerRoutedOptimizer([{"params": list(model.parameters()), "frobnicate": 1}], **OPTS)
    # 6. arguments of the router itself
    with pytest.raises(ValueError, match=r"replicated must be 'owner' or 'redundant', got 'all'"):
        OwnerRoutedOptimizer(model, replicated="all", **OPTS)
    with pytest.raises(ValueError, match=r"replica_broadcast must be one of \('step', 'forward'\).*got 'later'"):
        OwnerRoutedOptimizer(model, replica_broadcast="later", **OPTS)
    with pytest.raises(TypeError, match=r"skip_nonfinite_grads must be True or False, got 'yes'"):
        OwnerRoutedOptimizer(model, skip_nonfinite_grads="yes", **OPTS)  # type: ignore[arg-type]


def test_non_finite_learning_rates_are_refused_before_anything_changes() -> None:
    model = _model()
    # 7. NaN or infinite learning rates: in the options, in a param group
    for options in ({"matrix_options": {"lr": math.inf}}, {"tail_options": {"lr": math.inf}}):
        with pytest.raises(
            ValueError,
            match=r"has lr=inf, which is not finite.*set optimizer\."
            r"param_groups\[\d\]\['lr'\] to a finite number",
        ):
            OwnerRoutedOptimizer(model, **{**OPTS, **options})
    with pytest.raises(ValueError, match=r"matrix_options \{'lr': nan\}"):  # Muon refuses it first
        OwnerRoutedOptimizer(model, **{**OPTS, "matrix_options": {"lr": math.nan}})
    with pytest.raises(ValueError, match=r"param group 0 \(role 'matrix'\) has lr=nan"):
        OwnerRoutedOptimizer([{"params": list(model.named_parameters()), "lr": math.nan}], **OPTS)
    # ... and from a schedule at step(): the step refuses before any parameter or state changes
    opt = OwnerRoutedOptimizer(model, **OPTS)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 - s))  # s=1: division by 0
    model(*_batch(0)).backward()
    opt.step()
    opt.zero_grad()
    with pytest.raises(ZeroDivisionError):
        sched.step()  # torch's scheduler raises here; a schedule producing inf does not:
    opt.param_groups[1]["lr"] = float("inf")
    before = _params(model)
    steps = {k: v["step"].clone() for k, v in opt.state.items() if "step" in v}
    model(*_batch(1)).backward()
    with pytest.raises(
        ValueError,
        match=r"step\(\): param group 1 \(role 'tail'\) has lr=inf.*"
        r"nothing was updated",
    ):
        opt.step()
    assert _same(_params(model), before)
    assert all(torch.equal(opt.state[k]["step"], v) for k, v in steps.items())
    # an infinity the optimizer itself uses as "off" stays allowed (SGD has none; AdamW none):
    # the check only refuses infinities where the inner optimizer's default is finite
    opt.param_groups[1]["lr"] = 1e-2
    opt.step()
    assert not _same(_params(model), before)


def test_a_parameter_in_two_groups_is_refused() -> None:
    a = _model(0)
    opt = OwnerRoutedOptimizer(a, **OPTS)
    with pytest.raises(ValueError, match=r"'wte\.weight' is already in another param group"):
        opt.add_param_group({"params": [("wte.weight", a.wte.weight)]})


def test_fully_shard_arguments_are_checked_before_anything_is_recorded() -> None:
    model = _model()
    from torch.distributed.fsdp import MixedPrecision

    # 9. mixed-precision policies the owner layout cannot honour
    with pytest.raises(
        TypeError,
        match=r"takes torch\.distributed\.fsdp\.MixedPrecisionPolicy.*"
        r"got MixedPrecision.*buffer_dtype",
    ):
        fully_shard(model, mp_policy=MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16))
    with pytest.raises(TypeError, match=r"got dict"):
        fully_shard(model, mp_policy={"param_dtype": torch.bfloat16})
    with pytest.raises(
        ValueError,
        match=r"mp_policy\.param_dtype=torch\.int8 is not a "
        r"floating-point dtype",
    ):
        fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.int8))
    with pytest.raises(ValueError, match=r"mp_policy\.reduce_dtype=torch\.int32"):
        fully_shard(model, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.int32))
    # 10. a reshard_after_forward of no type FSDP2 takes, a non-module, no process group
    with pytest.raises(ValueError, match=r"reshard_after_forward='2'\): takes True, False, None or an int"):
        fully_shard(model, reshard_after_forward="2")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"expects an nn\.Module, got Tensor"):
        fully_shard(torch.zeros(2))  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match=r"needs an initialized process group"):
        fully_shard(model)
    assert type(model) is GPT  # nothing was recorded by the refused calls


# -- one process: checkpoints ---------------------------------------------------------------------
def _saved(tmp_path) -> tuple[str, GPT, OwnerRoutedOptimizer]:
    model = _model(0)
    opt = OwnerRoutedOptimizer(model, **OPTS)
    model(*_batch(0)).backward()
    opt.step()
    path = str(tmp_path / "ckpt")
    ckpt.save(path, model, opt)
    return path, model, opt


def test_checkpoints_that_do_not_fit_are_refused_by_name(tmp_path) -> None:
    path, model, _ = _saved(tmp_path)
    # 11. shapes that do not match: the file, the fqn and both shapes, before anything is read
    wider = _model(1, GPTConfig(vocab_size=40, seq_len=8, n_layers=2, d_model=16, n_heads=2))
    before = _params(wider)
    with pytest.raises(
        ckpt.CheckpointError,
        match=rf"{path}.*'wte\.weight' has shape \(32, 16\) "
        r"in the checkpoint but \(40, 16\) in the model",
    ):
        ckpt.load(path, wider)
    assert _same(_params(wider), before)
    # 12. keys that do not match: a model with a parameter the checkpoint lacks, and a deeper
    # checkpoint than the model
    extra = _model(1)
    extra.register_parameter("scale", nn.Parameter(torch.ones(1)))
    with pytest.raises(ckpt.CheckpointError, match=r"missing from it: \['model\.scale'\].*strict=False"):
        ckpt.load(path, extra)
    shallow = _model(1, GPTConfig(vocab_size=32, seq_len=8, n_layers=1, d_model=16, n_heads=2))
    with pytest.raises(ckpt.CheckpointError, match=r"no parameter or buffer for: \['model\.layers\.1"):
        ckpt.load(path, shallow)
    # 13. an optimizer whose state the checkpoint does not hold (another matrix optimizer)
    other = _model(1)
    with pytest.raises(
        ckpt.CheckpointError,
        match=r"param group 0 \(role 'matrix'\) of this optimizer "
        r"has hyperparameters \['dampening'.*another optimizer",
    ):
        ckpt.load(
            path,
            other,
            OwnerRoutedOptimizer(other, **{**OPTS, "matrix": "sgd", "matrix_options": {"lr": 0.1, "momentum": 0.9}}),
        )


def test_truncated_and_foreign_checkpoints_say_so(tmp_path) -> None:
    path, model, opt = _saved(tmp_path)
    fresh = _model(1)
    # 14. a truncated data file (a copy cut short, a full disk), named with both sizes
    cut = str(tmp_path / "cut")
    os.makedirs(cut)
    for name in os.listdir(path):
        with open(os.path.join(path, name), "rb") as f:
            data = f.read()
        with open(os.path.join(cut, name), "wb") as f:
            f.write(data[: len(data) // 2] if name.endswith(".distcp") else data)
    with pytest.raises(
        ckpt.CheckpointError,
        match=r"is truncated: data file '__0_0\.distcp' has "
        r"\d+ bytes but its metadata needs \d+",
    ):
        ckpt.load(cut, fresh)
    # a data file missing altogether, and a directory whose save never wrote .metadata
    os.remove(os.path.join(cut, "__0_0.distcp"))
    with pytest.raises(ckpt.CheckpointError, match=r"data file '__0_0\.distcp' is missing"):
        ckpt.load(cut, fresh)
    unfinished = str(tmp_path / "unfinished")
    os.makedirs(unfinished)
    with open(os.path.join(unfinished, "__0_0.distcp"), "wb") as f:
        f.write(b"\0" * 64)
    with pytest.raises(ckpt.CheckpointError, match=r"is incomplete: .*no \.metadata.*did not finish"):
        ckpt.load(unfinished, fresh)
    # a .metadata cut short
    torn = str(tmp_path / "torn")
    os.makedirs(torn)
    with open(os.path.join(path, ".metadata"), "rb") as f:
        head = f.read(40)
    with open(os.path.join(torn, ".metadata"), "wb") as f:
        f.write(head)
    with pytest.raises(ckpt.CheckpointError, match=r"\.metadata file cannot be read.*truncated"):
        ckpt.load(torn, fresh)
    # 15. foreign: a DCP checkpoint another tool wrote, a directory of other files, a file
    foreign = str(tmp_path / "foreign")
    dcp.save({"app": {"weights": torch.zeros(3)}}, checkpoint_id=foreign, no_dist=True)
    with pytest.raises(
        ckpt.CheckpointError,
        match=r"not written by matrix_owner_optim\.checkpoint"
        r"\.save: it has no 'model\.\*' entries.*app\.weights",
    ):
        ckpt.load(foreign, fresh)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    with pytest.raises(ckpt.CheckpointError, match=r"is not a DCP checkpoint: .*'config\.json'"):
        ckpt.load(str(hf), fresh)
    torch.save(model.state_dict(), tmp_path / "model.pt")
    with pytest.raises(ckpt.CheckpointError, match=r"is a file, not a DCP checkpoint.*torch\.load"):
        ckpt.load(str(tmp_path / "model.pt"), fresh)
    with pytest.raises(FileNotFoundError, match=r"'.*nowhere' is not a DCP checkpoint"):
        ckpt.load(str(tmp_path / "nowhere"), fresh)
    # save refuses to replace what is not a checkpoint (the user's data stays)
    with pytest.raises(ckpt.CheckpointError, match=r"exists and is not a checkpoint directory"):
        ckpt.save(str(hf), model, opt)
    assert (hf / "config.json").read_text() == "{}"
    # nothing of the refused loads changed the model; the good checkpoint still loads
    assert ckpt.load(path, fresh) == []
    assert _same(_params(fresh), _params(model))


def test_a_save_interrupted_between_its_renames_loads_the_previous_one(tmp_path) -> None:
    path, model, opt = _saved(tmp_path)
    saved = _params(model)
    os.rename(path, path + ckpt.PREVIOUS_SUFFIX)  # the state a crash between the renames leaves
    fresh = _model(1)
    with pytest.warns(RuntimeWarning, match=r"a save was interrupted while replacing it"):
        ckpt.load(path, fresh)
    assert _same(_params(fresh), saved)
    ckpt.save(path, model, opt)  # the next save completes the replacement
    assert os.path.isfile(os.path.join(path, ".metadata"))
    assert not os.path.exists(path + ckpt.PREVIOUS_SUFFIX)
    assert not os.path.exists(path + ckpt.SAVING_SUFFIX)


# -- W=2: everything that needs a process group (one spawn) ----------------------------------
def _process_group_cases(rank: int, W: int) -> dict[str, str]:
    seen: dict[str, str] = {}

    def refused(key: str, exc_type: type[BaseException], pattern: str, fn) -> None:
        with pytest.raises(exc_type, match=pattern) as info:
            fn()
        seen[key] = str(info.value)
        # the caught exception's traceback holds the refused model in a reference cycle; a
        # model left pending would be planned together with the next one (lazy sharding plans
        # every pending unit of the mesh), so collect it now
        del info
        gc.collect()

    # 16. a mesh whose size differs from the plan's
    refused(
        "plan_world_size",
        ValueError,
        rf"plan was made for world size {W + 1} but the mesh "
        rf"has {W} ranks; build it with plan_model\(model, {W}",
        lambda: fully_shard(_model(), plan=plan_model(_model(), W + 1)),
    )
    # 17. units of one model on two meshes (the blocks on the world, the root on a sub-mesh)
    solo = [dist.new_group([0]), dist.new_group([1])][rank]  # every rank joins each new_group
    model = fully_shard_model(_model(), root=False)
    refused(
        "two_meshes",
        ValueError,
        r"its submodule 'layers\.0' \(OwnerShardedBlock\) was passed "
        r"to fully_shard with another mesh \(2 ranks\) than this call \(1 ranks\)",
        lambda: fully_shard(model, mesh=solo),
    )
    fully_shard(model)  # the same mesh as its blocks: accepted, and planned with them
    model.fix_plan()
    assert {get_matrix_shard(p).world_size for p in model.parameters()} == {W}
    # 18. ranks with different models: refused before any data moves, naming the parameter
    cfg = CFG if rank == 0 else GPTConfig(vocab_size=32, seq_len=8, n_layers=2, d_model=16, n_heads=2, mlp_ratio=2)
    model = fully_shard_model(_model(cfg=cfg))
    full = {n: tuple(p.shape) for n, p in model.named_parameters()}
    refused(
        "different_models",
        ValueError,
        r"rank 0 and rank 1 disagree on the sharding plan"
        r": parameter 'layers\.0\.mlp\.fc\.weight' differs \(shape: \[64, 16\] vs \[32, 16\]",
        lambda: model(*_batch(0, rank)),
    )
    assert {n: tuple(p.shape) for n, p in model.named_parameters()} == full  # no data moved
    refused(
        "failed_earlier",
        RuntimeError,
        r"sharding of this GPT failed earlier",  # the user's class, not the sharded subclass
        lambda: model.sharding_plan,
    )
    # 19. fully_shard twice on a module; and on a parent of an already-sharded block
    model = fully_shard_model(_model())
    refused(
        "twice",
        ValueError,
        r"fully_shard was already called on this OwnerShardedGPT",
        lambda: fully_shard(model),
    )
    model(*_batch(0, rank))  # the plan is fixed now
    wrapper = nn.Sequential(model)
    refused(
        "after_plan",
        ValueError,
        r"submodule '0' \(OwnerShardedGPT\) is already sharded",
        lambda: fully_shard(wrapper),
    )
    # 20. a parameter shared by two units
    model = _model()
    model.layers[1].mlp.fc.weight = model.layers[0].mlp.fc.weight
    model = fully_shard_model(model)
    refused(
        "shared",
        ValueError,
        r"'layers\.0\.mlp\.fc\.weight' is registered in two fully_shard "
        r"units",
        lambda: model(*_batch(0, rank)),
    )
    # 21. parameters added after the plan was fixed: forward refuses (on every rank alike) ...
    model = fully_shard_model(_model())
    opt = OwnerRoutedOptimizer(model, **OPTS)
    model(*_batch(0, rank)).backward()
    opt.step()
    model.layers[0].mlp.adapter = nn.Linear(16, 16)
    refused(
        "added_forward",
        ValueError,
        r"parameter 'layers\.0\.mlp\.adapter\.weight' \(shape "
        r"\(16, 16\)\) was registered on OwnerShardedGPT after its sharding plan was fixed",
        lambda: model(*_batch(1, rank)),
    )
    del model.layers[0].mlp.adapter
    model.layers[1].attn.proj.weight = nn.Parameter(torch.zeros(16, 16))
    refused(
        "replaced",
        ValueError,
        r"'layers\.1\.attn\.proj\.weight' .* a new tensor was assigned "
        r"to OwnerShardedGPT after its sharding plan was fixed",
        lambda: model(*_batch(1, rank)),
    )
    # ... and so does an optimizer over them (nothing would average their gradients)
    model = fully_shard_model(_model())
    model(*_batch(0, rank))
    model.head2 = nn.Linear(16, 4)
    refused(
        "added_optimizer",
        ValueError,
        r"parameter 'head2\.weight' \(shape \(4, 16\)\) is a plain "
        r"tensor, while 'wte\.weight' and others are owner-sharded",
        lambda: OwnerRoutedOptimizer(model, **OPTS),
    )
    # 22. an optimizer over the parameters of two models: two sharded ones (their fqns collide
    # in state dicts), a sharded one and its unsharded reference (nothing averages the latter)
    del model.head2
    other = fully_shard_model(_model(1))
    other.fix_plan()  # planned on its own
    refused(
        "two_sharded_models",
        ValueError,
        r"two parameters are named 'wte\.weight' \("
        r"parameter #0.*build one optimizer per model",
        lambda: OwnerRoutedOptimizer(list(model.named_parameters()) + list(other.named_parameters()), **OPTS),
    )
    ref = _model()
    refused(
        "two_models",
        ValueError,
        r"is a plain tensor, while 'wte\.weight' and others are "
        r"owner-sharded.*or it belongs to another model",
        lambda: OwnerRoutedOptimizer(list(model.parameters()) + list(ref.parameters()), **OPTS),
    )
    # 23. only the blocks sharded, an optimizer over the whole model
    model = fully_shard_model(_model(), root=False)
    refused(
        "blocks_only",
        ValueError,
        r"parameter 'wte\.weight' .* is a plain tensor.* its module is "
        r"outside every fully_shard call",
        lambda: OwnerRoutedOptimizer(model, **OPTS),
    )
    # 24. a unit whose parameters have two dtypes and no param_dtype to unify them
    model = _model()
    model.layers[0].mlp.to(torch.bfloat16)
    model = fully_shard_model(model)
    refused(
        "mixed_dtypes",
        NotImplementedError,
        r"fully_shard unit 0 mixes parameter dtypes .*"
        r"MixedPrecisionPolicy\(param_dtype=",
        lambda: model(*_batch(0, rank)),
    )
    # refused before any data moved: every rank still holds every full tensor
    assert all(p.numel() == q.numel() for p, q in zip(model.parameters(), _model().parameters(), strict=True))
    # 25. a plan that is not a ShardingPlan
    refused(
        "plan_type",
        TypeError,
        r"plan must be a ShardingPlan, got dict",
        lambda: fully_shard(_model(), plan={}),
    )  # type: ignore[arg-type]
    return seen


def _nonfinite_check(rank: int, W: int) -> dict[str, int]:
    """Only the rank owning one matrix sees a NaN (then another an inf); both skip."""
    model = fully_shard_model(_model())
    opt = OwnerRoutedOptimizer(model, skip_nonfinite_grads=True, **OPTS)
    model(*_batch(0, rank)).backward()
    opt.step()
    opt.zero_grad()
    target = {0: model.layers[0].attn.qkv.weight, 1: model.layers[1].mlp.fc.weight}
    for poisoned_by, value in ((0, math.nan), (1, math.inf)):
        model(*_batch(1, rank)).backward()
        owner = get_matrix_shard(target[poisoned_by]).owner
        if rank == owner:
            target[poisoned_by].grad.view(-1)[3] = value  # this rank alone holds a bad value
        before = _params(model)
        state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
        with CommCounter() as cc:
            opt.step()
        assert cc.by_op("optimizer") == {"nonfinite_check": 1}, cc.by_op()  # one all-reduce (flag, step count)
        assert opt.last_step_skipped, (rank, poisoned_by)
        assert _same(_params(model), before)
        for p, s in opt.state.items():
            assert all(torch.equal(v, state[id(p)][k]) for k, v in s.items())
        opt.zero_grad()
    # a clean step goes through on both ranks; the check off costs no collective
    model(*_batch(2, rank)).backward()
    before = _params(model)
    opt.step()
    assert not opt.last_step_skipped and not _same(_params(model), before)
    opt.skip_nonfinite_grads = False
    model(*_batch(3, rank)).backward()
    with CommCounter() as cc:
        opt.step()
    assert cc.calls("optimizer") == 0
    return {"skipped": opt.skipped_steps}


def _checkpoint_cases(rank: int, W: int, root: str) -> dict[str, str]:
    path = os.path.join(root, "ckpt")
    model = fully_shard_model(_model())
    opt = OwnerRoutedOptimizer(model, **OPTS)
    model(*_batch(0, rank)).backward()
    opt.step()
    opt.zero_grad()
    ckpt.save(path, model, opt)
    good = {n: p.detach().clone() for n, p in model.named_parameters()}  # this rank's pieces
    model(*_batch(1, rank)).backward()
    opt.step()
    # 26. a save that fails half-way: rank 1's writes stop at 4 KiB (a full disk); DCP gathers
    # the failure, so every rank raises, and the previous checkpoint stays loadable
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill
    if rank == 1:
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limits[1]))
    try:
        with pytest.raises(
            RuntimeError,
            match=rf"checkpoint save to '{path}' failed \(rank 1: "
            r"OSError: \[Errno 27\] File too large.*the previous "
            r"checkpoint at that path, if any, is unchanged",
        ) as info:
            ckpt.save(path, model, opt)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, previous_handler)
    dist.barrier()
    assert not os.path.exists(path + ckpt.SAVING_SUFFIX)  # the half-written directory is gone
    fresh = fully_shard_model(_model(seed=5))
    fresh_opt = OwnerRoutedOptimizer(fresh, **OPTS)
    assert ckpt.load(path, fresh, fresh_opt) == []
    assert _same({n: p.detach() for n, p in fresh.named_parameters()}, good)
    # the next save goes through and replaces it
    ckpt.save(path, model, opt)
    assert ckpt.load(path, fresh, fresh_opt) == []
    assert _same({n: p.detach() for n, p in fresh.named_parameters()}, _params(model))
    # 27. a checkpoint whose shapes do not match: every rank raises the same error, no hang
    wide = fully_shard_model(_model(cfg=GPTConfig(vocab_size=48, seq_len=8, n_layers=2, d_model=16, n_heads=2)))
    with pytest.raises(
        ckpt.CheckpointError,
        match=r"'wte\.weight' has shape \(32, 16\) in the "
        r"checkpoint but \(48, 16\) in the model",
    ) as e:
        ckpt.load(path, wide)
    return {"interrupted_save": str(info.value)[:300], "shape_error": str(e.value)}


def _job(rank: int, W: int, root: str) -> dict:
    warnings.filterwarnings("ignore")
    out: dict = {}
    out["errors"] = _process_group_cases(rank, W)
    out.update(_nonfinite_check(rank, W))
    out.update(_checkpoint_cases(rank, W, root))
    return out


@pytest.mark.multirank
def test_bad_input_with_a_process_group(tmp_path) -> None:
    results = spawn_ranks(_job, 2, str(tmp_path), timeout_s=60)
    for res in results:
        assert res["skipped"] == 2  # the NaN step and the inf step, on both ranks
        assert set(res["errors"]) == {
            "plan_world_size",
            "two_meshes",
            "different_models",
            "failed_earlier",
            "twice",
            "after_plan",
            "shared",
            "added_forward",
            "replaced",
            "added_optimizer",
            "two_models",
            "two_sharded_models",
            "blocks_only",
            "mixed_dtypes",
            "plan_type",
        }
    # both ranks raised the same plan-disagreement and shape errors
    assert results[0]["errors"]["different_models"] == results[1]["errors"]["different_models"]
    assert results[0]["shape_error"] == results[1]["shape_error"]

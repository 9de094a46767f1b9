"""plan_mesh: the (replicate, shard) mesh advice, its projection, its CLI, and one run on it.

Everything but the last test runs in this process at simulated world sizes (plans on meta
tensors). The last one trains on the advised (2, 2) mesh on 4 gloo ranks against one process.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
import time
from pathlib import Path

import pytest
import torch

import matrix_owner_optim as moo
from _ranks import spawn_ranks
from _ref import (
    CFG,
    assert_close,
    full_grad_rows,
    global_batch,
    local_batch,
    make_models,
    no_gradient_here,
    owner_optimizers,
    reference_optimizers,
    rel_err,
    roles_by_fqn,
)
from _tolerances import PARITY_GRAD_RTOL as GRAD_RTOL
from _tolerances import PARITY_LOSS_RTOL as LOSS_RTOL
from _tolerances import PARITY_PARAM_RTOL as PARAM_RTOL
from matrix_owner_optim.comm import CommCounter, comm_phase
from matrix_owner_optim.planning import Role, get_matrix_shard, get_shard_rank, plan_model, specs_from_module
from matrix_owner_optim.planning.catalog import DEFAULT_COST
from matrix_owner_optim.planning.mesh_advice import divisors_descending
from matrix_owner_optim.planning.replicas import assign_step_replicas
from matrix_owner_optim.replica_sync import replicas_of, steps_here
from matrix_owner_optim.toolbox import simulate as S
from matrix_owner_optim.toolbox.cli.main import main as cli_main
from matrix_owner_optim.toolbox.models import GPT, GPTConfig
from matrix_owner_optim.toolbox.profiling import backend_ops

LIMIT = 1.1
RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


@pytest.fixture(scope="module")
def gpt() -> GPT:
    """The 32-layer d=1024 GPT the ``plan`` command plans by default (128 matrices)."""
    return GPT(GPTConfig(vocab_size=50304, seq_len=1024, n_layers=32, d_model=1024, n_heads=16), device="meta")


def _worst(plan) -> float:
    imb = plan.imbalance()
    return max(imb["bytes_max_over_mean"], imb["flops_max_over_mean"])


@pytest.mark.parametrize("world_size", [8, 64, 256, 1024, 4096])
def test_advice_is_balanced_and_not_conservative(gpt: GPT, world_size: int) -> None:
    prefixes = gpt.unit_prefixes()
    t0 = time.perf_counter()
    advice = moo.plan_mesh(gpt, world_size, unit_prefixes=prefixes)
    elapsed = time.perf_counter() - t0
    print(
        f"W={world_size}: mesh {advice.mesh_shape}, bytes {advice.bytes_max_over_mean:.4f}, "
        f"FLOPs {advice.flops_max_over_mean:.4f}, {len(advice.candidates)} plans in {elapsed:.3f} s"
    )
    assert elapsed < 20.0  # measured 0.15 s at W=4096 on a shared 2-core CPU
    assert advice.replicate * advice.shard == world_size
    assert advice.mesh_dim_names == ("replicate", "shard")
    # the plan at the advised shard size, recomputed independently, is balanced
    plan = plan_model(gpt, advice.shard, unit_prefixes=prefixes)
    specs = specs_from_module(gpt, unit_prefixes=prefixes)
    global_plan = assign_step_replicas(plan, specs, advice.replicate, cost=DEFAULT_COST)
    assert global_plan.digest() == advice.plan.digest()
    imb = plan.imbalance()
    assert imb["bytes_max_over_mean"] <= LIMIT and imb["flops_max_over_mean"] <= LIMIT, imb
    assert advice.bytes_max_over_mean == imb["bytes_max_over_mean"]
    if advice.replicate == 1:
        assert advice.resident_bytes_per_rank == tuple(x.resident_bytes for x in plan.loads)
    if advice.replicate > 1:  # one global owner per matrix: every matrix steps once over all W ranks
        loads = advice.plan.replica_loads
        # the memory rule prices every global rank, each matrix's state on its one global owner:
        # below the shard plan's count, which keeps every matrix's state on every replica's holder
        assert advice.resident_bytes_per_rank == tuple(x.resident_bytes for x in loads)
        assert advice.max_resident_bytes < max(x.resident_bytes for x in plan.loads)
        assert len(loads) == world_size
        assert sum(x.owned_matrices for x in loads) == sum(1 for s in plan if s.role is Role.MATRIX)
        assert max(x.optimizer_flops for x in loads) < max(x.optimizer_flops for x in plan.loads)
    # not conservative: twice the shard size, and every larger divisor, would not be balanced
    larger = [d for d in divisors_descending(world_size) if d > advice.shard]
    if 2 * advice.shard <= world_size:
        assert 2 * advice.shard in larger
        assert _worst(plan_model(gpt, 2 * advice.shard, unit_prefixes=prefixes)) > LIMIT
    for d in larger:
        assert _worst(plan_model(gpt, d, unit_prefixes=prefixes)) > LIMIT, d
    assert [c.shard for c in advice.candidates] == larger + [advice.shard]
    assert [c.accepted for c in advice.candidates] == [False] * len(larger) + [True]


def test_past_one_node_the_advice_has_replicas(gpt: GPT) -> None:
    # the 'twice would not' check above is live: from W=64 on the advice is not W itself
    for W in (64, 256, 1024, 4096):
        advice = moo.plan_mesh(gpt, W, unit_prefixes=gpt.unit_prefixes())
        assert advice.replicate > 1 and 2 * advice.shard <= W, (W, advice.mesh_shape)


def test_specs_give_the_same_advice_as_the_module(gpt: GPT) -> None:
    prefixes = gpt.unit_prefixes()
    specs = specs_from_module(gpt, unit_prefixes=prefixes)
    a = moo.plan_mesh(gpt, 256, unit_prefixes=prefixes)
    b = moo.plan_mesh(specs, 256)
    assert a == b and a.plan.digest() == b.plan.digest()
    shampoo = moo.plan_mesh(specs, 256, preconditioner="shampoo")
    assert shampoo.preconditioner == "shampoo" and shampoo.replicate * shampoo.shard == 256


def test_memory_per_rank_is_respected_and_the_error_says_what_to_change(gpt: GPT) -> None:
    prefixes = gpt.unit_prefixes()
    free = moo.plan_mesh(gpt, 64, unit_prefixes=prefixes)
    exact = moo.plan_mesh(gpt, 64, unit_prefixes=prefixes, memory_per_rank=free.max_resident_bytes)
    assert exact.mesh_shape == free.mesh_shape
    assert exact.max_resident_bytes <= exact.memory_per_rank == free.max_resident_bytes
    # a budget between what the balanced shard sizes need and what an unbalanced one needs
    tight = free.max_resident_bytes - 1
    with pytest.raises(ValueError, match="memory_per_rank") as err:
        moo.plan_mesh(gpt, 64, unit_prefixes=prefixes, memory_per_rank=tight)
    msg = str(err.value)
    assert "max_imbalance" in msg and "64 ranks" in msg
    need_bytes = int(re.search(r"at least (\d+) bytes", msg).group(1))
    need_imb = float(re.search(r"raise max_imbalance to ([0-9.]+)", msg).group(1))
    assert need_bytes == free.max_resident_bytes
    # following either suggestion works, and every advice keeps the budget it was given
    assert moo.plan_mesh(gpt, 64, unit_prefixes=prefixes, memory_per_rank=need_bytes).mesh_shape == (2, 32)
    looser = moo.plan_mesh(gpt, 64, unit_prefixes=prefixes, memory_per_rank=tight, max_imbalance=need_imb + 1e-3)
    assert looser.max_resident_bytes <= tight and looser.shard == 64
    assert max(looser.bytes_max_over_mean, looser.flops_max_over_mean) <= need_imb + 1e-3
    with pytest.raises(ValueError, match="does not fit either"):
        moo.plan_mesh(gpt, 64, unit_prefixes=prefixes, memory_per_rank=1000)


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"world_size": 0}, ValueError, "world_size must be a positive int"),
        ({"world_size": 2.0}, ValueError, "world_size must be a positive int"),
        ({"world_size": True}, ValueError, "world_size must be a positive int"),
        ({"max_imbalance": 0.9}, ValueError, "max_imbalance .* >= 1.0"),
        ({"max_imbalance": math.nan}, ValueError, "max_imbalance"),
        ({"max_imbalance": "1.1"}, ValueError, "max_imbalance"),
        ({"memory_per_rank": 0}, ValueError, "memory_per_rank .* positive"),
        ({"memory_per_rank": -1e9}, ValueError, "memory_per_rank"),
        ({"memory_per_rank": math.inf}, ValueError, "memory_per_rank"),
        ({"preconditioner": "nope"}, ValueError, "no cost model for preconditioner 'nope'"),
    ],
)
def test_bad_arguments(kwargs: dict, error: type, pattern: str) -> None:
    model = GPT(CFG, device="meta")
    args = {"world_size": 4, **kwargs}
    with pytest.raises(error, match=pattern):
        moo.plan_mesh(model, args.pop("world_size"), **args)


def test_bad_models() -> None:
    model = GPT(CFG, device="meta")
    with pytest.raises(TypeError, match="nn.Module or a list of TensorSpec, got str"):
        moo.plan_mesh("gpt", 4)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="holds a int"):
        moo.plan_mesh([1, 2], 4)  # type: ignore[list-item]
    specs = specs_from_module(model)
    with pytest.raises(ValueError, match="roles applies to a module"):
        moo.plan_mesh(specs, 4, roles={"*": "tail"})
    with pytest.raises(ValueError, match="unit_prefixes applies to a module"):
        moo.plan_mesh(specs, 4, unit_prefixes=[""])


def test_divisors_and_prime_world_sizes() -> None:
    for n in range(1, 200):
        assert divisors_descending(n) == [d for d in range(n, 0, -1) if n % d == 0]
    # a prime W has shard W or 1; the tiny GPT (8 matrices) at W=7 leaves ranks idle -> DDP-like
    advice = moo.plan_mesh(GPT(CFG, device="meta"), 7)
    assert advice.mesh_shape in ((1, 7), (7, 1))
    assert advice.candidates[0].shard == 7


def test_projection_formulas_reduce_to_the_flat_ones() -> None:
    hw = S.A100
    n = 3e8
    for N, G in ((1, 8), (4, 8), (64, 8)):
        assert S.group_all_gather_time(n, N * G, 1, G, hw) == pytest.approx(S.hierarchical_all_gather_time(n, N, G, hw))
    for R, shard in ((2, 32), (16, 4), (128, 32)):
        uniform = S.replica_all_reduce_time([n] * shard, R, 8, hw)
        assert uniform == pytest.approx(2 * S.group_all_gather_time(n, R, shard, 8, hw))
    # owner segments: only the ranks holding data load the NICs
    sparse = [n] + [0.0] * 31
    assert S.replica_all_reduce_time(sparse, 16, 8, hw) < S.replica_all_reduce_time([n] * 32, 16, 8, hw)
    assert S.replica_all_reduce_time([n] * 32, 1, 8, hw) == 0.0


def test_compare_meshes(gpt: GPT) -> None:
    prefixes = gpt.unit_prefixes()
    row = S.compare_meshes(gpt, 512, unit_prefixes=prefixes, gpus_per_node=8, hardware=S.H100)
    lay = row["layouts"]
    assert row["advice"]["replicate"] * row["advice"]["shard"] == 512 and row["nodes"] == 64
    assert lay["flat_owner"]["optimizer_step_comm_ms"] == 0.0
    # HSDP's global owners: the step's compute is the flat layout's (both: one matrix on the busiest
    # rank), then the updated matrices' broadcast across the replicas
    hsdp = lay["owner_hsdp"]
    assert hsdp["optimizer_step_comm_ms"] > 0
    assert hsdp["optimizer_step_ms_broadcast_deferred"] == pytest.approx(
        lay["flat_owner"]["optimizer_step_ms"], rel=0.02
    )
    assert lay["stock_fsdp2_muon"]["optimizer_step_comm_ms"] > 0
    assert lay["flat_owner"]["fwd_bwd_comm"]["replicate_all_reduce_ms"] == 0.0
    assert lay["owner_hsdp"]["fwd_bwd_comm"]["replicate_all_reduce_ms"] > 0
    # the advised shard plan is balanced, the flat one is not; with one global owner per matrix
    # both spread the step over all W ranks (the projection's ratios are over all of them)
    assert row["advice"]["bytes_max_over_mean"] <= LIMIT < lay["flat_owner"]["bytes_max_over_mean"]
    assert lay["owner_hsdp"]["flops_max_over_mean"] == pytest.approx(lay["flat_owner"]["flops_max_over_mean"], rel=0.01)
    assert lay["flat_owner"]["optimizer_step_ms"] <= lay["owner_hsdp"]["optimizer_step_ms"]
    assert row["optimizer_step_speedup_of_owner_hsdp"]["stock_fsdp2_muon"] > 10
    one = S.compare_meshes(gpt, 8, unit_prefixes=prefixes, gpus_per_node=8, hardware=S.A100)
    same = {k: v for k, v in one["layouts"]["owner_hsdp"].items() if k != "layout"}
    assert same == {k: v for k, v in one["layouts"]["flat_owner"].items() if k != "layout"}  # (1, 8) is flat
    with pytest.raises(ValueError, match="multiple of --gpus-per-node"):
        S.compare_meshes(gpt, 12, unit_prefixes=prefixes, gpus_per_node=8, hardware=S.A100)


def _cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli_main(argv)
    return rc, out.getvalue(), err.getvalue()


def test_cli_plan_advise() -> None:
    rc, out, _ = _cli(["plan", "-w", "64", "--advise", "--json"])
    assert rc == 0
    row = json.loads(out)
    assert row["replicate"] * row["shard"] == 64 and row["bytes_max_over_mean"] <= LIMIT
    assert row["projection"]["hardware"] == "a100" and row["projection"]["optimizer_step_ms"] > 0
    assert row["candidates"][0]["shard"] == 64 and not row["candidates"][0]["balanced"]
    assert row["flat_owner_projection"]["mesh_shape"] == [1, 64]
    rc, out, _ = _cli(["plan", "--advise", "--world-sizes", "8,64,4096", "--preset", "h100"])
    assert rc == 0 and "(128, 32)" in out and "(1, 8)" in out and "h100" in out
    rc, _, err = _cli(["plan", "--world-sizes", "8,64"])
    assert rc == 2 and "--world-sizes needs --advise" in err
    rc, _, err = _cli(["plan", "-w", "64", "--advise", "--memory-per-rank", "0.01"])
    assert rc == 2 and "memory_per_rank" in err and "max_imbalance" in err
    rc, out, _ = _cli(
        [
            "plan",
            "-w",
            "12",
            "--advise",
            "--layers",
            "2",
            "--width",
            "64",
            "--heads",
            "4",
            "--vocab",
            "128",
            "--seq-len",
            "16",
        ]
    )
    assert rc == 0 and "W=12: no projection" in out  # 12 GPUs do not fill nodes of 8


def test_simulate_mesh_json_is_what_the_command_prints() -> None:
    rc, out, _ = _cli(["simulate", "--mesh", "--json"])
    assert rc == 0
    fresh = json.loads(out)
    committed = json.loads((RESULTS / "simulate_mesh.json").read_text())
    assert fresh == committed, "benchmarks/results/simulate_mesh.json is stale: regenerate it"
    rows = {(r["world_size"], r["hardware"]): r for r in fresh["rows"]}
    assert set(rows) == {(w, h) for w in (64, 512, 4096) for h in ("a100", "h100")}
    for r in rows.values():
        lay = r["layouts"]
        assert lay["owner_hsdp"]["optimizer_step_ms"] < lay["stock_fsdp2_muon"]["optimizer_step_ms"]
        assert r["advice"]["bytes_max_over_mean"] <= LIMIT
    rc, out, _ = _cli(
        [
            "simulate",
            "--mesh",
            "--world-sizes",
            "16",
            "--mesh-presets",
            "a100",
            "--layers",
            "2",
            "--width",
            "64",
            "--vocab",
            "128",
            "--seq-len",
            "16",
        ]
    )
    assert rc == 0 and "owner_hsdp" in out
    rc, _, err = _cli(["simulate", "--mesh", "--mesh-presets", "tpu"])
    assert rc == 2 and "tpu" in err


STEPS = 3


# -- one run on the advised mesh ---------------------------------------------------------------
# Tolerances: test_sharding_parity's (same model, same (2, 2) mesh as its HSDP check).
def _advised_run(rank: int, W: int) -> dict:
    model, ref = make_models(seed=3)
    # --8<-- [start:advise]
    advice = moo.plan_mesh(GPT(CFG, device="meta"), W, unit_prefixes=model.unit_prefixes())
    # --8<-- [end:advise]
    assert advice.mesh_shape == (2, 2), advice.mesh_shape  # 4 ranks would leave the tiny GPT unbalanced
    with pytest.raises(ValueError, match="advice is for 8 ranks but the process group has 4"):
        moo.plan_mesh(GPT(CFG, device="meta"), 8).init_device_mesh("cpu")
    # --8<-- [start:mesh]
    mesh = advice.init_device_mesh("cpu")
    # --8<-- [end:mesh]
    assert tuple(mesh.shape) == (2, 2) and mesh.mesh_dim_names == ("replicate", "shard")
    # --8<-- [start:shard]
    for block in model.layers:
        moo.fully_shard(block, mesh=mesh)
    moo.fully_shard(model, mesh=mesh)
    # --8<-- [end:shard]
    assert model.fix_plan().digest() == advice.plan.digest()  # the runtime plans what was advised
    roles = roles_by_fqn(model)
    opts, ref_opts = owner_optimizers(model, "muon"), reference_optimizers(ref, roles, "muon")
    ref_params = dict(ref.named_parameters())
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    replica_reduces = 0
    for step in range(STEPS):
        with CommCounter() as cc:
            loss = model(*local_batch(step, rank, W))
            loss.backward()
        replica_reduces += sum(1 for r in cc.records if r.op == "replicate_reduce_scatter_v")
        ref_loss = ref(*global_batch(step, W))
        ref_loss.backward()
        t = torch.tensor([loss.item()], dtype=torch.float64)
        torch.distributed.all_reduce(t)  # test bookkeeping: the mean loss over all 4 ranks
        err = abs(t.item() / W - ref_loss.item()) / abs(ref_loss.item())
        worst["loss"] = max(worst["loss"], err)
        assert err <= LOSS_RTOL, (step, err)
        for name, p in model.named_parameters():
            shard, shard_rank = get_matrix_shard(p), get_shard_rank(p)
            if (
                shard.role is not Role.ROWS
                and not shard.is_owned_by(shard_rank)
                or not steps_here(shard, replicas_of(p))
            ):
                assert no_gradient_here(p), name  # HSDP: a matrix's gradient on its global owner only
                continue
            want = full_grad_rows(shard, shard_rank, ref_params[name].grad)
            assert_close(p.grad, want, GRAD_RTOL, f"step {step} rank {rank} grad {name}")
            worst["grad"] = max(worst["grad"], rel_err(p.grad, want))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof, comm_phase("optimizer"):
            for o in opts:
                o.step()
        assert [op.name for op in backend_ops(prof)] == [], "the optimizer step issued a collective"
        for o in ref_opts:
            o.step()
        for o in opts + ref_opts:
            o.zero_grad(set_to_none=True)
    model.unshard()
    try:
        for name, p in model.named_parameters():
            assert_close(p, ref_params[name], PARAM_RTOL, f"rank {rank} {name}")
            worst["param"] = max(worst["param"], rel_err(p, ref_params[name]))
    finally:
        model.reshard()
    return {"worst": worst, "replica_reduces": replica_reduces}


@pytest.mark.multirank
def test_run_on_the_advised_mesh_matches_one_process() -> None:
    results = spawn_ranks(_advised_run, 4, threads_per_rank=1)
    for rank, res in enumerate(results):
        print(f"rank {rank} worst relative errors:", {k: f"{v:.3g}" for k, v in res["worst"].items()})
        assert res["replica_reduces"] >= STEPS  # gradients crossed the replicas every step

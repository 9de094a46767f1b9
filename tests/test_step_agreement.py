"""Ranks at different steps fail by name where the optimizer's step has a collective (issue 43).

With ``skip_nonfinite_grads=True`` every ``OwnerRoutedOptimizer.step()`` all-reduces its
non-finite flag and step count (``agreement.agree_nonfinite``). A rank that calls ``step()`` once
more, or once less, than the others would pair that all-reduce with the others' next forward
all-gather and every rank would wait until the process group's timeout. The forward of a
``fully_shard`` tree whose optimizer checks opens with the same all-reduce, carrying the step
count (``ShardingContext.check_steps``), so the two meet and every rank raises, naming the step
numbers, within seconds. Ranks that step together pay one 24-byte all-reduce per step, in the
forward; the optimizer step without the check still moves zero bytes. A step with collectives of
its own (an owner-layout TP assembly, HSDP's broadcasts at the step) checks the same way over
that group without being asked (``OwnerRoutedOptimizer.step_check_groups``).
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch

from _ranks import attempt, spawn_ranks
from _ref import fully_shard_model
from matrix_owner_optim import OwnerRoutedOptimizer
from matrix_owner_optim.comm import CommCounter
from matrix_owner_optim.toolbox.models.gpt import GPT, GPTConfig

pytestmark = pytest.mark.multirank

CFG = GPTConfig(vocab_size=32, seq_len=8, n_layers=2, d_model=8, n_heads=2)
OPTS = dict(matrix="muon", matrix_options={"lr": 0.02, "ns_dtype": torch.float32}, tail="adamw")
FAIL_FAST_S = 10.0  # issue 43: within 10 s (the process group's timeout is 30 min by default)
JOB_TIMEOUT_S = 120.0


def _batch(step: int, rank: int, W: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    idx = torch.randint(0, CFG.vocab_size, (W, CFG.seq_len), generator=g)
    tgt = torch.randint(0, CFG.vocab_size, (W, CFG.seq_len), generator=g)
    return idx[rank : rank + 1], tgt[rank : rank + 1]


def _skew_job(rank: int, W: int, case: str) -> dict:
    """One step on every rank, then rank W-1 steps once more (``extra``) or skips the next step
    (``missed``) while the others go on as usual; what each rank raised, and how fast."""
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model = fully_shard_model(GPT(CFG))
    opt = OwnerRoutedOptimizer(model, skip_nonfinite_grads=True, **OPTS)
    model(*_batch(0, rank, W)).backward()
    opt.step()  # step 1 everywhere: the check is armed
    opt.zero_grad()
    odd = rank == W - 1

    def go_on() -> None:
        if case == "extra" and odd:
            opt.step()  # step 2 here; the others are in their next forward
        model(*_batch(1, rank, W)).backward()
        if case == "missed" and odd:
            model(*_batch(2, rank, W)).backward()  # on to the next forward; the others step
        else:
            opt.step()

    return attempt(go_on)


# (case, W) -> the rank that raises from step() and each rank's step number
SKEWS = {
    ("extra", 2): {"in_step": {1}, "at": [1, 2]},
    ("extra", 3): {"in_step": {2}, "at": [1, 1, 2]},
    ("missed", 2): {"in_step": {0}, "at": [2, 1]},
}


@pytest.mark.parametrize(("case", "W"), list(SKEWS), ids=[f"{c}-W{w}" for c, w in SKEWS])
def test_a_rank_at_another_step_fails_by_name_on_every_rank(case: str, W: int) -> None:
    results = spawn_ranks(_skew_job, W, case, timeout_s=JOB_TIMEOUT_S)
    want = SKEWS[(case, W)]
    for rank, seen in enumerate(results):
        print(f"\n{case} W={W}: rank {rank} raised after {seen['elapsed']:.2f} s: {seen['error']}")
        where = (
            r"OwnerRoutedOptimizer\.step\(\)" if rank in want["in_step"] else r"fully_shard forward \(its step check\)"
        )
        assert seen["error"] is not None and re.search(
            rf"RuntimeError: {where}: the ranks of process_group are at different steps: "
            rf"rank {rank} is at step {want['at'][rank]}, the group's range from 1 to 2",
            seen["error"],
        ), (rank, seen)
        assert seen["elapsed"] < FAIL_FAST_S, (rank, seen)


def _collective_skew_job(rank: int, W: int, mesh_kind: str, case: str) -> dict:
    """Without ``skip_nonfinite_grads``, on a mesh whose optimizer step has a collective of its own:
    HSDP (``(W, 1)``, every rank a replica, ``replica_broadcast="step"``: the global owners
    broadcast at the end of ``step()``) or owner-layout TP (``(1, W)``: the TP owners assemble
    each matrix in ``step()``). One step everywhere, then rank W-1 steps once more (``extra``) or
    skips the next step (``missed``) while the others go on; what each rank raised, and how fast."""
    warnings.filterwarnings("ignore")
    from torch.distributed.device_mesh import init_device_mesh

    import _tp

    torch.manual_seed(0)
    if mesh_kind == "hsdp":
        mesh = init_device_mesh("cpu", (W, 1), mesh_dim_names=("replicate", "shard"))
        model = fully_shard_model(GPT(CFG), mesh=mesh)
        opt = OwnerRoutedOptimizer(model, replica_broadcast="step", **OPTS)

        def loss(step: int) -> torch.Tensor:
            return model(*_batch(step, rank, W))

    else:
        mesh = init_device_mesh("cpu", (1, W), mesh_dim_names=("dp", "tp"))
        model = _tp.tp_sharded(mesh, stock=False)
        opt = OwnerRoutedOptimizer(model, matrix="muon", matrix_options=OPTS["matrix_options"], tail="adamw")

        def loss(step: int) -> torch.Tensor:
            return model(*_tp.micro(step, mesh))

    loss(0).backward()
    opt.step()  # step 1 everywhere
    opt.zero_grad()
    odd = rank == W - 1

    def go_on() -> None:
        if case == "extra" and odd:
            opt.step()  # step 2 here: its broadcast / assembly would meet the others' forward
        loss(1).backward()
        if case == "missed" and odd:
            loss(2).backward()  # on to the next forward; the others step
        else:
            opt.step()

    return attempt(go_on)


COLLECTIVE_SKEWS = {  # (mesh, case, W) -> the group named, the rank in step() and each rank's step
    ("hsdp", "extra", 2): ("the replicate group", {1}, [1, 2]),
    ("hsdp", "extra", 3): ("the replicate group", {2}, [1, 1, 2]),
    ("hsdp", "missed", 2): ("the replicate group", {0}, [2, 1]),
    ("tp", "extra", 2): ("the TP group", {1}, [1, 2]),
    ("tp", "missed", 2): ("the TP group", {0}, [2, 1]),
}


@pytest.mark.parametrize(
    ("mesh_kind", "case", "W"), list(COLLECTIVE_SKEWS), ids=[f"{m}-{c}-W{w}" for m, c, w in COLLECTIVE_SKEWS]
)
def test_a_rank_at_another_step_fails_by_name_where_the_step_has_collectives(mesh_kind: str, case: str, W: int) -> None:
    """The step check needs no ``skip_nonfinite_grads`` where the step has a collective anyway
    (``OwnerRoutedOptimizer.step_check_groups``): the step opens with it over the group its
    collectives use, and so does the next forward, so the odd rank's step meets the others'
    forward (or their step its forward) and every rank raises by name, fast."""
    among, in_step, at = COLLECTIVE_SKEWS[(mesh_kind, case, W)]
    results = spawn_ranks(_collective_skew_job, W, mesh_kind, case, timeout_s=JOB_TIMEOUT_S)
    for rank, seen in enumerate(results):
        print(f"\n{mesh_kind} {case} W={W}: rank {rank} raised after {seen['elapsed']:.2f} s: {seen['error']}")
        where = r"OwnerRoutedOptimizer\.step\(\)" if rank in in_step else r"fully_shard forward \(its step check\)"
        assert seen["error"] is not None and re.search(
            rf"RuntimeError: {where}: the ranks of {among} are at different steps: "
            rf"rank {rank} is at step {at[rank]}, the group's range from 1 to 2",
            seen["error"],
        ), (rank, seen)
        assert seen["elapsed"] < FAIL_FAST_S, (rank, seen)


def _together_job(rank: int, W: int, skip: bool) -> dict:
    """Three steps of two micro-batches each (the first without gradient sync), every rank
    alike: the step checks each forward pass issues, by phase, and the losses."""
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model = fully_shard_model(GPT(CFG))
    opt = OwnerRoutedOptimizer(model, skip_nonfinite_grads=skip, **OPTS)
    losses, checks = [], []
    for step in range(3):
        with CommCounter() as cc:
            for micro in range(2):
                model.set_requires_gradient_sync(micro == 1)
                loss = model(*_batch(2 * step + micro, rank, W))
                loss.backward()
                losses.append(loss.item())
            opt.step()
            opt.zero_grad()
        checks.append(
            {
                phase: [
                    (r.op, r.bytes_sent)
                    for r in cc.records
                    if r.phase == phase and r.op in ("nonfinite_check", "step_check")
                ]
                for phase in ("forward", "optimizer")
            }
            | {"optimizer_bytes": cc.bytes("optimizer")}
        )
    return {"losses": losses, "checks": checks}


def test_ranks_that_step_together_pay_one_small_all_reduce_per_step() -> None:
    """The forward's check: none before the first checked step, then one per step (at the first
    forward pass after it; the second micro-batch's forward has none), 3 int64 = 24 bytes; the
    same training as without the check; without it the optimizer step moves nothing."""
    W = 2
    on = spawn_ranks(_together_job, W, True, timeout_s=JOB_TIMEOUT_S)
    off = spawn_ranks(_together_job, W, False, timeout_s=JOB_TIMEOUT_S)
    ring = 2 * (W - 1) * 24 // W  # comm.all_reduce counts a ring all-reduce's bytes
    for rank in range(W):
        assert on[rank]["losses"] == off[rank]["losses"], rank
        fwd = [c["forward"] for c in on[rank]["checks"]]
        assert fwd == [[], [("step_check", ring)], [("step_check", ring)]], fwd
        assert all(c["optimizer"] == [("nonfinite_check", ring)] for c in on[rank]["checks"])
        assert all(c["forward"] == [] and c["optimizer"] == [] for c in off[rank]["checks"])
        assert all(c["optimizer_bytes"] == 0 for c in off[rank]["checks"])

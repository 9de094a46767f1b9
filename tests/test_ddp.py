"""OwnerRoutedOptimizer on DistributedDataParallel (replicated parameters) at W=2.

One spawned gloo job runs both modes for 20 steps on a tiny GPT (Muon with float32
Newton-Schulz + AdamW, cosine schedule):

* ``replicated="owner"``: each matrix updated by its owner, results shared in one all_to_all per
  step; bytes per step per rank are exactly ``(W-1)·P_own`` sent and ``P - P_own`` received.
* ``replicated="redundant"``: every rank updates everything; zero bytes, zero collectives.

Both equal a single-process reference (same init, whole batch) within 1e-5 relative, and every
rank ends with bit-identical parameters. In owner mode a resume at step 10 (fresh optimizer and
scheduler from a serialized ``state_dict``) continues the same trajectory.
"""

from __future__ import annotations

import functools

import pytest
import torch

from _ranks import spawn_ranks
from _ref import rel_err_native, roundtrip
from _tolerances import DDP_RTOL as TOL
from matrix_owner_optim import CommCounter, OwnerRoutedOptimizer
from matrix_owner_optim.toolbox.models import GPT, GPTConfig

# one xdist worker runs the module, so its cached gloo job (results()) spawns once per run
pytestmark = [pytest.mark.multirank, pytest.mark.xdist_group("ddp")]

W = 2
STEPS = 20
BATCH = 8
CFG = GPTConfig(vocab_size=64, seq_len=16, n_layers=2, d_model=32, n_heads=4, bias=False)
OPTS = dict(
    matrix="muon",
    matrix_options={"lr": 0.02, "weight_decay": 0.01, "ns_dtype": torch.float32},
    tail="adamw",
    tail_options={"lr": 3e-3, "weight_decay": 0.05},
)


def build() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randint(0, 64, (BATCH, 16), generator=g), torch.randint(0, 64, (BATCH, 16), generator=g))
        for _ in range(STEPS)
    ]


def make(model, replicated: str):
    opt = OwnerRoutedOptimizer(model, replicated=replicated, **OPTS)
    return opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)


@functools.cache
def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = build()
    opt, sched = make(model, "owner")  # one process: plain local updates
    losses = []
    for x, y in batches():
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def ddp_job(rank: int, world_size: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {}
    for mode in ("owner", "redundant"):
        ddp = DDP(build())
        opt, sched = make(ddp, mode)
        lo, hi = rank * BATCH // world_size, (rank + 1) * BATCH // world_size
        losses, sent, received, calls, ops = [], [], [], [], {}
        for step, (x, y) in enumerate(batches()):
            loss = ddp(x[lo:hi], y[lo:hi])
            loss.backward()
            with CommCounter() as cc:
                opt.step()
            opt.zero_grad()
            sched.step()
            losses.append(loss.item())
            sent.append(cc.bytes("optimizer", "sent"))
            received.append(cc.bytes("optimizer", "received"))
            calls.append(cc.calls("optimizer"))
            for k, v in cc.by_op("optimizer").items():
                ops[k] = ops.get(k, 0) + v
            if step == 9 and mode == "owner":
                opt.consolidate_state_dict(to=None)  # owners' matrix state to every rank
                opt_sd, sched_sd = roundtrip(opt.state_dict()), roundtrip(sched.state_dict())
                opt, sched = make(ddp, mode)
                opt.load_state_dict(opt_sd)
                sched.load_state_dict(sched_sd)
        routes = opt.routes()
        params = {n.removeprefix("module."): p.detach().clone() for n, p in ddp.named_parameters()}
        p_own = sum(
            params[r["name"].removeprefix("module.")].numel() * 4
            for r in routes
            if r["role"] == "matrix" and r["owner"] == rank
        )
        p_all = sum(params[r["name"].removeprefix("module.")].numel() * 4 for r in routes if r["role"] == "matrix")
        out[mode] = {
            "losses": losses,
            "params": params,
            "sent": sent,
            "received": received,
            "calls": calls,
            "ops": ops,
            "P_own": p_own,
            "P": p_all,
            "state_keys": sum(1 for st in opt.state.values() if st),  # state held here
            "lr": [g["lr"] for g in opt.param_groups],
            "placement_bytes": sum(pl.bytes_per_step() for pl in opt.layouts()),
            "layouts": sorted({r["layout"] for r in routes}),
        }
    # ranks that disagree on the parameters get a clear error naming the first difference
    w = torch.nn.Parameter(torch.zeros(4, 3 + rank))
    try:
        OwnerRoutedOptimizer([("blocks.0.w", w)])
        out["mismatch"] = "no error"
    except ValueError as exc:
        out["mismatch"] = str(exc)
    return out


@functools.cache
def results() -> list[dict]:
    return spawn_ranks(ddp_job, W, threads_per_rank=1)


@pytest.mark.parametrize("mode", ["owner", "redundant"])
def test_ddp_matches_single_process(mode: str) -> None:
    res = results()
    ref_losses, ref_params = reference()
    for i in range(STEPS):
        loss = sum(r[mode]["losses"][i] for r in res) / W
        assert abs(loss - ref_losses[i]) <= TOL * ref_losses[i], (mode, i, loss, ref_losses[i])
    for r in res:
        assert r[mode]["layouts"] == ["replicated"]
        worst = max((rel_err_native(r[mode]["params"][n], ref_params[n], floor=1e-12), n) for n in ref_params)
        assert worst[0] <= TOL, (mode, worst)
        # replicas stay bit-identical: the owners' results reach every rank exactly
        assert all(torch.equal(r[mode]["params"][n], res[0][mode]["params"][n]) for n in ref_params)
        assert r[mode]["lr"] == res[0][mode]["lr"]


def test_plan_disagreement_names_the_parameter() -> None:
    for r in results():
        assert "disagree" in r["mismatch"] and "'blocks.0.w'" in r["mismatch"], r["mismatch"]


def test_ddp_bytes_per_step() -> None:
    res = results()
    print("\nDDP W=2 bytes per optimizer step per rank:")
    for rank, r in enumerate(res):
        own, red = r["owner"], r["redundant"]
        # owner mode: one all_to_all per step; sends its matrices to the other rank, receives the rest
        assert own["calls"] == [1] * STEPS and own["ops"] == {"replicated_owner_all_to_all": STEPS}
        assert own["sent"] == [(W - 1) * own["P_own"]] * STEPS
        assert own["received"] == [own["P"] - own["P_own"]] * STEPS
        assert own["placement_bytes"] == own["sent"][0] + own["received"][0]
        assert 0 < own["P_own"] < own["P"]
        # matrix state only on the owner: this rank holds fewer state entries than in redundant mode
        assert own["state_keys"] < red["state_keys"]
        # redundant mode moves nothing in the step
        assert red["calls"] == [0] * STEPS and red["sent"] == [0] * STEPS and red["placement_bytes"] == 0
        print(
            f"   rank {rank}: P={own['P']} P/W={own['P'] / W:.0f} owner: sent {own['sent'][0]} "
            f"received {own['received'][0]}; redundant: 0"
        )

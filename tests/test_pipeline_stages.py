"""Pipeline stages on the owner layout: each stage a root of its own, sharded over its dp mesh.

Issue 27: pipeline parallelism composes with the owner layout without anything of its own. On 4
gloo ranks, a (pp=2, dp=2) mesh: a six-layer model cut in two stages (embedding and two
blocks; two blocks and the head), each stage's blocks and the stage itself passed to this
package's ``fully_shard`` over ``mesh["dp"]``, torch's ``PipelineStage`` over ``mesh["pp"]`` and
its ``ScheduleGPipe`` (2 micro-batches, gradients scaled by their count), and one
``OwnerRoutedOptimizer`` per stage (torch.optim.Muon on the blocks' matrices, AdamW on the
rest). Against one process running ``torch.optim.Muon`` + ``torch.optim.AdamW`` on the whole
model over the whole batch: the losses and every parameter equal at the noise floor, on every
rank, and each matrix's optimizer state exists on exactly one rank of its stage.

The pipeline's backward is autograd's (``stage_backward``); the owner layout's hooks reduce each
micro-batch's gradients as they come (torch's pipelining special-cases only its own
``FSDPModule``, whose reductions it defers to the last micro-batch).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _ranks import spawn_ranks
from _ref import fully_shard_model, rel_err
from _tolerances import PP_LOSS_RTOL, PP_PARAM_RTOL
from matrix_owner_optim import OwnerRoutedOptimizer

# one xdist worker runs the module, so its cached gloo job (results()) spawns once per run
pytestmark = [pytest.mark.multirank, pytest.mark.xdist_group("pipeline_stages")]

VOCAB, D, HIDDEN, SEQ = 16, 12, 20, 6
BATCH, MICRO, STEPS = 8, 2, 3
MUON = {"lr": 0.02, "weight_decay": 0.01}
ADAMW = {"lr": 3e-3, "weight_decay": 0.05}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(D, HIDDEN)
        self.w2 = nn.Linear(HIDDEN, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(F.gelu(self.w1(x)))


class First(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return x


class Last(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def build() -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList([First(), Last()])


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))
        for _ in range(STEPS)
    ]


def _is_matrix(name: str) -> bool:
    return name.endswith(("w1.weight", "w2.weight"))


def _stage_optimizer(stage: nn.Module) -> OwnerRoutedOptimizer:
    roles = {n: ("matrix" if _is_matrix(n) else "tail") for n, _ in stage.named_parameters()}
    return OwnerRoutedOptimizer(
        stage, matrix="torch_muon", matrix_options=MUON, tail="adamw", tail_options=ADAMW, roles=roles
    )


@functools.cache
def reference(order: str = "forward") -> dict[str, Any]:
    """One process, the whole model and batch: torch.optim.Muon on the blocks' matrices, AdamW
    on the rest (the routing the stages' optimizers are given). The gradient is accumulated over
    the pipeline's micro-batches (each dp coordinate's ``MICRO`` slices of its half, in order),
    as DDP-averaged gradients are the reference elsewhere: the whole batch's one backward sums in
    another grouping, which torch.optim.Muon's bfloat16 Newton-Schulz amplifies to 1e-3 on CPUs
    whose matmuls do not happen to round the two alike. ``order="reversed"`` takes each
    micro-batch's rows in reverse: the same sums in another order (the noise floor)."""
    model = build()
    named = dict(model.named_parameters())
    opts = [
        torch.optim.Muon([p for n, p in named.items() if _is_matrix(n)], **MUON),
        torch.optim.AdamW([p for n, p in named.items() if not _is_matrix(n)], **ADAMW),
    ]
    losses = []
    chunks = 2 * MICRO  # (dp coordinate, micro-batch) pairs, of equal size
    for x, y in batches():
        size = x.shape[0] // chunks
        micro_losses = []
        for c in range(chunks):
            xc, yc = x[c * size : (c + 1) * size], y[c * size : (c + 1) * size]
            if order == "reversed":
                xc, yc = xc.flip(0), yc.flip(0)
            loss = loss_fn(model[1](model[0](xc)), yc)
            (loss / chunks).backward()
            micro_losses.append(loss.detach())
        loss = torch.stack(micro_losses).mean()
        for o in opts:
            o.step()
            o.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in named.items()}}


def pipeline_job(rank: int, W: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    s, d = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    stage_module = build()[s]
    fully_shard_model(stage_module, blocks=stage_module.blocks, mesh=mesh["dp"])
    opt = _stage_optimizer(stage_module)
    stage = PipelineStage(stage_module, s, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = ScheduleGPipe(stage, n_microbatches=MICRO, loss_fn=loss_fn, scale_grads=True)
    half = BATCH // 2
    losses = []
    for x, y in batches():
        xs, ys = x[d * half : (d + 1) * half], y[d * half : (d + 1) * half]
        if s == 0:
            schedule.step(xs)
        else:
            mb: list[torch.Tensor] = []
            schedule.step(target=ys, losses=mb)
            losses.append(float(torch.stack(mb).detach().mean()))
        opt.step()
        opt.zero_grad()
    prefix = "0." if s == 0 else "1."
    params = {prefix + n: p.full_tensor().detach().clone() for n, p in stage_module.named_parameters()}
    names = {id(p): prefix + n for n, p in stage_module.named_parameters()}
    held_state = sorted(
        names[id(p)]
        for p, st in opt.state.items()
        if _is_matrix(names[id(p)]) and any(torch.is_tensor(v) and v.dim() for v in st.values())
    )
    return {"stage": s, "dp": d, "losses": losses, "params": params, "held_state": held_state}


@functools.cache
def results() -> list[dict[str, Any]]:
    return spawn_ranks(pipeline_job, 4)


def test_pipeline_stages_on_the_owner_layout_equal_one_process() -> None:
    ref = reference()
    for r in results():
        worst = max(rel_err(p, ref["params"][n]) for n, p in r["params"].items())
        print(f"stage {r['stage']} dp {r['dp']}: worst parameter rel err {worst:.2e}")
        for n, p in r["params"].items():
            assert rel_err(p, ref["params"][n]) <= PP_PARAM_RTOL, (r["stage"], r["dp"], n, rel_err(p, ref["params"][n]))
    # the last stage's losses: each dp coordinate's micro-batch mean; the two average to the batch's
    last = [r for r in results() if r["stage"] == 1]
    for i, want in enumerate(ref["losses"]):
        got = sum(r["losses"][i] for r in last) / len(last)
        assert abs(got - want) <= PP_LOSS_RTOL * abs(want), (i, got, want)


def test_each_matrix_state_on_one_rank_of_its_stage() -> None:
    for stage in (0, 1):
        held = [set(r["held_state"]) for r in results() if r["stage"] == stage]
        matrices = {n for n in reference()["params"] if n.startswith(f"{stage}.") and _is_matrix(n)}
        assert set().union(*held) == matrices, (stage, held)
        assert sum(len(h) for h in held) == len(matrices), (stage, held)  # no matrix twice


if __name__ == "__main__":  # the noise floor: the reference against itself, summation order changed
    a, b = reference(), reference("reversed")
    print("params", max(rel_err(a["params"][n], b["params"][n]) for n in a["params"]))
    print("losses", max(abs(x - y) / abs(y) for x, y in zip(a["losses"], b["losses"], strict=True)))

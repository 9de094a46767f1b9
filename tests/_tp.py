"""Shared by the tensor- and expert-parallel tests (test_tensor_parallel.py on stock FSDP2,
test_tensor_parallel_owner.py and test_expert_parallel_owner.py on the owner layout): the two
TP blocks and their data, how they are cut and sharded, the one-process clipped run, and the
torchtitan Llama3 / Qwen3-MoE references (CPU adaptations: tests/_titan.py).

The blocks' hidden sizes (10 and 6) split evenly over tp (torch's TP needs that) and make FSDP's
row blocks of each TP slice uneven (3 and 2 rows, 2 and 1).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from _ref import fully_shard_model
from matrix_owner_optim.preconditioners import Muon

STEPS = 4
BATCH = 8  # global batch; dp rank d takes rows [4d, 4d + 4), both TP ranks of it the same
D = 6
MUON = {"lr": 0.02, "weight_decay": 0.01}
ADAMW = {"lr": 3e-3, "weight_decay": 0.05}
CLIP = 0.5  # below the gradient norms here, so clipping scales every step


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(D, hidden)
        self.w2 = nn.Linear(hidden, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(torch.tanh(self.w1(x)))


class Net(nn.Module):
    """Two TP blocks. Every parameter is then on the 2D mesh (w1's bias split over tp, w2's
    replicated there), as torch's ``clip_grad_norm_`` needs: it stacks the per-tensor norms, and
    DTensors on different meshes (a tensor outside TP lives on the dp mesh alone) do not stack."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(10), Block(6)])

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return F.mse_loss(x, y)


def build() -> Net:
    torch.manual_seed(0)
    return Net()


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 3, D, generator=g), torch.randn(BATCH, 3, D, generator=g)) for _ in range(STEPS)]


def parallelize_block(block: nn.Module, tp_mesh: Any) -> None:
    """torch's ``parallelize_module`` on one :class:`Block`: ``ColwiseParallel`` w1,
    ``RowwiseParallel`` w2 over ``tp_mesh``."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    parallelize_module(block, tp_mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})


def tp_sharded(mesh: Any, *, stock: bool) -> Net:
    """:func:`build`'s model with each block cut over ``mesh["tp"]`` (:func:`parallelize_block`),
    then sharded blocks-then-root over ``mesh["dp"]``: by stock FSDP2's ``fully_shard``
    (``stock``; w1 is then ``(_StridedShard(0, sf=2), Shard(0))``, w2 ``(Shard(0), Shard(1))``)
    or by this package's."""
    model = build()
    for block in model.layers:
        parallelize_block(block, mesh["tp"])
    return fully_shard_model(model, stock=stock, mesh=mesh["dp"])


def micro(step: int, mesh: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s rows of dp coordinate ``mesh["dp"]`` (both TP ranks of it the same)."""
    x, y = batches()[step]
    dp = mesh["dp"].get_local_rank()
    lo, hi = dp * BATCH // 2, (dp + 1) * BATCH // 2
    return x[lo:hi], y[lo:hi]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in the tensors' dtype (plain, whole tensors)."""
    return float((a - b).norm() / b.norm())


def clipped_run(model: nn.Module, opts: list, pairs: Any, loss_of: Any, order: str) -> dict[str, Any]:
    """Train one process on ``pairs`` (``order="reversed"``: each batch's rows reversed) with
    torch's clip_grad_norm_ every step; the losses, clip norms and final parameters."""
    losses, norms = [], []
    for x, y in pairs:
        if order == "reversed":
            x, y = x.flip(0), y.flip(0)
        loss = loss_of(x, y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        for o in opts:
            o.step()
            o.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


# -- torchtitan: a tiny Llama3 and Qwen3-MoE (tests/_titan.py) -------------------------------------
TITAN_STEPS, TITAN_BATCH = 3, 4  # dp coordinate d takes rows [2d, 2d + 2)
# Against the whole-batch one-process run, Newton-Schulz in float32 (this package's Muon,
# ns_dtype=float32; torch.optim.Muon always runs it in bfloat16): TP's split matmuls and
# sequence-parallel norms change the gradients' round-off, which bfloat16 Newton-Schulz turns
# into bfloat16 ulps of the update. torch.optim.Muon itself is checked in lockstep: fed the same
# gradients it agrees bitwise, so that difference is the model's round-off, not the step.
LLAMA_MUON = {**MUON, "ns_dtype": torch.float32}
# The checkpoint runs between (2, 2) and the 1D layouts (tests/_titan_checkpoint.py)
LLAMA_CHECKPOINT = {
    "clip": CLIP,
    "optimizer": {"matrix": "muon", "matrix_options": LLAMA_MUON, "tail": "adamw", "tail_options": ADAMW},
}


def titan_matrix_names(model: nn.Module) -> set[str]:
    from matrix_owner_optim.planning import Role
    from matrix_owner_optim.planning.roles import module_roles

    roles = module_roles(model)
    return {n for n, p in model.named_parameters() if roles[id(p)] is Role.MATRIX}


def titan_optimizers(
    model: nn.Module, matrix: type[torch.optim.Optimizer], options: dict
) -> list[torch.optim.Optimizer]:
    """One process: the matrix optimizer on the matrices, AdamW on the rest."""
    mats = titan_matrix_names(model)
    return [
        matrix([p for n, p in model.named_parameters() if n in mats], **options),
        torch.optim.AdamW([p for n, p in model.named_parameters() if n not in mats], **ADAMW),
    ]


def titan_reference(order: str = "forward", fuse_qkv: bool = True) -> dict[str, Any]:
    """One process, the whole batch (``order="reversed"``: its rows reversed, the noise floor),
    Muon with float32 Newton-Schulz, torch's clip_grad_norm_ every step; ``fuse_qkv=False``:
    the checkpoint runs' model, separate q/k/v."""
    import _titan

    model = _titan.build(_titan.llama_config(fuse_qkv=fuse_qkv), _titan.parallelism())
    opts = titan_optimizers(model, Muon, LLAMA_MUON)
    return clipped_run(
        model,
        opts,
        _titan.batches(TITAN_STEPS, TITAN_BATCH),
        lambda tokens, targets: _titan.loss(model, tokens, targets, tokens.numel()),
        order,
    )


MOE_STEPS, MOE_BATCH = 3, 4  # rank r takes row r of each global batch


def moe_reference(order: str = "forward") -> dict[str, Any]:
    """One process, the whole batch (``order="reversed"``: its rows reversed, the noise floor):
    this package's Muon (float32 Newton-Schulz) on the matrices, each expert of a stack its own
    matrix, AdamW on the rest."""
    import _titan

    model = _titan.build(_titan.qwen3_moe_config(), _titan.parallelism())
    opts = titan_optimizers(model, Muon, LLAMA_MUON)
    losses = []
    for tokens, targets in _titan.batches(MOE_STEPS, MOE_BATCH, seed=3):
        if order == "reversed":
            tokens, targets = tokens.flip(0), targets.flip(0)
        loss = _titan.loss(model, tokens, targets, tokens.numel())
        loss.backward()
        for o in opts:
            o.step()
            o.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def moe_step(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    """Forward and backward of rank ``rank``'s row of the Qwen3-MoE batch of ``step``; the loss."""
    import _titan

    tokens, targets = _titan.batches(MOE_STEPS, MOE_BATCH, seed=3)[step]
    loss = _titan.loss(model, tokens[rank : rank + 1], targets[rank : rank + 1], tokens.numel())
    loss.backward()
    return loss

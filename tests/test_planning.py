"""Planner and metadata: exactly one owner per tensor, balance, determinism, edge cases.

Everything here runs in one process on meta tensors, at simulated world sizes up to 1024.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from itertools import pairwise

import pytest
import torch
from torch import nn

from matrix_owner_optim import Role, ShardingPlan, plan_model
from matrix_owner_optim.planning import TensorSpec, plan_tensors
from matrix_owner_optim.sharding.collectives import SegmentLayout
from matrix_owner_optim.toolbox.models import GPT, GPTConfig

WORLD_SIZES = [1, 2, 3, 7, 8, 64, 1024]


def small_gpt(device: str = "meta", **kw) -> GPT:
    cfg = dict(vocab_size=512, seq_len=32, n_layers=4, d_model=64, n_heads=4)
    cfg.update(kw)
    return GPT(GPTConfig(**cfg), device=device)


def big_gpt() -> GPT:
    return GPT(GPTConfig(vocab_size=50304, seq_len=1024, n_layers=32, d_model=1024, n_heads=16), device="meta")


def check_placement(plan: ShardingPlan, model: nn.Module) -> None:
    W = plan.world_size
    distinct = {id(p): p for p in model.parameters()}
    assert len(plan) == len(distinct), "every distinct tensor is planned exactly once"
    for shard in plan:
        if shard.role is Role.ROWS:
            assert shard.owner is None
            rows = [shard.row_range(r) for r in range(W)]
            # rows cover [0, n) exactly once, in rank order, as torch.chunk splits them
            assert rows[0][0] == 0 and rows[-1][1] == shard.shape[0]
            for (a0, a1), (b0, _) in pairwise(rows):
                assert a1 == b0 and a0 <= a1
            sizes = [b - a for a, b in rows]
            assert max(sizes) - min(s for s in sizes if s) <= 1 or max(sizes) == -(-shard.shape[0] // W)
        else:
            assert shard.owner is not None and 0 <= shard.owner < W
            held = [r for r in range(W) if shard.local_numel(r) == shard.numel]
            assert held == [shard.owner], f"{shard.fqn} must be whole on exactly its owner"
            assert all(shard.local_shape(r) == (0, *shard.shape[1:]) for r in range(W) if r != shard.owner)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_every_tensor_has_one_owner_or_is_evenly_sharded(world_size: int) -> None:
    model = small_gpt()
    plan = plan_model(model, world_size, unit_prefixes=model.unit_prefixes())
    check_placement(plan, model)
    assert plan.world_size == world_size and len(plan.loads) == world_size
    # per-rank figures add up to the model's totals
    owned = sum(x.owned_tensors for x in plan.loads)
    assert owned == sum(1 for s in plan if s.role is not Role.ROWS)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_tied_parameters_counted_once(world_size: int) -> None:
    model = small_gpt()
    assert model.lm_head.weight is model.wte.weight
    plan = plan_model(model, world_size)
    assert "wte.weight" in plan.shards and "lm_head.weight" not in plan.shards
    assert plan["wte.weight"].aliases == ("lm_head.weight",)
    assert plan["lm_head.weight"] is plan["wte.weight"]  # lookup by alias
    assert plan["wte.weight"].role is Role.ROWS


def test_default_roles() -> None:
    model = small_gpt(tie_embeddings=False)
    plan = plan_model(model, 4)
    assert plan["layers.0.attn.qkv.weight"].role is Role.MATRIX
    assert plan["layers.0.mlp.proj.weight"].role is Role.MATRIX
    assert plan["layers.0.attn.qkv.bias"].role is Role.TAIL
    assert plan["layers.0.ln1.weight"].role is Role.TAIL
    assert plan["wte.weight"].role is Role.ROWS
    assert plan["wpe.weight"].role is Role.ROWS
    assert plan["lm_head.weight"].role is Role.ROWS, "untied head shaped like the vocab table"


def test_square_position_table_does_not_turn_projections_into_heads() -> None:
    # seq_len == d_model makes wpe square: d x d projections must stay matrices
    model = small_gpt(seq_len=64, d_model=64)
    plan = plan_model(model, 2)
    assert plan["layers.0.attn.proj.weight"].role is Role.MATRIX


def test_role_overrides_and_errors() -> None:
    model = small_gpt()
    plan = plan_model(model, 4, roles={"layers.*.mlp.fc.weight": "tail", "wpe.weight": "tail"})
    assert plan["layers.2.mlp.fc.weight"].role is Role.TAIL
    assert plan["wpe.weight"].role is Role.TAIL and plan["wpe.weight"].owner is not None
    with pytest.raises(ValueError, match=r"layers\.\*\.attn\.qkv\.weight.*'banana'|'banana'.*layers"):
        plan_model(model, 4, roles={"layers.*.attn.qkv.weight": "banana"})
    with pytest.raises(ValueError, match="layers.0.ln1.weight.*matrix"):
        plan_model(model, 4, roles={"layers.0.ln1.weight": "matrix"})
    with pytest.raises(ValueError, match="nothing.here"):
        plan_model(model, 4, roles={"nothing.here": "tail"})


def test_big_gpt_balance_at_w8() -> None:
    model = big_gpt()
    plan = plan_model(model, 8, unit_prefixes=model.unit_prefixes())
    imb = plan.imbalance()
    assert imb["bytes_max_over_mean"] <= 1.05, imb
    assert imb["flops_max_over_mean"] <= 1.05, imb
    # identical blocks must not all put their largest matrix on the same rank
    fc_owners = {plan[f"layers.{i}.mlp.fc.weight"].owner for i in range(32)}
    qkv_owners = {plan[f"layers.{i}.attn.qkv.weight"].owner for i in range(32)}
    assert len(fc_owners) >= 4 and len(qkv_owners) >= 4
    assert all(x.owned_matrices > 0 for x in plan.loads)


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_rank_gets_an_even_share_of_each_shape(world_size: int) -> None:
    """The bench's GPT 4x256 with a unit per block: its tall ``mlp.fc`` (1024x256) and wide
    ``mlp.proj`` (256x1024) cost the same, and placed in model order every tall one landed on
    one rank at W=2 (the slow rank of the optimizer step: shape_counts.even_shapes). Each rank now
    holds as many of each shape as any other, each block's matrices still spread over ranks,
    and the loads (bytes, FLOPs per rank) are the ones the placement alone gives."""
    model = GPT(GPTConfig(vocab_size=14, seq_len=32, n_layers=4, d_model=256, n_heads=4), device="meta")
    plan = plan_model(model, world_size, unit_prefixes=model.unit_prefixes())
    shapes = {tuple(s.shape) for s in plan if s.role is Role.MATRIX}
    for shape in shapes:
        per_rank = [
            sum(1 for s in plan if s.role is Role.MATRIX and tuple(s.shape) == shape and s.owner == r)
            for r in range(world_size)
        ]
        assert max(per_rank) - min(per_rank) <= 1, (shape, per_rank)
    for i in range(4):  # a block's MLP pair on two ranks (its gather segments stay spread)
        assert plan[f"layers.{i}.mlp.fc.weight"].owner != plan[f"layers.{i}.mlp.proj.weight"].owner
    imb = plan.imbalance()
    assert imb["bytes_max_over_mean"] <= 1.05 and imb["flops_max_over_mean"] <= 1.05, imb


@pytest.mark.parametrize("preconditioner", ["muon", "shampoo", "soap", "adamw"])
def test_balance_holds_for_every_preconditioner(preconditioner: str) -> None:
    model = GPT(GPTConfig(vocab_size=8192, seq_len=256, n_layers=16, d_model=512, n_heads=8), device="meta")
    plan = plan_model(model, 8, preconditioner=preconditioner, unit_prefixes=model.unit_prefixes())
    imb = plan.imbalance()
    assert imb["bytes_max_over_mean"] <= 1.05 and imb["flops_max_over_mean"] <= 1.05, imb
    assert plan.preconditioner == preconditioner


def test_cost_model_prices_state() -> None:
    model = small_gpt()
    muon = plan_model(model, 1, preconditioner="muon")
    shampoo = plan_model(model, 1, preconditioner="shampoo")
    assert shampoo.loads[0].resident_bytes > muon.loads[0].resident_bytes
    # Muon on one rank: params + grads + one momentum buffer for matrices, AdamW moments else
    p_bytes = sum(p.numel() * 4 for p in {id(p): p for p in model.parameters()}.values())
    m_bytes = sum(s.nbytes for s in muon if s.role is Role.MATRIX)
    assert muon.loads[0].resident_bytes == 2 * p_bytes + m_bytes + 2 * (p_bytes - m_bytes)


def test_determinism_and_digest() -> None:
    a = plan_model(small_gpt("cpu"), 7)
    torch.manual_seed(123)
    b = plan_model(small_gpt("cpu"), 7)
    assert a.digest() == b.digest() and a.first_difference(b) is None
    c = plan_model(small_gpt("cpu", d_model=128), 7)
    assert c.digest() != a.digest()
    assert "differs" in (a.first_difference(c) or "")
    assert plan_model(small_gpt(), 8).digest() != plan_model(small_gpt(), 7).digest()


def test_digest_stable_across_processes() -> None:
    code = (
        "from matrix_owner_optim.toolbox.models import GPT, GPTConfig;"
        "from matrix_owner_optim import plan_model;"
        "m=GPT(GPTConfig(vocab_size=512,seq_len=32,n_layers=4,d_model=64,n_heads=4),device='meta');"
        "print(plan_model(m, 3).digest())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == plan_model(small_gpt(), 3).digest()


@pytest.mark.parametrize("shape", [(1, 64), (64, 1), (1, 1)])
def test_degenerate_matrix_shapes(shape: tuple[int, int]) -> None:
    model = nn.Sequential(nn.Linear(shape[1], shape[0], bias=False), nn.Linear(shape[0], 8))
    for W in (1, 2, 3):
        plan = plan_model(model, W)
        check_placement(plan, model)
        assert plan["0.weight"].role is Role.MATRIX and plan["0.weight"].shape == shape


def test_empty_model() -> None:
    plan = plan_model(nn.Module(), 4)
    assert len(plan) == 0 and len(plan.loads) == 4
    assert plan.imbalance() == {"bytes_max_over_mean": 1.0, "flops_max_over_mean": 1.0}
    assert plan.summary()["ranks_without_matrices"] == 4


def test_more_ranks_than_tensors_is_reported_not_an_error() -> None:
    model = nn.Linear(8, 8)
    plan = plan_model(model, 16)
    check_placement(plan, model)
    assert plan.summary()["ranks_without_matrices"] == 15


def test_frozen_parameters_are_placed_without_state() -> None:
    model = nn.Sequential(nn.Linear(32, 32, bias=False), nn.Linear(32, 32, bias=False))
    model[0].weight.requires_grad_(False)
    plan = plan_model(model, 1)
    assert plan["0.weight"].requires_grad is False
    # frozen: param only; trainable: param + grad + momentum
    assert plan.loads[0].resident_bytes == 32 * 32 * 4 * (1 + 3)


def test_segments_are_contiguous_per_owner() -> None:
    model = small_gpt()
    plan = plan_model(model, 3, unit_prefixes=model.unit_prefixes())
    for unit in plan.units():  # every owner's tensors of a unit, contiguous, in model order
        shards = [s for s in plan if s.unit == unit]
        layout = SegmentLayout.build(shards, 3)
        for r in range(3):
            owned = [s for s in shards if s.owner == r]
            entries = [e for e in layout.entries[r] if e.rows is None]
            assert [shards[e.index].fqn for e in entries] == [s.fqn for s in owned]
            assert [e.offset for e in entries] == list(itertools.accumulate([0] + [s.numel for s in owned]))[:-1]
    # a unit's tail is packed on one owner
    for unit in plan.units():
        tails = {s.owner for s in plan if s.unit == unit and s.role is Role.TAIL}
        assert len(tails) <= 1


def test_invalid_world_size() -> None:
    with pytest.raises(ValueError, match="world_size"):
        plan_model(small_gpt(), 0)


def test_plan_tensors_rejects_duplicate_names() -> None:
    spec = TensorSpec("w", (4, 4), torch.float32, Role.MATRIX)
    with pytest.raises(ValueError, match="'w' appears twice"):
        plan_tensors([spec, spec], 2)


def test_cli_plan_json_at_w1024() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "matrix_owner_optim.toolbox.cli.main",
            "plan",
            "--world-size",
            "1024",
            "--layers",
            "32",
            "--width",
            "1024",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,  # a hang guard only: importing torch can take minutes on a loaded machine
    )
    summary = json.loads(out.stdout)
    assert summary["world_size"] == 1024 and len(summary["ranks"]) == 1024
    assert summary["roles"]["matrix"] == 128
    assert summary["ranks_without_matrices"] == 1024 - 128


def test_cli_plan_table_and_bad_role() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "matrix_owner_optim.toolbox.cli.main",
            "plan",
            "-w",
            "4",
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
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "imbalance (max/mean)" in out.stdout and "digest" in out.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "matrix_owner_optim.toolbox.cli.main", "plan", "--role", "layers.*=nope"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode != 0 and "layers.*" in bad.stderr and "nope" in bad.stderr


def test_cli_plan_user_factory(tmp_path, monkeypatch) -> None:
    (tmp_path / "usermodel.py").write_text(
        "import torch.nn as nn\n"
        "def build():\n    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))\n"
    )
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "matrix_owner_optim.toolbox.cli.main",
            "plan",
            "-w",
            "2",
            "--json",
            "--model",
            "usermodel:build",
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
        env={**__import__("os").environ, "PYTHONPATH": str(tmp_path)},
    )
    summary = json.loads(out.stdout)
    assert summary["roles"] == {"matrix": 2, "tail": 2, "rows": 0}


def test_mixtral_64_experts_at_w256_priced_per_expert() -> None:
    """An 8-layer, 64-expert Mixtral (hidden 256, intermediate 896) planned at W=256.

    Whole-tensor ownership would sit at the bound its largest indivisible item sets (bytes
    max/mean 20.0, FLOPs 20.7; 208 of 256 ranks owning no matrix): 16 expert tensors cannot
    spread over 256 ranks. The planner places such stacks expert by expert (whole experts, each
    rank's as one contiguous row range), so the plan balances: both max/mean <= 1.1, and the
    same as planning every expert as its own tensor.
    """
    import dataclasses

    from _moe import TinyMoE
    from matrix_owner_optim.planning.cost import MUON_COST
    from matrix_owner_optim.planning.planner import tensor_flops, tensor_resident_bytes
    from matrix_owner_optim.planning.roles import specs_from_module

    W = 256
    with torch.device("meta"):
        model = TinyMoE(layers=8, experts=64, hidden=256, inter=896, vocab=32000)
    specs = specs_from_module(model, unit_prefixes=[f"layers.{i}" for i in range(8)] + [""])
    experts = [s for s in specs if ".experts." in s.fqn]
    assert len(experts) == 16 and all(s.role is Role.MATRIX and s.view.kind == "stack" for s in experts)
    for s in experts:  # priced per expert: E times one [out, in] matrix
        assert tensor_flops(s, MUON_COST) == 64 * MUON_COST.flops(s.shape[1:])
    plan = plan_tensors(specs, W)
    imb = plan.summary()["imbalance"]
    mean_bytes = sum(x.resident_bytes for x in plan.loads) / W
    whole_bound = max(tensor_resident_bytes(s, MUON_COST) for s in experts) / mean_bytes
    print(
        f"W={W}: bytes {imb['bytes_max_over_mean']:.3f}, FLOPs {imb['flops_max_over_mean']:.3f} "
        f"(whole tensors could not go below {whole_bound:.2f})"
    )
    assert imb["bytes_max_over_mean"] <= 1.1 and imb["flops_max_over_mean"] <= 1.1
    for s in experts:  # whole experts: contiguous ranges that tile [0, E), one per rank
        shard = plan[s.fqn]
        assert shard.is_split and shard.owner is None
        ranges = sorted((a, b) for a, b, _ in shard.row_owners)
        assert ranges[0][0] == 0 and ranges[-1][1] == 64
        assert all(p[1] == q[0] for p, q in pairwise(ranges))
        assert sorted(r for _, _, r in shard.row_owners) == list(range(W))
    split = [
        dataclasses.replace(s, fqn=f"{s.fqn}[{e}]", shape=s.shape[1:], view=None)
        for s in experts
        for e in range(s.shape[0])
    ]
    per_expert = plan_tensors([s for s in specs if s not in experts] + split, W).summary()["imbalance"]
    assert imb["bytes_max_over_mean"] <= per_expert["bytes_max_over_mean"] + 0.02
    assert imb["flops_max_over_mean"] <= per_expert["flops_max_over_mean"] + 0.02

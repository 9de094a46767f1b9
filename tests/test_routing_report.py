"""The routing report: what reached which optimizer, from an optimizer or a plan, logged once."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from _moe import TinyMoE
from matrix_owner_optim import OwnerRoutedOptimizer, plan_model
from matrix_owner_optim.optim.report import ROUTER_REASON, logger, routing_report

LOGGER = "matrix_owner_optim.optim.report"


def _step(opt: OwnerRoutedOptimizer, model: nn.Module) -> None:
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()


def test_counts_and_bytes_per_optimizer_and_role() -> None:
    model = TinyMoE(layers=2, experts=4, hidden=32, inter=16, vocab=64)
    rep = OwnerRoutedOptimizer(model).routing_report()
    by = {(e["optimizer"], e["role"]): e for e in rep.summary()}
    muon = by[("muon", "matrix")]
    # per layer: q, k, v, o (1 matrix each) + gate_up_proj and down_proj (4 experts each)
    assert muon["tensors"] == 2 * 6 and muon["matrices"] == 2 * (4 + 4 + 4)
    assert muon["bytes"] == 4 * 2 * (4 * 32 * 32 + 4 * 32 * 32 + 4 * 32 * 16)
    tail = by[("adamw", "tail")]
    assert tail["tensors"] == 2 * 3 and tail["bytes"] == 4 * 2 * (32 + 32 + 4 * 32)  # norms, router
    assert by[("adamw", "rows")]["tensors"] == 2
    assert sum(e["bytes"] for e in rep.summary()) == 4 * sum(p.numel() for p in model.parameters())
    assert {r.name for r in rep.stacks()} == {n for n, _ in model.named_parameters() if ".experts." in n}
    assert rep.left_to_tail() == []  # the routers are small
    assert routing_report(plan_model(model, 4)).summary() == rep.summary()  # the plan says the same


def test_tensors_left_to_the_tail_are_named_with_the_reason() -> None:
    model = nn.ModuleDict({"moe": TinyMoE(hidden=256, experts=4, inter=16), "conv": nn.Conv2d(3, 8, 3)})
    opt = OwnerRoutedOptimizer(model, roles={"moe.layers.1.mlp.experts.*": "tail"})
    rep = opt.routing_report()
    named = {r.name: r.reason for r in rep.left_to_tail()}
    assert set(named) == {"moe.layers.1.mlp.experts.gate_up_proj", "moe.layers.1.mlp.experts.down_proj", "conv.weight"}
    assert named["conv.weight"].startswith("conv kernel")
    assert rep.unexpected_tail() == rep.left_to_tail()
    # the routers are on the tail by rule: named as such, and only listed once they are large
    reasons = {r.name: r.reason for r in rep.rows}
    assert reasons["moe.layers.0.mlp.gate.weight"] == ROUTER_REASON
    big = OwnerRoutedOptimizer(model, roles={"moe.layers.1.mlp.experts.*": "tail"}).routing_report(large_numel=1024)
    assert {r.name for r in big.left_to_tail()} - set(named) == {
        "moe.layers.0.mlp.gate.weight",
        "moe.layers.1.mlp.gate.weight",
    }
    assert big.unexpected_tail() == rep.left_to_tail()
    text = rep.format()
    assert "moe.layers.1.mlp.experts.down_proj (4, 256, 16) role tail" in text and "conv.weight" in text


def test_logged_once_on_the_first_step_and_silenceable(caplog: pytest.LogCaptureFixture) -> None:
    model = TinyMoE()
    opt = OwnerRoutedOptimizer(model, roles={"layers.0.mlp.experts.*": "tail"})
    with caplog.at_level(logging.INFO, logger=LOGGER):
        _step(opt, model)
        _step(opt, model)
    records = [r for r in caplog.records if r.name == LOGGER]
    assert [r.levelno for r in records] == [logging.INFO, logging.WARNING]  # one report, one warning
    assert "muon matrix" in records[0].getMessage()
    assert "layers.0.mlp.experts.gate_up_proj (4, 32, 32)" in records[1].getMessage()
    caplog.clear()
    quiet = OwnerRoutedOptimizer(model)
    logger.setLevel(logging.ERROR)
    try:
        _step(quiet, model)
    finally:
        logger.setLevel(logging.NOTSET)
    assert not [r for r in caplog.records if r.name == LOGGER]


def test_cli_plan_prints_the_report(capsys: pytest.CaptureFixture) -> None:
    from matrix_owner_optim.toolbox.cli.main import main

    assert main(["plan", "-w", "4", "--layers", "2", "--width", "64", "--heads", "2", "--vocab", "128"]) == 0
    out = capsys.readouterr().out
    assert "routing (plan): matrix optimizer muon" in out and "adamw rows" in out

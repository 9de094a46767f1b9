"""The optimizer-step cost model: collective formulas, monotonicity, claims, CLI.

Everything runs in one process on meta tensors (one subprocess checks the registered
console command). The numbers are model predictions, so the tests check formulas and
orderings, never wall-clock behaviour of a real run.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import subprocess
import sys
from itertools import pairwise
from pathlib import Path

import pytest
import torch

from matrix_owner_optim.planning import MUON_COST, Role, TensorSpec, plan_tensors
from matrix_owner_optim.toolbox import simulate as S
from matrix_owner_optim.toolbox.cli import simulate as cli_simulate
from matrix_owner_optim.toolbox.models import GPT, GPTConfig

HW = S.PRESETS["paper"].hardware
SMALL = ["--layers", "2", "--width", "64", "--vocab", "128", "--seq-len", "16"]


# one xdist worker runs the whole module, so its module fixtures run once
pytestmark = pytest.mark.xdist_group("simulate")


@pytest.fixture(scope="module")
def paper_cache() -> S.StatsCache:
    model, prefixes = S.paper_model()
    return S.StatsCache(model, prefixes)


@pytest.fixture(scope="module")
def paper_rows(paper_cache: S.StatsCache) -> list[dict]:
    return S.simulate(
        paper_cache.model,
        unit_prefixes=paper_cache.unit_prefixes,
        node_counts=range(1, 9),
        gpus_per_node=8,
        hardware=HW,
        cache=paper_cache,
    )


def _tiny_gpt(layers: int) -> GPT:
    cfg = GPTConfig(vocab_size=128, seq_len=16, n_layers=layers, d_model=64, n_heads=4)
    return GPT(cfg, device="meta")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="matrix-owner-optim")
    sub = parser.add_subparsers(dest="command", required=True)
    cli_simulate.add_parser(sub)
    return parser


def _run_cli(argv: list[str]) -> str:
    args = _parser().parse_args(["simulate", *argv])
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert args.func(args) == 0
    return buf.getvalue()


def _one_matrix_stats(shape: tuple[int, int], nodes: int, gpus: int) -> S.PlanStats:
    spec = TensorSpec("w", shape, torch.float32, Role.MATRIX)
    plan = plan_tensors([spec], nodes * gpus)
    return S.plan_stats(plan, nodes, gpus)


# --- collective formulas -------------------------------------------------------------------


def test_ring_all_gather_closed_form_and_one_rank_is_free() -> None:
    n, p, beta, alpha = 3e9, 8, 2e11, 7e-6
    closed = (p - 1) * (alpha + n / (p * beta))
    assert S.ring_all_gather_time(n, p, beta, alpha) == pytest.approx(closed)
    assert S.ring_all_reduce_time(n, p, beta, alpha) == pytest.approx(2 * closed)
    assert S.ring_all_gather_time(n, 1, beta, alpha) == 0.0
    assert S.ring_all_reduce_time(n, 1, beta, alpha) == 0.0
    # bandwidth term approaches n/beta for large p; latency term is linear in p
    assert S.ring_all_gather_time(n, 1024, beta, 0.0) == pytest.approx(n / beta * 1023 / 1024)
    with pytest.raises(ValueError):
        S.ring_all_gather_time(n, 0, beta, alpha)


def test_hierarchical_all_gather_reduces_to_flat_rings() -> None:
    n = 1e9
    one_node = S.hierarchical_all_gather_time(n, 1, 8, HW)
    assert one_node == pytest.approx(S.ring_all_gather_time(n, 8, HW.beta_intra, HW.alpha_intra))
    one_gpu = S.hierarchical_all_gather_time(n, 8, 1, HW)
    assert one_gpu == pytest.approx(S.ring_all_gather_time(n, 8, HW.beta_inter, HW.alpha_inter))
    both = S.hierarchical_all_gather_time(n, 4, 8, HW)
    assert both == pytest.approx(
        3 * (HW.alpha_inter + n / (4 * HW.beta_inter)) + 7 * (HW.alpha_intra + n / (8 * HW.beta_intra))
    )
    assert S.hierarchical_all_gather_time(n, 1, 1, HW) == 0.0
    assert S.hierarchical_all_reduce_time(n, 4, 8, HW) == pytest.approx(2 * both)


def test_all_to_all_closed_form() -> None:
    assert S.all_to_all_time(4e8, 16, 1e11, 1e-5) == pytest.approx(15 * 1e-5 + 4e8 / 1e11)
    assert S.all_to_all_time(4e8, 1, 1e11, 1e-5) == 0.0


def test_owner_routing_moves_about_two_p_over_w_per_rank() -> None:
    stats = _one_matrix_stats((512, 512), 2, 4)  # W = 8, one matrix
    P = 512 * 512 * 4
    a2a = S.estimate_all_to_all(stats, HW)
    # the owner receives 7/8 of the matrix, then 0; a non-owner sends 1/8, receives 1/8 back
    assert a2a.comm_bytes_per_rank == pytest.approx(P * 7 / 8)
    owner = stats.matrices[0].owner
    assert stats.nvlink_recv[owner] == pytest.approx(512 * 512 * 3 / 8)
    assert sum(stats.nic_in) == pytest.approx(512 * 512 * 4 / 8)
    assert sum(stats.nic_out) == pytest.approx(512 * 512 * 4 / 8)
    # uniform load over many matrices: mean received = 2 P (W-1) / W^2
    st = S.StatsCache(_tiny_gpt(4), _tiny_gpt(4).unit_prefixes()).get(1, 4)
    W = st.world_size
    elems = sum(m.numel for m in st.matrices)
    total = elems * 4
    owned = st.rank_owned_matrix_elems
    received = [(owned[q] * (W - 1) / W + (elems - owned[q]) / W) * 4 for q in range(W)]
    assert sum(received) / W == pytest.approx(2 * total * (W - 1) / W**2)


def test_dtensor_variant_matches_the_traced_collectives() -> None:
    s, b = 5, 2
    # wide 64 x 256: per iteration all-gather X^T and X (k*l) and the k x k Gram, + norm all-reduce
    st = _one_matrix_stats((64, 256), 1, 8)
    k, l = 64, 256
    est = S.estimate_reconstruction_dtensor(st, HW)
    ag = lambda n: S.hierarchical_all_gather_time(n, 1, 8, HW)  # noqa: E731
    expected = S.hierarchical_all_reduce_time(0, 1, 8, HW) + s * (2 * ag(k * l * b) + ag(k * k * b))
    assert est.comm_s == pytest.approx(expected)
    assert est.collectives == 1 + 3 * s
    assert est.max_rank_flops == pytest.approx(MUON_COST.flops((64, 256)) / 8)
    # tall 256 x 64: two k x k all-reduces per iteration, the k^3 Gram square on every rank
    st = _one_matrix_stats((256, 64), 1, 8)
    est = S.estimate_reconstruction_dtensor(st, HW)
    ar = lambda n: S.hierarchical_all_reduce_time(n, 1, 8, HW)  # noqa: E731
    assert est.comm_s == pytest.approx(ar(0) + s * 2 * ar(k * k * b))
    assert est.collectives == 1 + 2 * s
    assert est.max_rank_flops == pytest.approx(s * (4 * k * k * l / 8 + 2 * k**3) + 8 * 64 * 256 / 8)


# --- monotonicity / sanity -----------------------------------------------------------------


def test_owner_layout_has_no_communication(paper_rows: list[dict]) -> None:
    for row in paper_rows:
        owner = row["strategies"]["owner"]
        assert owner["comm_ms"] == 0.0 and owner["comm_bytes_per_rank"] == 0.0
        assert owner["collectives_per_rank"] == 0
        assert owner["total_ms"] == pytest.approx(owner["compute_ms"] + owner["launch_ms"] + owner["elementwise_ms"])


def test_reconstruction_grows_with_nodes_owner_does_not(paper_rows: list[dict]) -> None:
    recon = [r["strategies"]["reconstruction"]["total_ms"] for r in paper_rows]
    owner = [r["strategies"]["owner"]["total_ms"] for r in paper_rows]
    assert all(b > a for a, b in pairwise(recon)), recon
    assert all(o <= owner[0] * (1 + 1e-9) for o in owner), owner
    assert owner[-1] < owner[0] / 4  # 8x more owners, imbalance below 2
    r1, r8 = paper_rows[0]["ratios"], paper_rows[-1]["ratios"]
    assert r8["reconstruction_over_owner"] > r1["reconstruction_over_owner"]
    assert r8["all_to_all_over_owner"] > r1["all_to_all_over_owner"]
    for row in paper_rows:  # owner is never slower than routing to the same owners
        s = row["strategies"]
        assert s["owner"]["total_ms"] <= s["all_to_all"]["total_ms"] <= s["reconstruction"]["total_ms"]


def test_flops_come_from_the_planner(paper_cache: S.StatsCache) -> None:
    st = paper_cache.get(8, 8)
    expected = sum(MUON_COST.flops((m.m, m.n)) for m in st.matrices)
    assert st.total_matrix_flops == pytest.approx(expected)
    assert sum(st.rank_matrix_flops) == pytest.approx(st.total_matrix_flops)
    assert st.flops_imbalance >= 1.0
    owner = S.estimate_owner(st, HW)
    assert owner.max_rank_flops <= st.planner_flops_max  # planner load also counts AdamW FLOPs
    assert owner.compute_s == pytest.approx(owner.max_rank_flops / HW.ns_flop_rate)


def test_single_rank_all_strategies_agree() -> None:
    model = _tiny_gpt(2)
    st = S.StatsCache(model, model.unit_prefixes()).get(1, 1)
    est = S.estimate_strategies(st, HW)
    totals = {k: v.total_s for k, v in est.items()}
    assert all(v.comm_s == 0.0 for v in est.values())
    assert max(totals.values()) == pytest.approx(min(totals.values()))


def test_memory_owner_is_zero3_like_and_zero1_is_not(paper_cache: S.StatsCache) -> None:
    st = paper_cache.get(8, 8)
    mem = S.estimate_memory(st)
    assert mem["owner"] >= max(st.rank_resident_bytes)
    assert mem["owner"] < 2 * mem["zero3_even_resident"]
    assert mem["reconstruction"] > mem["zero3_even_resident"]
    assert mem["reconstruction_gather_all"] > mem["reconstruction"]
    assert mem["zero1_owner"] > st.total_param_bytes + st.total_grad_bytes - 1
    assert mem["zero1_owner"] > 10 * mem["owner"]


def test_hardware_overrides_are_marked_and_validated() -> None:
    hw = HW.with_overrides(inter_bw_gbs=25.0, peak_tflops=None)
    assert hw.inter_bw_gbs.value == 25.0 and hw.inter_bw_gbs.source == "user override"
    assert hw.peak_tflops == HW.peak_tflops
    with pytest.raises(ValueError, match="positive"):
        HW.with_overrides(intra_bw_gbs=0.0)
    with pytest.raises(ValueError, match="unknown"):
        HW.with_overrides(warp_speed=1.0)
    for preset in S.PRESETS.values():
        for key in S.Hardware.FIELDS:
            c = getattr(preset.hardware, key)
            assert c.value > 0 and c.unit
            assert c.source in {"vendor spec", "typical measured", "assumption"}


# --- claims ----------------------------------------------------------------------------------


def test_comparison_is_computed_not_written(paper_cache: S.StatsCache) -> None:
    comp = S.compare_with_claims(paper_cache, HW)
    keys = [c["key"] for c in comp["claims"]]
    assert keys == ["paper_1_node", "paper_8_nodes", "seed_8xA100"]
    by_key = {c["key"]: c for c in comp["claims"]}
    for entry in comp["claims"]:
        for c in entry["comparisons"]:
            assert isinstance(c["agrees"], bool)
            assert (c["factor"] <= comp["agree_factor"]) == c["agrees"]
            assert f"{c['predicted']:.1f}x" in c["text"] or f"{c['predicted']:.0f} ms" in c["text"]
    seed = by_key["seed_8xA100"]
    owner = next(c for c in seed["comparisons"] if c["strategy"] == "owner")
    assert owner["implied_tflops"] == pytest.approx(
        S.estimate_owner(paper_cache.get(1, 8), HW).max_rank_flops / 0.175 / 1e12
    )
    # a different assumption changes the verdicts: starve the inter-node fabric
    slow = S.compare_with_claims(paper_cache, HW.with_overrides(inter_bw_gbs=1.0))
    fast_pred = by_key["paper_8_nodes"]["comparisons"][0]["predicted"]
    slow_pred = slow["claims"][1]["comparisons"][0]["predicted"]
    assert slow_pred > fast_pred
    assert slow["claims"][1]["comparisons"][0]["text"] != by_key["paper_8_nodes"]["comparisons"][0]["text"]
    # what-if solver: reaching the claim at the solved bandwidth
    dt = next(w for w in by_key["paper_8_nodes"]["what_if"] if w["baseline"] == "reconstruction_dtensor")
    if dt["reachable"]:
        st = paper_cache.get(8, 8)
        h = HW.scaled(inter_bw_gbs=dt["scale"])
        ratio = S.estimate_reconstruction_dtensor(st, h).total_s / S.estimate_owner(st, h).total_s
        assert ratio == pytest.approx(54.6, rel=1e-3)


# --- CLI ---------------------------------------------------------------------------------------


def test_cli_paper_json_and_plot(tmp_path: Path) -> None:
    png = tmp_path / "sim.png"
    report = json.loads(_run_cli(["--preset", "paper", "--json", "--plot", str(png)]))
    for key in (
        "schema",
        "preset",
        "config",
        "hardware",
        "formulas",
        "strategies",
        "sweep",
        "selected",
        "comparison",
        "plot",
    ):
        assert key in report, key
    assert report["schema"] == S.SCHEMA
    assert report["config"]["world_size"] == 64 and len(report["sweep"]) == 8
    for key in S.Hardware.FIELDS:
        c = report["hardware"]["constants"][key]
        assert {"value", "unit", "source", "note"} <= set(c)
    row = report["selected"]
    assert set(row["strategies"]) == set(S.STRATEGIES)
    assert {"reconstruction_over_owner", "all_to_all_over_owner"} <= set(row["ratios"])
    mem_keys = {"owner", "reconstruction", "all_to_all", "zero1_owner"}
    assert mem_keys <= set(row["memory_bytes_per_rank"])
    assert report["comparison"]["findings"]
    assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report["plot"] == str(png)


def test_cli_text_table_and_overrides() -> None:
    out = _run_cli(["--preset", "h100", "--nodes", "2", "--inter-bw", "50", "--no-compare", *SMALL])
    assert "recon/own" in out and "a2a/own" in out and "memory per rank" in out
    assert "user override" in out and "vendor spec" in out
    assert "comparison with published claims" not in out
    with pytest.raises(ValueError, match="ns-efficiency"):
        _run_cli(["--ns-efficiency", "1.5", "--no-compare", *SMALL])


def test_sweep_has_one_row_per_node_count() -> None:
    report = json.loads(_run_cli(["--nodes", "4", "--json", "--no-compare", *SMALL]))
    assert [r["nodes"] for r in report["sweep"]] == [1, 2, 3, 4]


def test_console_command_json() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "matrix_owner_optim.toolbox.cli.main", "simulate", "--preset", "paper", "--json"],
        capture_output=True,
        text=True,
        timeout=600,  # a hang guard only: importing torch can take minutes on a loaded machine
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["schema"] == S.SCHEMA
    ratios = [r["ratios"]["reconstruction_over_owner"] for r in report["sweep"]]
    assert ratios[-1] > ratios[0] and all(math.isfinite(x) for x in ratios)

"""OwnerDTensor's operator contract (issue 32), every OpInfo operator, at W=2 and W=3 on gloo.

For an operator called on owner-layout tensors, on every rank: the result (``full_tensor()`` of a
DTensor result, of the mutated input, of the ``out=`` tensors) equals the operator on the plain
full tensors in one process, or the call raises on every rank (the same exception type, a message
naming the operator). Never a wrong value, an error on some ranks only, nor a hang.

* OpInfo (tests/_opinfo_harness.py): every operator of ``op_db`` with float32 CPU samples, its
  first sample with a dense tensor, one layout of tests/_owner_layouts.py per operator (rotated
  over operators, W=2 and W=3 offset so they cover different ones), out of place, in place and
  ``out=`` where the OpInfo has them. The long form (every sample x every layout x variants) is
  marked ``opinfo_long`` and deselected by default; benchmarks/opinfo_coverage.py runs it and
  writes benchmarks/results/opinfo_coverage.json.
* The rest of the contract (tests/_owner_contract.py): Python-value reads are collectives that
  give every rank the holder's value; ``full_tensor()`` / ``redistribute(Replicate())`` are new
  storage, also on the holder; random in-place ops under one seed draw what one process draws;
  plain tensors are replicated full values; ``register_hook`` on a non-leaf fires with the right
  gradient; c10d collectives given an owner-layout tensor do what stock DTensor does (torch 2.13
  refuses them: ``NotImplementedError`` for ``all_reduce`` / ``broadcast``, ``RuntimeError`` for
  mixed plain and DTensor arguments), on every rank.

A hang is a process-group timeout (``PG_TIMEOUT_S``): the OpInfo run records the trial in
flight as ABORTED and resumes at the next operator, twice at most.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from _opinfo_harness import PG_TIMEOUT_S, Summary, run_world
from _owner_contract import ASSIGNMENTS, assignment_job, collectives_job, reads_job
from _ranks import spawn_ranks

pytestmark = pytest.mark.multirank

WORLDS = [pytest.param(W, marks=pytest.mark.xdist_group(f"owner_opinfo_w{W}"), id=f"W{W}") for W in (2, 3)]
MAX_ABORTS = 2  # hangs resumed past in the default run before the rest is reported as not run
SHOW = 40  # violations listed in a failure message


def _report(summary: Summary) -> str:
    other = summary.other()
    lines = [f"W={summary.W}: {summary.counts()}, {len(other)} violations"]
    for key, t in sorted(other.items())[:SHOW]:
        lines.append(f"  {t['verdict']:<22} {key}: {t['detail'][:240]}")
    if len(other) > SHOW:
        lines.append(f"  ... {len(other) - SHOW} more")
    return "\n".join(lines)


@pytest.fixture(scope="module", params=WORLDS)
def opinfo(request: Any) -> Summary:
    summary = run_world(request.param, "default", max_aborts=MAX_ABORTS)
    print(_report(summary))
    print(f"W={summary.W} refused operators: {summary.refused_operators()}")
    print(f"W={summary.W} per layout/variant: {summary.grid()}")
    return summary


def test_every_operator_is_tried(opinfo: Summary) -> None:
    """Every OpInfo operator with float32 samples has a verdict (factory functions whose samples
    hold no tensor to lay out are n/a, with the reason)."""
    assert len(opinfo.operator_names) > 600, len(opinfo.operator_names)
    tried = {t["name"] for t in opinfo.trials.values()}
    missing = [n for n in opinfo.operator_names if n not in tried]
    assert not missing, f"{len(missing)} operators never tried: {missing[:20]}"
    compared = opinfo.covered_operators()
    na = sorted(set(opinfo.operator_names) - compared)
    # an operator all of whose trials are n/a: no dense tensor argument, or CPU-less (jiterator)
    reasons = {t["detail"] for t in opinfo.trials.values() if t["name"] in na and t["verdict"] == "n/a"}
    assert len(na) < 50 and all(r.startswith(("no sample", "plain raises", "samples raise")) for r in reasons), (
        na,
        reasons,
    )


def test_operators_exact_or_refused_on_every_rank(opinfo: Summary) -> None:
    """No operator is silently wrong, raises on some ranks only, differs across ranks, hangs, or
    raises with a message that does not name it (a refusal is one exception type on every rank
    whose message names the aten/c10d operator or the OpInfo's name). No operator is exempt."""
    assert not opinfo.other(), _report(opinfo)


# -- the rest of the contract ---------------------------------------------------------------------------
@pytest.fixture(scope="module", params=WORLDS)
def contract(request: Any) -> tuple[int, dict[str, Any]]:
    W = request.param
    res = spawn_ranks(reads_job, W, timeout_s=PG_TIMEOUT_S, strict_shutdown=True)
    return W, res[0]  # every rank's outcomes were gathered: rank 0 has them all


def _bad(section: dict[str, list[tuple]], ok: Any) -> dict[str, list[tuple]]:
    """The checks whose outcome on some rank is not ``ok(value)`` (or raised)."""
    return {k: v for k, v in section.items() if not all(o[0] == "ok" and ok(o[1]) for o in v)}


def _same_value(pair: tuple) -> bool:
    got, want = pair
    if isinstance(got, float) and isinstance(want, float):
        return got == want or (math.isnan(got) and math.isnan(want))
    return bool(got == want)


def test_value_reads_are_collective_and_agree(contract: tuple[int, dict[str, Any]]) -> None:
    """``item()``, ``bool()``, ``float()``, ``tolist()``, ``torch.equal`` of held, row-split and
    replicated tensors and held 0-dim values: every rank gets the one-process value."""
    W, res = contract
    bad = _bad(res["reads"], _same_value)
    assert not bad, f"W={W}: {bad}"


def test_full_tensor_and_redistribute_are_new_storage(contract: tuple[int, dict[str, Any]]) -> None:
    W, res = contract
    bad = _bad(res["copies"], lambda v: all(v.values()))
    assert not bad, f"W={W}: {bad}"


def test_random_inplace_ops_draw_what_one_process_draws(contract: tuple[int, dict[str, Any]]) -> None:
    """Under one seed on every rank, a tensor in every layout (held by rank 0, by the last rank,
    row blocks, split ranges, replicated), drawn in order: bitwise the one-process values."""
    W, res = contract
    bad = _bad(res["random"], lambda layouts: layouts == [])
    assert not bad, f"W={W}: layouts not bitwise the one-process draw: {bad}"


def test_plain_tensors_are_replicated_full_values(contract: tuple[int, dict[str, Any]]) -> None:
    W, res = contract
    bad = _bad(res["plain"], lambda v: v[0])
    assert not bad, f"W={W}: {bad}"


def _same_floats(got: list, want: list) -> bool:
    """Nested lists of floats equal, NaN where NaN."""
    if isinstance(got, list):
        return len(got) == len(want) and all(_same_floats(g, w) for g, w in zip(got, want, strict=True))
    return got == want or (math.isnan(got) and math.isnan(want))


def test_holder_agreement_and_row_block_reductions(contract: tuple[int, dict[str, Any]]) -> None:
    """An operator whose meta kernel disagrees with its CPU kernel on a held input is exact on
    every rank; a holder's error on its values is raised on every rank; max-type reductions of
    row blocks keep a NaN; a gathered product of a transposed matrix rounds as the plain one
    (see ``_owner_contract._holder_agreement``)."""
    W, res = contract
    for name, outcomes in res["agreement"].items():
        if "out of range" in name:  # the holder's error type, on every rank
            assert all(o[0] == "raised" for o in outcomes), (W, name, outcomes)
            assert len({o[1] for o in outcomes}) == 1, (W, name, outcomes)
        elif name.startswith("addmm"):  # bitwise the plain product on every rank
            assert all(o == ("ok", True) for o in outcomes), (W, name, outcomes)
        elif name.startswith("native_batch_norm"):
            assert all(o[0] == "ok" and o[1][0][0] == o[1][0][1] and o[1][1] for o in outcomes), (W, name, outcomes)
        else:
            assert all(o[0] == "ok" and _same_floats(*o[1]) for o in outcomes), (W, name, outcomes)


def test_register_hook_on_a_non_leaf_fires_with_the_gradient(contract: tuple[int, dict[str, Any]]) -> None:
    W, res = contract
    bad = _bad(res["hooks"], lambda v: all(v.values()))
    assert not bad, f"W={W}: {bad}"


@pytest.fixture(scope="module", params=WORLDS)
def collectives(request: Any) -> tuple[int, dict[str, Any]]:
    W = request.param
    res = spawn_ranks(collectives_job, W, timeout_s=PG_TIMEOUT_S)
    return W, res[0]


def test_c10d_collectives_do_what_stock_dtensor_does(collectives: tuple[int, dict[str, Any]]) -> None:
    """``dist.all_reduce(t)`` and the other c10d collectives given an owner-layout tensor: refused
    on every rank with the exception type stock DTensor raises for the same call, or run on every
    rank on the local piece (the same as the collective on a plain copy of it)."""
    W, res = collectives
    bad = {}
    for key, r in res.items():
        stock, owner = r["stock"], r["owner"]
        stock_types = {o[1] for o in stock if o[0] == "raised"}
        refused_as_stock = (
            len(stock_types) == 1
            and all(o[0] == "raised" for o in stock)
            and all(o[0] == "raised" and o[1] in stock_types for o in owner)
        )
        ran_locally = all(o[0] == "ok" and o[1] == [1.0] for o in owner)
        if not (refused_as_stock or ran_locally):
            bad[key] = {f"stock {r['stock_placement']}": stock, "owner": owner}
    assert not bad, f"W={W}: {bad}"


@pytest.mark.opinfo_long
@pytest.mark.parametrize("W", [2, 3])
def test_opinfo_long_form(W: int) -> None:
    """Every sample x every applicable layout x every variant (minutes; see the module doc)."""
    summary = run_world(W, "long")
    print(_report(summary))
    assert not summary.other(), _report(summary)


# -- whole-parameter assignment (issue 40) -----------------------------------------------------------
@pytest.mark.parametrize("W", [2, 3])
def test_whole_parameter_assignment_right_or_refused_on_every_rank(W: int) -> None:
    """``vector_to_parameters``, ``p.data = t`` (same layout, plain, another dtype) and
    ``p.copy_(full)`` after ``parameters_to_vector`` leave every parameter equal to the unsharded
    model's on every rank (bitwise: the same values, moved), and the sharded forward reads them;
    ``p.set_`` and ``p.data =`` of another shape are refused on every rank, naming what."""
    res = spawn_ranks(assignment_job, W, timeout_s=120, strict_shutdown=True)
    got = res[0]
    for name in ASSIGNMENTS:
        assert got[name] == [("ok", 0.0)] * W, (name, got[name])
    forward = got["forward after vector_to_parameters"]
    assert all(o[0] == "ok" and o[1][0] == o[1][1] for o in forward), forward
    set_ = got["p.set_(t)"]
    assert all(o[0] == "raised" and o[1] == "NotImplementedError" and "set_" in o[2] for o in set_), set_
    shape = got["p.data = another shape"]
    assert all(o[0] == "raised" and o[1] == "RuntimeError" and "t.data = value" in o[2] for o in shape), shape

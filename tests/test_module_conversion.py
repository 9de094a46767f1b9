"""``nn.Module`` conversions of a sharded model: ``copy.deepcopy`` and ``.to(dtype)``.

One gloo job per world size (2, 3), against stock ``torch.distributed.fsdp.fully_shard`` on the
same model and one process:

* ``copy.deepcopy`` of a sharded model, of one of its blocks and of a module holding it is
  refused on every rank, before and after the plan, with an error that says to use the state dict
  (stock FSDP2 refuses too: "FSDP does not support deepcopy. Please use state dict for
  serialization.").
* ``model.to(torch.float64)`` with ``torch.__future__.set_swap_module_params_on_conversion``
  on and off (the flag restored after), before and after the plan, while the script still holds
  parameters it listed before ``fully_shard`` (a no-weight-decay list: the case that failed with
  "Couldn't swap OwnerShardedLinear.bias" where stock passes): every parameter object is kept,
  every parameter is float64, and the model then trains equal to one process in float64.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from _ranks import spawn_ranks
from _ref import CFG, fully_shard_model, local_batch, max_param_rel_err_native, train_adamw_beside
from _tolerances import FLOAT64_PARAM_RTOL as RTOL64
from matrix_owner_optim.toolbox.models.gpt import GPT

pytestmark = pytest.mark.multirank

STEPS = 2


def _deepcopy_refusal(obj: nn.Module) -> tuple[str, str] | None:
    """(exception type, message) of ``copy.deepcopy(obj)``; None if it copied."""
    try:
        copy.deepcopy(obj)
    except Exception as exc:  # the refusal's type is part of what is compared
        return type(exc).__name__, str(exc)
    return None


def _deepcopies() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for stock in (False, True):
        model = GPT(CFG)
        fully_shard_model(model, stock=stock)
        holder = nn.ModuleDict({"model": model})
        kind = "stock" if stock else "ours"
        out[f"{kind}/pending"] = [_deepcopy_refusal(m) for m in (model, model.layers[0], holder)]
        model(*local_batch(0, 0, 1))  # the first forward fixes the plan (lazy init, both)
        out[f"{kind}/planned"] = [_deepcopy_refusal(m) for m in (model, model.layers[0], holder)]
    return out


def _to_float64(model: nn.Module, swap: bool) -> None:
    prev = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(swap)
    try:
        model.to(torch.float64)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(prev)


def _converted(rank: int, W: int, swap: bool, planned: bool, stock: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = GPT(CFG)
    ref = copy.deepcopy(model)
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]  # held across fully_shard
    fully_shard_model(model, stock=stock)
    if planned:
        model(*local_batch(0, rank, W))  # lazy init, as FSDP2's; no backward
    before = list(model.parameters())
    _to_float64(model, swap)
    out: dict[str, Any] = {
        "kept": all(a is b for a, b in zip(before, model.parameters(), strict=True)),
        "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "flag_restored": torch.__future__.get_swap_module_params_on_conversion() is False,
    }
    ref.to(torch.float64)
    train_adamw_beside(model, ref, STEPS, rank, W)
    out["err"] = max_param_rel_err_native(model, ref, floor=1e-300, gather=True)
    del no_decay
    return out


def _reshaping_refused() -> str:
    """``nn.Module._apply`` with a function that changes a tensor's shape (no owner-layout
    meaning): the error it raises after the plan."""
    model = GPT(CFG)
    fully_shard_model(model)
    model.fix_plan()
    try:
        model._apply(lambda t: t.t() if t.dim() == 2 else t)
    except ValueError as exc:
        return str(exc)
    return "converted"


def _job(rank: int, W: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {"deepcopy": _deepcopies(), "reshaping": _reshaping_refused()}
    for swap in (True, False):
        for planned in (False, True):
            out[f"ours/swap={swap}/planned={planned}"] = _converted(rank, W, swap, planned, stock=False)
    out["stock/swap=True/planned=False"] = _converted(rank, W, True, False, stock=True)
    return out


# one xdist worker per world size runs its tests, so the module fixture spawns once per W and run
@pytest.fixture(
    scope="module", params=[pytest.param(W, marks=pytest.mark.xdist_group(f"module_conversion_w{W}")) for W in (2, 3)]
)
def results(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return spawn_ranks(_job, request.param)


def test_deepcopy_refused_on_every_rank_as_stock(results: list[dict[str, Any]]) -> None:
    for r in results:
        d = r["deepcopy"]
        for when in ("pending", "planned"):
            stock = d[f"stock/{when}"]
            assert all(s is not None and "deepcopy" in s[1] for s in stock), stock  # stock refuses
            for refusal in d[f"ours/{when}"]:
                assert refusal is not None, d
                kind, msg = refusal
                assert kind == "RuntimeError" and "deepcopy" in msg and "state dict" in msg, refusal
                assert "get_model_state_dict" in msg and "before calling fully_shard" in msg, msg


def test_to_float64_keeps_objects_and_trains_as_one_process(results: list[dict[str, Any]]) -> None:
    for r in results:
        for key, c in r.items():
            if key in ("deepcopy", "reshaping"):
                continue
            assert c["kept"] and c["dtypes"] == ["torch.float64"] and c["flag_restored"], (key, c)
            assert c["err"] <= RTOL64, (key, c["err"])


def test_shape_changing_function_refused_naming_the_parameter(results: list[dict[str, Any]]) -> None:
    for r in results:
        msg = r["reshaping"]
        assert "parameter '" in msg and "shape-preserving" in msg and "before fully_shard" in msg, msg

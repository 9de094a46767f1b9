"""PEFT 0.21 LoRA on the owner layout, W=2, against the same PEFT model in one process.

A tiny transformers Llama gets LoRA adapters (``q_proj``, ``v_proj``, rank 4) with
``get_peft_model``; then ``fully_shard`` on each decoder layer and the root, and
``OwnerRoutedOptimizer`` over the PEFT model. What is checked on every rank:

* routing: the A/B matrices are stepped by Muon (``matrix``), the frozen base is in no route
  (``routes()`` lists what is stepped);
* 3 steps equal one process (adapters, losses) and the frozen base is bitwise unchanged;
* ``merge_and_unload()`` on the sharded model gives the one-process merged weights, and
  ``save_pretrained`` of the merged model through the full state dict (rank 0 writes) reloads
  with ``from_pretrained`` as those weights.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from _clients import OPTIM, build_hf, full_params, global_tokens, hf_loss, local_tokens
from _ranks import spawn_ranks
from _ref import fully_shard_model
from _tolerances import CLIENT_ATOL
from matrix_owner_optim import OwnerRoutedOptimizer

pytestmark = pytest.mark.multirank

W = 2
STEPS = 3


def _lora_model() -> Any:
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    torch.manual_seed(0)
    model = get_peft_model(build_hf("llama"), cfg)
    torch.manual_seed(1)  # B starts at zero (PEFT's init): make the adapters move from step 0
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.02)
    return model


def _train(model: Any, opt: torch.optim.Optimizer, tokens: Any) -> list[float]:
    losses = []
    for s in range(STEPS):
        loss = hf_loss(model, tokens(s))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def _reference() -> dict[str, Any]:
    model = _lora_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    losses = _train(model, OwnerRoutedOptimizer(model, **copy.deepcopy(OPTIM)), global_tokens)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    merged = model.merge_and_unload()
    return {
        "losses": losses,
        "params": params,
        "frozen_before": before,
        "merged": {n: p.detach().clone() for n, p in merged.named_parameters()},
    }


def _job(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    # --8<-- [start:peft]
    model = _lora_model()
    fully_shard_model(model, blocks=model.base_model.model.model.layers)
    opt = OwnerRoutedOptimizer(model, **copy.deepcopy(OPTIM))
    # --8<-- [end:peft]
    routes = {r["name"]: r["role"] for r in opt.routes()}
    losses = _train(model, opt, lambda s: local_tokens(s, rank, world))
    mean = torch.tensor(losses, dtype=torch.float64)
    torch.distributed.all_reduce(mean)
    params = full_params(model)
    merged = model.merge_and_unload()
    save_pretrained(merged, out_dir, rank)
    return {
        "routes": routes,
        "losses": (mean / world).tolist(),
        "params": params,
        "merged": full_params(merged),
    }


def save_pretrained(model: Any, out_dir: str, rank: int) -> None:
    """transformers' ``save_pretrained`` through the full state dict (the README's route): every
    rank gathers, rank 0 writes. Called on the sharded model directly, its shared-tensor check
    would see the non-owners' empty pieces as one storage."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # --8<-- [start:save_pretrained]
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        model.save_pretrained(out_dir, state_dict=sd)
    # --8<-- [end:save_pretrained]
    torch.distributed.barrier()


def test_peft_lora_on_the_owner_layout(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    ref = _reference()
    results = spawn_ranks(_job, W, str(tmp_path))
    saved = {n: p.detach() for n, p in AutoModelForCausalLM.from_pretrained(tmp_path).named_parameters()}
    assert saved.keys() == ref["merged"].keys()
    saved_err = max(float((saved[n] - p).abs().max()) for n, p in ref["merged"].items())
    assert saved_err <= CLIENT_ATOL, saved_err
    for r in results:
        lora = {n for n in r["params"] if "lora_" in n}
        assert lora and {r["routes"][n] for n in lora} == {"matrix"}, r["routes"]
        assert set(r["routes"]) == lora  # the frozen base is stepped by nothing, so not routed
        for n, p in ref["frozen_before"].items():
            assert torch.equal(r["params"][n], p), f"frozen {n} moved"
        loss_err = max(abs(a - b) for a, b in zip(r["losses"], ref["losses"], strict=True))
        param_err = max(float((r["params"][n] - p).abs().max()) for n, p in ref["params"].items())
        merged_err = max(float((r["merged"][n] - p).abs().max()) for n, p in ref["merged"].items())
        moved = max(float((ref["params"][n] - p).abs().max()) for n, p in _lora_model().named_parameters() if n in lora)
        print(
            f"peft W=2: loss {loss_err:.2g}, params {param_err:.2g}, merged {merged_err:.2g}, "
            f"saved {saved_err:.2g} (adapters moved {moved:.2g})"
        )
        assert r["merged"].keys() == ref["merged"].keys()
        assert loss_err <= CLIENT_ATOL and param_err <= CLIENT_ATOL and merged_err <= CLIENT_ATOL

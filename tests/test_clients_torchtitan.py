"""torchtitan's optimizer container and its FQN-keyed optimizer checkpoint with OwnerRoutedOptimizer.

torchtitan builds optimizers from groups ``{"params": [...], "param_names": [...], "fused": ...,
"foreach": ...}`` (``OptimizersContainer._build_param_groups``) and checkpoints them through a
flat, FQN-keyed state dict (``state.{fqn}.{key}``, ``param_groups.{fqn}.{key}``) that needs
``param_names`` in every saved param group. Here a container whose factory ``"OwnerRouted"``
builds OwnerRoutedOptimizer trains a tiny Llama on the owner layout for 2 steps at W=2 and saves
model and container with DCP; a W=3 job loads both and trains 2 more steps; its parameters equal
4 steps in one process (so the Muon momenta and Adam moments came back, resharded 2 -> 3).
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import pytest
import torch

from _clients import OPTIM, build_hf, full_params, local_tokens, max_abs_diff, reference_params, train
from _ranks import spawn_ranks
from _ref import fully_shard_model
from _tolerances import CLIENT_ATOL as TOL
from matrix_owner_optim import OwnerRoutedOptimizer


def container(model: torch.nn.Module) -> Any:
    """torchtitan's OptimizersContainer with one more optimizer name, as a torchtitan user adds one."""
    from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig

    # --8<-- [start:container]
    class OwnerRoutedContainer(OptimizersContainer):
        @staticmethod
        def _resolve_optimizer_factory(name: str) -> Any:
            if name == "OwnerRouted":
                return functools.partial(OwnerRoutedOptimizer, **copy.deepcopy(OPTIM))
            return OptimizersContainer._resolve_optimizer_factory(name)

    cfg = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=r".*", optimizer_name="OwnerRouted")], implementation="for-loop"
    )
    return OwnerRoutedContainer(cfg, model_parts=[model])
    # --8<-- [end:container]


def titan_job(rank: int, W: int, ckpt: str, phase: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    model = build_hf("llama")
    fully_shard_model(model, blocks=model.model.layers)
    opts = container(model)
    batch = functools.partial(local_tokens, rank=rank, world_size=W)
    out: dict[str, Any] = {"param_names": [g.get("param_names") for g in opts.optimizers[0].param_groups]}
    if phase == "save":
        train(model, opts, batch, steps=2)
        flat = opts.state_dict()
        out["flat_keys"] = sorted(k for k in flat if k.startswith("param_groups."))[:3]
        dcp.save({"model": get_model_state_dict(model), "optimizer": opts}, checkpoint_id=ckpt)
    else:
        state = {"model": get_model_state_dict(model), "optimizer": opts}
        dcp.load(state, checkpoint_id=ckpt)
        set_model_state_dict(model, state["model"])
        train(model, opts, batch, steps=2, start=2)
    out["params"] = full_params(model)
    return out


@pytest.mark.multirank
def test_fqn_keyed_optimizer_checkpoint_saves_at_two_and_loads_at_three(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    saved = spawn_ranks(titan_job, 2, ckpt, "save", threads_per_rank=1)
    names = saved[0]["param_names"]
    assert all(isinstance(n, list) and n for n in names), names  # torchtitan's names kept per group
    # FQN-keyed: the first param-group key is that of the model's lm_head (sorted)
    assert saved[0]["flat_keys"][0].startswith("param_groups.lm_head.weight."), saved[0]["flat_keys"]
    loaded = spawn_ranks(titan_job, 3, ckpt, "load", threads_per_rank=1)
    ref = reference_params("llama", steps=4)
    for rank, r in enumerate(loaded):
        worst, name = max_abs_diff(r["params"], ref)
        print(f"torchtitan W=2 -> W=3 rank {rank}: max |diff| {worst:.2e} ({name})")
        assert worst <= TOL, f"rank {rank}: {name} differs by {worst:.2e} after resuming at W=3"

"""Accelerate on CPU with OwnerRoutedOptimizer, against one process (one spawned job, W=2).

* Its DDP path: ``accelerator.prepare(model, optimizer)`` wraps the model in DDP and the
  optimizer in ``AcceleratedOptimizer`` (calling ``state_dict()`` before any step while doing
  so); 3 steps with ``accelerator.backward`` equal the one-process run over the global batch.
* The owner layout under it: the model sharded by ``matrix_owner_optim.fully_shard`` (not given
  to ``prepare``, which would wrap it in DDP), the optimizer prepared: the same parameters.
"""

from __future__ import annotations

import copy
import functools
import os
from typing import Any

import pytest

from _clients import OPTIM, build_hf, changed, full_params, hf_loss, local_tokens, max_abs_diff, reference_params
from _ranks import spawn_ranks
from _tolerances import CLIENT_ATOL as TOL
from matrix_owner_optim import OwnerRoutedOptimizer, fully_shard


def _launcher_env(rank: int, W: int) -> None:
    """What ``accelerate launch`` / torchrun set for each process (the process group exists)."""
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(W), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(W), OMP_NUM_THREADS="1"
    )


def accelerate_job(rank: int, W: int) -> dict[str, Any]:
    _launcher_env(rank, W)
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    out: dict[str, Any] = {"distributed_type": str(accelerator.distributed_type)}
    batch = functools.partial(local_tokens, rank=rank, world_size=W)

    model = build_hf("llama")
    model, opt = accelerator.prepare(model, OwnerRoutedOptimizer(model, **copy.deepcopy(OPTIM)))
    out["ddp_wrapped"] = type(model).__name__
    for step in range(3):
        accelerator.backward(hf_loss(model, batch(step)))
        opt.step()
        opt.zero_grad()
    out["ddp"] = {n: p.detach().clone() for n, p in accelerator.unwrap_model(model).named_parameters()}

    model = build_hf("llama")
    # --8<-- [start:owner]
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = accelerator.prepare(OwnerRoutedOptimizer(model, **copy.deepcopy(OPTIM)))
    # --8<-- [end:owner]
    for step in range(3):
        accelerator.backward(hf_loss(model, batch(step)))
        opt.step()
        opt.zero_grad()
    out["owner"] = full_params(model)
    return out


@pytest.mark.multirank
def test_accelerate_prepare_on_cpu_ddp_and_owner_layout_match_one_process() -> None:
    res = spawn_ranks(accelerate_job, 2, threads_per_rank=1)
    ref = reference_params("llama")
    init = {n: p.detach() for n, p in build_hf("llama").named_parameters()}
    for rank, r in enumerate(res):
        assert r["distributed_type"].endswith("MULTI_CPU") and r["ddp_wrapped"] == "DistributedDataParallel", r
        for path in ("ddp", "owner"):
            assert changed(init, r[path]) == list(init), f"{path}: some parameters were not trained"
            worst, name = max_abs_diff(r[path], ref)
            print(f"Accelerate {path} rank {rank}: max |diff| {worst:.2e} ({name})")
            assert worst <= TOL, f"Accelerate {path} rank {rank}: {name} differs by {worst:.2e}"

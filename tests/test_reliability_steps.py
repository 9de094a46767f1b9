"""Ranks at different steps fail by name in the steps' own collectives (gloo on loopback).

A collective one rank can enter alone (an extra ``step()``) carries the step count, so a rank
that meets another rank's collective at another step raises ``RuntimeError`` on every rank,
naming both numbers, instead of pairing two steps' data or waiting for the process group's
timeout (60 s here, so a hang shows as a failure of the 10 s bound):

* HSDP's replica broadcasts (``replica_sync.issue_broadcast``): each broadcast carries its
  sender's step count (8 bytes); with ``replica_broadcast="forward"`` a rank that stepped twice
  meets the others' broadcasts at the next forward.
* Tensor-parallel assembly (``optim/dtensor_layout.py``, ``optim/owner_tp_layout.py``): the
  all-gathered header carries every TP owner's step count (4 header values). No training
  sequence makes two assemblies meet at different steps (on the owner layout a rank's extra
  step meets the others' forward in the step check first: tests/test_step_agreement.py), so the
  header check is tested on the header the layouts send, all-gathered and checked by the same
  calls; the layouts' own path runs in tests/test_tensor_parallel*.py.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from _ranks import attempt, spawn_ranks
from _ref import fully_shard_model
from matrix_owner_optim import OwnerRoutedOptimizer
from matrix_owner_optim.toolbox.models.gpt import GPT
from test_reliability import AGREE_TIMEOUT_S, CFG, OPTS, _batch, assert_steps_named

pytestmark = pytest.mark.multirank


def _hsdp_skew_job(rank: int, W: int, placement: str) -> dict:
    """A (W, 1) HSDP mesh: every rank is a replica. Rank W-1 calls ``step()`` twice after the
    first backward; the next forward's broadcasts meet at different step counts."""
    warnings.filterwarnings("ignore")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (W, 1), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = fully_shard_model(GPT(CFG), mesh=mesh)
    opt = OwnerRoutedOptimizer(model, replica_broadcast=placement, **OPTS)
    model(*_batch(0, rank, W)).backward()
    opt.step()
    opt.zero_grad()
    model(*_batch(1, rank, W)).backward()
    opt.step()  # step 2 everywhere
    if rank == W - 1:
        opt.step()  # step 3 here only
    opt.zero_grad()
    return attempt(lambda: model(*_batch(2, rank, W)).backward())


@pytest.mark.parametrize("W", [2, 3])
def test_hsdp_ranks_at_different_steps_fail_by_name(W: int) -> None:
    results = spawn_ranks(_hsdp_skew_job, W, "forward", timeout_s=AGREE_TIMEOUT_S)
    assert_steps_named(results, r"HSDP replica broadcast: the ranks of the replicate group \(senders \[[0-9, ]+\]\)", 2)


def _header_skew_job(rank: int, W: int) -> dict:
    """The TP assemblies' step check as the layouts run it: each rank appends its step count's
    digits to a bfloat16 header, the headers are all-gathered over the group, and every rank
    checks them (rank W-1 one step ahead; counts past 255, so every digit is exercised)."""
    from matrix_owner_optim import comm
    from matrix_owner_optim.agreement import check_header_steps, step_digits

    out = {}
    for case, step in (("agree", 70_000), ("skew", 70_000 + (rank == W - 1))):
        header = torch.tensor([1.0, 0.0, *step_digits(step)], dtype=torch.bfloat16)
        rows = torch.empty(W * header.numel(), dtype=torch.bfloat16)
        comm.all_gather_into_tensor(rows, header, name="owner_grad_tp_all_gather")
        out[case] = attempt(
            lambda step=step, rows=rows: check_header_steps(
                step, rows.view(W, -1).tolist(), who="TP gradient assembly", among="the TP group"
            )
        )
    return out


def test_tp_assembly_headers_at_different_steps_fail_by_name() -> None:
    W = 3
    results = spawn_ranks(_header_skew_job, W, timeout_s=AGREE_TIMEOUT_S)
    assert all(seen["agree"]["error"] is None for seen in results), results
    assert_steps_named([seen["skew"] for seen in results], "TP gradient assembly: the ranks of the TP group", 70_000)

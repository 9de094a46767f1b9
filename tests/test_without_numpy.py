"""The library as ``pip install .`` leaves it: torch without numpy.

numpy is not a dependency of torch or of this package, and torch's own ``all_gather_object`` /
``gather_object`` need it (``tensor.numpy()``). A script run with numpy made unimportable
(two gloo ranks, spawned) exercises every object exchange the library makes: the plan
agreement of ``fully_shard`` (agreeing, and disagreeing ranks named in the error), three
owner-layout Muon steps, and DDP's ``consolidate_state_dict`` to one rank and to all.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from matrix_owner_optim.toolbox.launch import free_port

pytestmark = pytest.mark.multirank

SCRIPT = r"""
import sys
sys.modules["numpy"] = None  # unimportable, as in an environment where nothing installed it
import json, os
import torch, torch.distributed as dist, torch.multiprocessing as mp
from torch import nn


def run(rank, W, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=W)
    from matrix_owner_optim import OwnerRoutedOptimizer
    from matrix_owner_optim.sharding import fully_shard
    res = {"numpy_usable": True}
    try:
        torch.zeros(1).numpy()
    except RuntimeError:
        res["numpy_usable"] = False
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    fully_shard(model)
    opt = OwnerRoutedOptimizer(model, matrix="muon")
    for _ in range(3):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    res["owner_steps"] = 3
    # ranks that disagree: rank 1 builds a wider model
    other = nn.Sequential(nn.Linear(8, 16 + rank), nn.ReLU(), nn.Linear(16 + rank, 4))
    fully_shard(other)
    try:
        other(torch.randn(4, 8))
        res["disagreement"] = None
    except ValueError as e:
        res["disagreement"] = str(e)
    # DDP with owners: the whole optimizer state on rank 0, then on every rank
    from torch.nn.parallel import DistributedDataParallel as DDP
    ddp = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    dopt = OwnerRoutedOptimizer(ddp.module, matrix="muon")
    ddp(torch.randn(4, 8)).pow(2).mean().backward()
    dopt.step()
    dopt.consolidate_state_dict(to=0)
    res["to0_states"] = sum(1 for s in dopt.state_dict()["state"].values() if s) if rank == 0 else None
    dopt.consolidate_state_dict(to=None)
    res["all_states"] = sum(1 for s in dopt.state_dict()["state"].values() if s)
    res["numpy_imported"] = sys.modules.get("numpy") is not None
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=(2, int(sys.argv[1]), sys.argv[2]), nprocs=2)
"""


def test_library_runs_without_numpy(tmp_path: Path) -> None:
    script = tmp_path / "no_numpy.py"
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), str(free_port()), str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in range(2):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert res["numpy_usable"] is False and res["numpy_imported"] is False
        assert res["owner_steps"] == 3
        assert res["disagreement"] is not None and "0.weight" in res["disagreement"], res
        assert res["all_states"] == 4  # two Linear layers: weights (Muon) and biases (AdamW)
    assert json.loads((tmp_path / "rank0.json").read_text())["to0_states"] == 4

"""torchtune 0.6.1's distributed recipe flow on the owner layout at W=2, against one process.

torchtune needs torchao 0.14.x, which PEFT 0.21 (in the test extra) refuses at import, so the
flow runs in its own venv (tests/_torchtune_env.py: ``--system-site-packages`` plus the two pins,
created by ``.ci/run`` or here if missing). tests/_torchtune_recipe.py runs meta init,
torchtune's ``shard_model`` and ``load_from_full_model_state_dict`` (``load_state_dict(assign=True)``
of DTensors: adopted into the plan), 2 steps of ``OwnerRoutedOptimizer``, torchtune's full model
and optimizer state dicts, a resumed model and optimizer loaded from them
(``load_from_full_optimizer_state_dict``), and a 3rd step; this test checks its measurements:
losses and final parameters equal 3 straight steps in one process (the clients' absolute
tolerance), and the saved ``step`` entries are plain tensors, as torch keeps them.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from _tolerances import CLIENT_ATOL
from _torchtune_env import ensure

pytestmark = pytest.mark.multirank  # the recipe script spawns its ranks (spawn_ranks)

RECIPE = Path(__file__).resolve().parent / "_torchtune_recipe.py"


def test_torchtune_recipe_flow() -> None:
    python = ensure()
    done = subprocess.run([str(python), str(RECIPE)], capture_output=True, text=True, timeout=600, env=dict(os.environ))
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    assert done.returncode == 0 and lines, f"the recipe failed:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
    out = json.loads(lines[-1].removeprefix("RESULT "))
    assert out["moved"] > 100 * CLIENT_ATOL  # training moved the weights well past the tolerance
    for rank, r in enumerate(out["ranks"]):
        print(f"torchtune W=2 rank {rank}: loss {r['loss_err']:.2g}, params {r['param_err']}")
        assert r["sharded"] == ["OwnerDTensor"], r
        assert r["step_types"] == ["Tensor"], r  # torch's AdamW keeps step a plain tensor
        assert r["loss_err"] <= CLIENT_ATOL, r
        assert r["param_keys_match"], r
        if rank == 0:  # torchtune gathers the full model state dict on rank 0 only
            assert r["param_err"] is not None and r["param_err"] <= CLIENT_ATOL, r

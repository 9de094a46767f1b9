"""The scripts in examples/ run as a user runs them (torchrun, or python) and keep their word.

Each trains a few steps, checkpoints half way, resumes a fresh model, optimizer and schedule
(other random weights) from that checkpoint, and prints the largest difference between the
resumed run's final parameters and the uninterrupted run's. Same world size, same operations in
the same order: the difference is exactly 0 (measured 0 on every script and layout), and a
resume that drops the optimizer state measures ~9e-3 (torchtitan_style.py with its
``set_optimizer_state_dict`` removed), so the check is equality. The resumed losses must repeat
the uninterrupted run's, and the uninterrupted run must learn (its last loss below its first).
Every process must exit with code 0: the multi-rank scripts end with the strict
``shutdown_process_groups()``, so a process group still referenced at exit fails the run every
time instead of aborting a rank now and then (see toolbox/launch.py).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from matrix_owner_optim.toolbox.launch import free_port

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
STEPS = 4
TIMEOUT_S = 180  # each script takes 10-20 s on 2 busy cores


def _run(cmd: list[str]) -> str:
    """Run ``cmd`` in its own session; its stdout. On a timeout the whole session is killed
    (torchrun's ranks too, not only torchrun) and the test fails with what it printed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=EXAMPLES.parent,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} ran past {TIMEOUT_S} s\n{out[-3000:]}\n{err[-3000:]}")
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{out[-3000:]}\n{err[-3000:]}"
    assert "terminate called" not in err, err[-3000:]
    return out


def _torchrun(script: str, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        str(EXAMPLES / script),
        *args,
    ]


def _check_resume(out: str, resumed_from: int) -> None:
    """The script's own comparison: resumed losses repeat the uninterrupted ones, final
    parameters equal, and the uninterrupted run learned."""
    assert f"resumed from step {resumed_from}: losses" in out, out
    resumed = re.search(r"resumed from step \d+: losses (.*)", out)
    straight = re.search(r"uninterrupted, same steps: losses (.*)", out)
    diff = re.search(r"max \|param diff\| resumed vs uninterrupted: (\S+)", out)
    assert resumed and straight and diff, out
    assert resumed.group(1).split() == straight.group(1).split(), out
    assert len(resumed.group(1).split()) == STEPS - resumed_from, out
    assert float(diff.group(1)) == 0.0, f"resumed run's parameters differ by {diff.group(1)}\n{out}"
    final = re.search(r"final loss: uninterrupted (\S+)", out)
    first = re.search(r"step 0: loss (\S+)", out) or re.search(r"'loss': '([^']+)'", out)
    assert final and first and float(final.group(1)) < float(first.group(1)), out


@pytest.mark.multirank
@pytest.mark.parametrize("layout", ["owner", "fsdp2"])
def test_torchtitan_style_resumes_to_the_uninterrupted_run(tmp_path: Path, layout: str) -> None:
    out = _run(
        _torchrun("torchtitan_style.py", "--steps", str(STEPS), "--ckpt", str(tmp_path / "ckpt"), "--layout", layout)
    )
    assert f"uninterrupted run ({layout} layout, 2 ranks" in out, out
    assert f"saved checkpoint after {STEPS // 2} steps" in out, out
    _check_resume(out, STEPS // 2)


@pytest.mark.multirank
def test_accelerate_ddp_resumes_to_the_uninterrupted_run(tmp_path: Path) -> None:
    out = _run(_torchrun("accelerate_ddp.py", "--steps", str(STEPS), "--out", str(tmp_path / "state")))
    assert "MULTI_CPU, 2 processes" in out, out  # Accelerate's DDP path, not one process
    assert (tmp_path / "state" / "optimizer.bin").exists()
    _check_resume(out, STEPS // 2)


def test_hf_trainer_resumes_to_the_uninterrupted_run(tmp_path: Path) -> None:
    out = _run([sys.executable, str(EXAMPLES / "hf_trainer.py"), "--steps", str(STEPS), "--out", str(tmp_path)])
    assert (tmp_path / "straight" / f"checkpoint-{STEPS // 2}").is_dir()
    _check_resume(out, STEPS // 2)

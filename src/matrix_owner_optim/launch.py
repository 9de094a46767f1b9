"""Start several CPU ranks on loopback (gloo) and collect what each returns.

Used by the ``train`` and ``bench`` commands and by the multi-rank tests. Under ``torchrun``
the process group already exists and none of this is needed. Each rank runs
``fn(rank, world_size, *args)`` after ``init_process_group``; return values travel back
through a pickle file per rank, so a rank's exception is re-raised in the parent with its
traceback instead of hanging the others.
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import tempfile
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["free_port", "spawn_ranks", "RankError"]


class RankError(RuntimeError):
    """A spawned rank raised; the message carries that rank's traceback."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(rank: int, world_size: int, port: int, backend: str, out_dir: str, threads: int,
           timeout_s: float, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    torch.set_num_threads(threads)
    result: dict[str, Any]
    try:
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        try:
            result = {"ok": True, "value": fn(rank, world_size, *args)}
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # report every failure, including assertion errors
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()}
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    # A non-zero exit makes the parent terminate the other ranks at once, instead of leaving
    # them blocked in a collective until the process-group timeout. A successful rank also
    # leaves without interpreter teardown: its result is on disk, and gloo/profiler threads
    # torn down at exit can abort the process after the work is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if result["ok"] else 1)


def spawn_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    threads_per_rank: int = 1,
    timeout_s: float = 300.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; return their results.

    ``fn`` must be importable (a module-level function). Raises :class:`RankError` with the
    first failing rank's traceback.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    with tempfile.TemporaryDirectory(prefix="moo-ranks-") as out_dir:
        port = free_port()
        ctx = mp.spawn(
            _entry,
            args=(world_size, port, backend, out_dir, threads_per_rank, timeout_s, fn, args),
            nprocs=world_size,
            join=False,
        )
        exit_error: Exception | None = None
        try:
            while not ctx.join():
                pass
        except mp.ProcessExitedException as exc:  # the others were terminated
            exit_error = exc
        results: list[dict[str, Any] | None] = []
        for rank in range(world_size):
            path = os.path.join(out_dir, f"rank{rank}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    results.append(pickle.load(f))
            else:
                results.append(None)
    failed = [(r, res) for r, res in enumerate(results) if res is not None and not res["ok"]]
    if failed:
        # A rank that lost its peer fails with a transport error; name the root cause first.
        failed.sort(key=lambda item: ("gloo" in item[1]["error"] or "NCCL" in item[1]["error"], item[0]))
        rank, res = failed[0]
        others = "; ".join(f"rank {r}: {x['error'][:200]}" for r, x in failed[1:])
        raise RankError(
            f"rank {rank} failed: {res['error']}\n{res['tb']}" + (f"\nalso: {others}" if others else "")
        )
    if exit_error is not None or any(r is None for r in results):
        missing = [r for r, res in enumerate(results) if res is None]
        raise RankError(f"ranks {missing} exited without a result ({exit_error})")
    return [res["value"] for res in results if res is not None]

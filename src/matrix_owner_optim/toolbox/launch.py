"""Start several CPU ranks on loopback (gloo) and collect what each returns.

Used by the ``train`` and ``bench`` commands and by the multi-rank tests. Under ``torchrun``
the process group already exists and none of this is needed. Each rank runs
``fn(rank, world_size, *args)`` after ``init_process_group``; return values travel back
through a pickle file per rank, so a rank's exception is re-raised in the parent with its
traceback instead of hanging the others.

Clean exit. A gloo process group runs worker threads (``pt_gloo_runloop``) that only stop
when the C++ ``ProcessGroupGloo`` is destroyed; ``dist.destroy_process_group()`` merely drops
the registry's references (gloo has no ``shutdown``). Anything else still holding the group
(a sharded model or optimizer waiting in a reference cycle for the garbage collector,
DTensor's caches of the ``DeviceMesh`` that stock FSDP2 fills) keeps those threads running
into interpreter finalization. A worker that then drops its last reference to a finished
collective's ``Work`` must take the GIL to release the tensors' Python objects; Python
ends such a thread during finalization (``pthread_exit`` inside a ``noexcept`` destructor),
which is ``std::terminate``: "terminate called without an active exception", SIGABRT, after
all the work was done. :func:`shutdown_process_groups` releases those references first, so
that destroying the group joins its threads, and checks that none is left. A successful
rank then exits through normal interpreter teardown, and any abnormal exit (non-zero code,
signal) is reported by :func:`spawn_ranks` as a failure even after the rank wrote its result.
"""

from __future__ import annotations

import gc
import os
import pickle
import socket
import sys
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["free_port", "spawn_ranks", "RankError", "shutdown_process_groups", "gloo_worker_threads"]

GLOO_WORKER_THREAD = "pt_gloo_runloop"  # the name ProcessGroupGloo gives its worker threads


class RankError(RuntimeError):
    """A spawned rank raised; the message carries that rank's traceback."""


# What a forkserver imports once before forking ranks (``spawn_ranks(start_method="forkserver")``).
# torch._dynamo: the first ``torch.optim.Optimizer`` of a process imports it (torch._compile's
# disable wrapper), about 1 s of a rank's start on a 2-core CPU otherwise.
FORKSERVER_PRELOAD = (
    "torch",
    "torch._dynamo",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "matrix_owner_optim",
)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def gloo_worker_threads() -> int | None:
    """Live gloo worker threads of this process (Linux ``/proc``); None where it cannot tell."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    count = 0
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                count += f.read().strip() == GLOO_WORKER_THREAD
        except OSError:  # the thread exited while we looked
            continue
    return count


def _clear_dtensor_caches() -> None:
    """Drop DTensor's process-wide caches, which keep every ``DeviceMesh`` they saw (and its
    process group) alive: sharding propagation (FSDP2's ``detach``/``requires_grad_`` on its
    sharded parameters fill it), redistribute planners and plans, and mesh topology. Only where DTensor was
    imported: nothing to clear otherwise. These are torch's debug/internal entry points (torch
    2.13); one a later torch lacks is passed over, and :func:`shutdown_process_groups`'s
    thread check still tells whether the group was released."""
    if "torch.distributed.tensor" not in sys.modules:
        return
    from torch.distributed.tensor import _collective_utils, _redistribute, debug

    clears = [
        getattr(debug, "_clear_sharding_prop_cache", None),
        getattr(_redistribute, "clear_redistribute_planner_cache", None),
        # redistribute plans by (source, target) spec, each holding its mesh: filled by any
        # Partial -> Replicate, e.g. the norm torch.nn.utils.clip_grad_norm_ returns on DTensors
        getattr(getattr(_redistribute, "_gen_transform_infos", None), "cache_clear", None),
        getattr(getattr(_collective_utils.MeshTopoInfo, "build_from_mesh", None), "cache_clear", None),
    ]
    for clear in clears:
        if clear is not None:
            clear()


def shutdown_process_groups(check: bool = True) -> None:
    """Destroy every process group so that gloo's worker threads are joined before exit.

    Call it when the models and optimizers that used the groups are no longer referenced
    (return from the function that built them first). It collects garbage (sharded modules
    and optimizers hold their group and sit in reference cycles), clears DTensor's mesh
    caches, then calls ``dist.destroy_process_group()``, which now drops the last reference
    and joins the threads. Why this matters: see the module docstring.

    With ``check``, raises ``RuntimeError`` when gloo worker threads survive (something still
    references a process group): such a process can abort at exit, so this is reported now,
    deterministically, instead of as a SIGABRT in some runs.
    """
    gc.collect()
    _clear_dtensor_caches()
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    left = gloo_worker_threads()
    if check and left:
        raise RuntimeError(
            f"{left} gloo worker threads are still running after destroy_process_group(): an "
            "object still references a process group (a model, optimizer, DeviceMesh or "
            "DTensor kept in a global or a cache). The process may abort at exit ('terminate "
            "called without an active exception'); drop those references before shutting down"
        )


def _entry(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    out_dir: str,
    threads: int,
    timeout_s: float,
    strict_shutdown: bool,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
) -> None:
    torch.set_num_threads(threads)
    payload: bytes
    try:
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        try:
            # pickled before shutdown, so the result holds no tensor or group during it
            payload = pickle.dumps({"ok": True, "value": fn(rank, world_size, *args)})
        except BaseException:
            if dist.is_initialized():
                dist.destroy_process_group()  # the process leaves through os._exit below
            raise
        shutdown_process_groups(check=strict_shutdown)
    except BaseException as exc:  # report every failure, including assertion errors
        payload = pickle.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()})
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            f.write(payload)
        # A non-zero exit makes the parent terminate the other ranks at once, instead of
        # leaving them blocked in a collective until the process-group timeout; the parent
        # reports this rank's error from its result file.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        f.write(payload)
    # Success: return, and leave through normal interpreter teardown. Its exit code reaches
    # the parent, which reports a non-zero code or a signal as a failure.


def spawn_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    threads_per_rank: int = 1,
    timeout_s: float = 300.0,
    strict_shutdown: bool = False,
    start_method: str = "spawn",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; return their results.

    ``fn`` must be importable (a module-level function). Raises :class:`RankError` with the
    first failing rank's traceback, and when a rank exits abnormally (non-zero exit code or a
    signal), also after it wrote its result.

    After ``fn`` returns, each rank calls :func:`shutdown_process_groups`. With
    ``strict_shutdown``, a gloo worker thread still running after it is a failure of that
    rank: use it where nothing outside the package pins the group (the owner layout; stock
    FSDP2 with :class:`~matrix_owner_optim.OwnerRoutedOptimizer`). Stock FSDP2 with torch's
    own optimizers cannot be strict: their DTensor arithmetic fills torch-internal per-op
    caches that keep the ``DeviceMesh``, and so the group, alive until the process ends.

    ``start_method``: ``"spawn"`` (the default) starts a fresh interpreter per rank, which
    leaves through interpreter teardown as a ``torchrun`` rank does (where a process group
    still pinned would abort: the case the exit tests check). ``"forkserver"`` forks each rank
    from one server process that imported :data:`FORKSERVER_PRELOAD` once (about 0.5 s per
    rank start instead of 2.5 s on a 2-core CPU: what many short multi-rank jobs want); its
    ranks share the server's environment (as it was when the server started) and string-hash
    seed, and leave through ``os._exit`` once ``fn`` returned and the groups were shut down,
    with no interpreter teardown and no ``atexit`` handlers.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if start_method not in ("spawn", "forkserver"):
        raise ValueError(f"start_method must be 'spawn' or 'forkserver', got {start_method!r}")
    if start_method == "forkserver":  # read when the server starts (the first forkserver job)
        mp.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    with tempfile.TemporaryDirectory(prefix="moo-ranks-") as out_dir:
        port = free_port()
        ctx = mp.start_processes(
            _entry,
            args=(world_size, port, backend, out_dir, threads_per_rank, timeout_s, strict_shutdown, fn, args),
            nprocs=world_size,
            join=False,
            start_method=start_method,
        )
        exit_error: mp.ProcessExitedException | None = None
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
        raise RankError(f"rank {rank} failed: {res['error']}\n{res['tb']}" + (f"\nalso: {others}" if others else ""))
    if exit_error is not None:
        rank = exit_error.error_index
        how = f"signal {exit_error.signal_name}" if exit_error.signal_name else f"exit code {exit_error.exit_code}"
        after = "after writing its result" if results[rank] is not None else "without writing a result"
        raise RankError(f"rank {rank} exited abnormally ({how}) {after}; the other ranks were terminated. {exit_error}")
    missing = [r for r, res in enumerate(results) if res is None]
    if missing:
        raise RankError(f"ranks {missing} exited with code 0 without writing a result")
    return [res["value"] for res in results if res is not None]

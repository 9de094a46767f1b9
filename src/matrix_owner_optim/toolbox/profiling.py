"""Count backend collectives from ``torch.profiler`` traces, independent of our own counters.

``torch.profiler`` records every process-group op as ``gloo:<op>`` or ``nccl:<op>`` with its
input shapes. :func:`backend_ops` lists them (optionally inside a time window, such as one
``record_function`` phase), and :func:`op_bytes` converts one op to the bytes a rank sends,
with the same conventions as :mod:`matrix_owner_optim.comm` (ring all-reduce, own chunk
excluded). Used to measure stock FSDP2 and ``torch.optim.Muon``, whose collectives do not go
through our wrappers, and to cross-check ours.

:func:`native_stderr_without_usdt` wraps the profiler's start and stop: torch's profiler
(kineto) writes ``USDT: ... profiler_start`` / ``profiler_stop`` lines to the process's
native stderr, which would land in the commands' output.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = ["BackendOp", "backend_ops", "op_bytes", "phase_windows", "BACKEND_PREFIXES", "native_stderr_without_usdt"]

_USDT_PREFIX = "USDT:"


@contextmanager
def native_stderr_without_usdt() -> Iterator[None]:
    """Capture file descriptor 2 while the body runs (the profiler's ``__enter__`` or
    ``__exit__``) and write back every line except kineto's ``USDT:`` trace markers; anything
    else printed there meanwhile (a warning, an error) still reaches stderr, after the body."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            text = captured.read().decode(errors="replace")
            kept = [line for line in text.splitlines(keepends=True) if not line.startswith(_USDT_PREFIX)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


BACKEND_PREFIXES = ("gloo:", "nccl:")


@dataclass(frozen=True)
class BackendOp:
    name: str
    input_numel: int
    start_us: float
    end_us: float


def _events(prof: Any, prefixes: tuple[str, ...]) -> Iterator[tuple[str, float, float, Any]]:
    """``(name, start_us, end_us, kineto event)`` of a finished profiler's events whose name
    starts with one of ``prefixes``, times from the trace start as ``prof.events()`` gives them.

    Read off the raw kineto results: ``prof.events()`` first builds a
    ``torch.autograd.profiler_util.FunctionEvent`` for every recorded op, and their tree, which
    on CPU costs far more than a small profiled step (0.69 s a parse in the trajectory test
    under load, against milliseconds for the step)."""
    results = prof.profiler.kineto_results
    origin = results.trace_start_ns()
    for e in results.events():
        name = e.name()
        if name.startswith(prefixes) and not getattr(e, "is_hidden_event", lambda: False)():
            yield name, (e.start_ns() - origin) / 1000, (e.end_ns() - origin) / 1000, e


def backend_ops(prof: Any, window: tuple[float, float] | None = None) -> list[BackendOp]:
    """Backend collective events of a finished profiler (within ``window`` if given)."""
    out = []
    for name, start, end, e in _events(prof, BACKEND_PREFIXES):
        if window is not None and not (window[0] <= start <= window[1]):
            continue
        shapes = [s for s in (e.shapes() or []) if isinstance(s, list)]
        numel = sum(math.prod(s) if s else 1 for s in shapes[:1])
        out.append(BackendOp(name, int(numel), start, end))
    return out


def phase_windows(prof: Any, prefix: str = "phase:") -> dict[str, list[tuple[float, float]]]:
    """Time ranges of ``record_function(prefix + name)`` blocks, by name."""
    windows: dict[str, list[tuple[float, float]]] = {}
    for name, start, end, _ in _events(prof, (prefix,)):
        windows.setdefault(name[len(prefix) :], []).append((start, end))
    return windows


def op_bytes(op: BackendOp, world_size: int, itemsize: int = 4) -> int:
    """Bytes one rank sends for ``op`` (input shapes give the payload; dtype given)."""
    n = op.input_numel * itemsize
    kind = op.name.split(":", 1)[1]
    W = world_size
    if W <= 1:
        return 0
    if kind.startswith("all_reduce"):
        return 2 * (W - 1) * n // W
    if kind.startswith(("all_gather", "allgather", "_allgather")):
        return (W - 1) * n  # the input is this rank's shard, sent to every other rank
    if kind.startswith(("reduce_scatter", "_reduce_scatter")):
        return (W - 1) * n // W  # the input is the full buffer
    if kind.startswith(("all_to_all", "alltoall")):
        # The profiler records the whole input but not the splits: exact when the split to
        # oneself is empty (this package's ops), an upper bound by n/W for even splits.
        return n
    if kind.startswith("broadcast"):
        return n  # upper bound: the root sends n to each peer in a tree, others relay
    return n

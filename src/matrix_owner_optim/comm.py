"""Counted collectives and :class:`CommCounter`: every byte the package moves, by phase.

All collectives the package issues go through the wrappers here, which report to every
active :class:`CommCounter`, whichever thread issues them: counters live in one process-wide
registry (under a lock), because the autograd engine runs backward hooks, and so the
runtime's reduce-scatters, on its own device threads on CUDA. The phase is per thread: the
code that issues a collective sets it (the runtime inside its hooks, the optimizer in its
step), so a collective from a device thread is not attributed to whatever the main thread
is doing at that moment. Bytes are the logical payload a rank sends and receives (its own
chunk excluded): all-to-all counts the splits to and from other ranks, all-gather counts
``(W-1)`` times the local input each way, all-reduce counts the ring algorithm's
``2·(W-1)/W·n`` each way. Phases are set by the runtime (``forward``,
``backward``), the optimizer (``optimizer``) and default to ``other`` on every thread.

Counting never replaces the profiler: tests cross-check these numbers against the
``gloo:``/``nccl:`` ops that ``torch.profiler`` records.
"""

from __future__ import annotations

import contextlib
import ctypes
import pickle
import threading
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "PHASES",
    "CommCounter",
    "CommRecord",
    "broadcast",
    "comm_phase",
    "current_phase",
    "record",
    "all_to_all_single",
    "all_reduce",
    "all_gather_into_tensor",
    "all_gather_object",
    "gather_object",
    "object_device",
    "all_gather",
    "reduce_scatter",
]

PHASES = ("forward", "backward", "optimizer", "other")

_lock = threading.Lock()  # guards _active and every counter's records
_active: list[CommCounter] = []  # process-wide: every thread reports to these
_local = threading.local()  # the phase, per thread


def _phase() -> str:
    return getattr(_local, "phase", "other")


@dataclass(frozen=True)
class CommRecord:
    """One collective: its phase, name, logical bytes, and the thread that issued it."""

    phase: str
    op: str
    bytes_sent: int
    bytes_received: int
    thread: str = ""


class CommCounter:
    """Context manager that counts calls and bytes of every collective inside it, by phase.

    While active it counts every collective the process issues through this module, from any
    thread (autograd's device threads included), so a counter entered around a step also
    sees the backward collectives that CUDA runs off the main thread. Safe to read while
    other threads record.

    Example::

        with CommCounter() as cc:
            loss = model(x).mean(); loss.backward()
            opt.step()
        assert cc.calls("optimizer") == 0 and cc.bytes("optimizer") == 0
        print(cc.by_phase())
    """

    def __init__(self) -> None:
        self.records: list[CommRecord] = []

    def __enter__(self) -> CommCounter:
        with _lock:
            _active.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        with _lock:
            if any(c is self for c in _active):
                _active.remove(self)

    def _select(self, phase: str | None) -> list[CommRecord]:
        if phase is not None and phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; use one of {PHASES}")
        with _lock:
            return [r for r in self.records if phase is None or r.phase == phase]

    def calls(self, phase: str | None = None) -> int:
        """Number of collectives issued (in ``phase``, or in all phases)."""
        return len(self._select(phase))

    def bytes(self, phase: str | None = None, direction: str = "total") -> int:
        """Bytes moved: ``direction`` is ``"sent"``, ``"received"`` or ``"total"`` (both)."""
        recs = self._select(phase)
        if direction == "sent":
            return sum(r.bytes_sent for r in recs)
        if direction == "received":
            return sum(r.bytes_received for r in recs)
        if direction == "total":
            return sum(r.bytes_sent + r.bytes_received for r in recs)
        raise ValueError(f"direction must be 'sent', 'received' or 'total', got {direction!r}")

    def by_phase(self) -> dict[str, dict[str, int]]:
        """``{phase: {"calls", "bytes_sent", "bytes_received"}}`` for all four phases."""
        out = {p: {"calls": 0, "bytes_sent": 0, "bytes_received": 0} for p in PHASES}
        for r in self._select(None):
            out[r.phase]["calls"] += 1
            out[r.phase]["bytes_sent"] += r.bytes_sent
            out[r.phase]["bytes_received"] += r.bytes_received
        return out

    def by_op(self, phase: str | None = None) -> dict[str, int]:
        counts: dict[str, int] = defaultdict(int)
        for r in self._select(phase):
            counts[r.op] += 1
        return dict(counts)

    def reset(self) -> None:
        with _lock:
            self.records.clear()


def current_phase() -> str:
    """The phase collectives issued by this thread are attributed to now."""
    return _phase()


@contextlib.contextmanager
def comm_phase(phase: str) -> Iterator[None]:
    """Attribute collectives this thread issues inside the block to ``phase`` (other threads
    keep their own phase: set it where the collective is issued, e.g. inside a hook)."""
    if phase not in PHASES:
        raise ValueError(f"unknown phase {phase!r}; use one of {PHASES}")
    previous = _phase()
    _local.phase = phase
    try:
        yield
    finally:
        _local.phase = previous


def record(op: str, bytes_sent: int, bytes_received: int, phase: str | None = None) -> None:
    """Report one collective, issued by the calling thread, to every active counter."""
    if phase is not None and phase not in PHASES:
        raise ValueError(f"unknown phase {phase!r}; use one of {PHASES}")
    if not _active:  # unlocked peek: the common case, no counter, costs no lock
        return
    rec = CommRecord(phase or _phase(), op, int(bytes_sent), int(bytes_received), threading.current_thread().name)
    with _lock:
        for c in _active:
            c.records.append(rec)


def _world(group: Any) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    group: Any = None,
    op: str = "all_to_all_single",
    async_op: bool = False,
) -> Any:
    """``dist.all_to_all_single`` with uneven splits, counted (own chunk excluded).

    With ``async_op=True`` the collective is counted when issued (in the phase current then)
    and its ``Work`` handle is returned; the caller waits on it before reading ``output``.
    """
    W, rank = _world(group)
    row = (input[0].numel() if input.dim() > 1 and input.shape[0] else 1) * input.element_size()
    if input_split_sizes is None:
        ins = [input.shape[0] // W] * W
    else:
        ins = list(input_split_sizes)
    if output_split_sizes is None:
        outs = [output.shape[0] // W] * W
    else:
        outs = list(output_split_sizes)
    sent = sum(n for r, n in enumerate(ins) if r != rank) * row
    recv = sum(n for r, n in enumerate(outs) if r != rank) * row
    record(op, sent, recv)
    return dist.all_to_all_single(
        output,
        input,
        output_split_sizes=list(outs) if output_split_sizes is not None else None,
        input_split_sizes=list(ins) if input_split_sizes is not None else None,
        group=group,
        async_op=async_op,
    )


def all_reduce(tensor: torch.Tensor, op: Any = None, group: Any = None, name: str = "all_reduce") -> None:
    W, _ = _world(group)
    ring = 2 * (W - 1) * _nbytes(tensor) // W if W > 1 else 0
    record(name, ring, ring)
    dist.all_reduce(tensor, op=op if op is not None else dist.ReduceOp.SUM, group=group)


def _all_gather_single(output: torch.Tensor, input: torch.Tensor, group: Any) -> None:
    """torch's even all-gather into one tensor: ``all_gather_single`` where torch has it
    (torch 2.13 deprecates ``all_gather_into_tensor`` with a FutureWarning), else the older name."""
    gather = getattr(dist, "all_gather_single", None)
    if gather is None:
        gather = dist.all_gather_into_tensor
    gather(output, input, group=group)


def all_gather_into_tensor(
    output: torch.Tensor, input: torch.Tensor, group: Any = None, name: str = "all_gather_into_tensor"
) -> None:
    W, _ = _world(group)
    n = _nbytes(input)
    record(name, n * (W - 1), n * (W - 1))
    _all_gather_single(output, input, group)


def barrier(group: Any = None, name: str = "barrier") -> None:
    """Every rank of ``group`` reached this point (no data: counted as a call of 0 bytes)."""
    dist.barrier(group=group)
    record(name, 0, 0)


def broadcast(
    tensor: torch.Tensor, group_src: int, group: Any = None, name: str = "broadcast", async_op: bool = False
) -> Any:
    """``dist.broadcast`` from ``group_src`` (a rank of ``group``), counted: the source sends
    ``W - 1`` copies, every other rank receives one. ``async_op=True``: counted when issued,
    the ``Work`` handle returned (wait on it before reading ``tensor``)."""
    W, rank = _world(group)
    n = _nbytes(tensor)
    if rank == group_src:
        record(name, n * (W - 1), 0)
    else:
        record(name, 0, n)
    return dist.broadcast(tensor, group_src=group_src, group=group, async_op=async_op)


def object_device(group: Any = None) -> torch.device:
    """Where a group's collectives take their tensors: the current CUDA device when the group's
    backend runs NCCL (and CUDA is there), else the CPU."""
    nccl = "nccl" in str(dist.get_backend(group)).lower()
    if nccl and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _encode(obj: Any, device: torch.device) -> torch.Tensor:
    payload = bytearray(pickle.dumps(obj))
    return torch.frombuffer(payload, dtype=torch.uint8).to(device)


def _decode(data: torch.Tensor) -> Any:
    # the bytes of a CPU uint8 tensor without numpy (which torch's *_object collectives need,
    # and which the library does not depend on)
    data = data.cpu().contiguous()
    return pickle.loads(ctypes.string_at(data.data_ptr(), data.numel()))


def _object_sizes(data: torch.Tensor, group: Any) -> list[int]:
    W, _ = _world(group)
    sizes = torch.empty(W, dtype=torch.int64, device=data.device)
    mine = torch.tensor([data.numel()], dtype=torch.int64, device=data.device)
    _all_gather_single(sizes, mine, group)
    return [int(n) for n in sizes.tolist()]


def _padded(data: torch.Tensor, n: int) -> torch.Tensor:
    out = torch.zeros(n, dtype=torch.uint8, device=data.device)
    out[: data.numel()] = data
    return out


def all_gather_object(obj: Any, group: Any = None, name: str = "all_gather_object") -> list[Any]:
    """Every rank's picklable ``obj``, in rank order (plan agreement, optimizer state
    consolidation). As ``dist.all_gather_object`` (pickled bytes, padded to the longest), but
    without numpy: ranks exchange sizes, then one ``all_gather_into_tensor`` of the bytes."""
    W, _ = _world(group)
    data = _encode(obj, object_device(group))
    sizes = _object_sizes(data, group)
    n = max(sizes)
    out = torch.empty(W * n, dtype=torch.uint8, device=data.device)
    _all_gather_single(out, _padded(data, n), group)
    record(name, (n + 8) * (W - 1), (n + 8) * (W - 1))
    return [_decode(out[r * n : r * n + sizes[r]]) for r in range(W)]


def gather_object(obj: Any, dst: int, group: Any = None, name: str = "gather_object") -> list[Any] | None:
    """Every rank's picklable ``obj`` on rank ``dst`` (a global rank), None elsewhere; as
    ``dist.gather_object`` but without numpy (sizes all-gathered, then one ``gather``)."""
    W, _ = _world(group)
    data = _encode(obj, object_device(group))
    sizes = _object_sizes(data, group)
    n = max(sizes)
    receiving = dist.get_rank() == dst
    parts = [torch.empty(n, dtype=torch.uint8, device=data.device) for _ in range(W)] if receiving else None
    dist.gather(_padded(data, n), parts, dst=dst, group=group)
    record(name, 8 * (W - 1) + (0 if receiving else n), 8 * (W - 1) + (n * (W - 1) if receiving else 0))
    if parts is None:
        return None
    return [_decode(parts[r][: sizes[r]]) for r in range(W)]


def all_gather(
    output_list: list[torch.Tensor],
    input: torch.Tensor,
    group: Any = None,
    name: str = "all_gather",
    async_op: bool = False,
) -> Any:
    """Counted ``dist.all_gather``, also with differently sized outputs (NCCL supports them).

    Counted as the owner-segment all-gather it is: this rank sends its ``input`` to the
    ``W-1`` others and receives every other rank's chunk.
    """
    W, rank = _world(group)
    sent = _nbytes(input) * (W - 1)
    recv = sum(_nbytes(t) for r, t in enumerate(output_list) if r != rank)
    record(name, sent, recv)
    return dist.all_gather(output_list, input, group=group, async_op=async_op)


def reduce_scatter(
    output: torch.Tensor,
    input_list: list[torch.Tensor],
    op: Any = None,
    group: Any = None,
    name: str = "reduce_scatter",
    async_op: bool = False,
) -> Any:
    """Counted ``dist.reduce_scatter``, also with differently sized inputs (NCCL).

    Counted logically: this rank sends every other rank's chunk once and receives its own
    chunk from the ``W-1`` others. ``async_op=True`` returns the ``Work`` handle.
    """
    W, rank = _world(group)
    sent = sum(_nbytes(t) for r, t in enumerate(input_list) if r != rank)
    recv = _nbytes(output) * (W - 1)
    record(name, sent, recv)
    return dist.reduce_scatter(
        output, input_list, op=op if op is not None else dist.ReduceOp.SUM, group=group, async_op=async_op
    )

"""Counted collectives and :class:`CommCounter`: every byte the package moves, by phase.

Every collective goes through a wrapper here, reported to every active counter (a process-wide
registry under a lock: backward hooks run on autograd's threads); the phase is per thread. Bytes
are the logical payload a rank sends and receives, its own chunk excluded (DESIGN.md,
"Collectives and bytes").
"""

from __future__ import annotations

import contextlib
import ctypes
import pickle
import threading
from collections import Counter
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


def current_phase() -> str:
    """The phase collectives issued by this thread are attributed to now."""
    return getattr(_local, "phase", "other")


def _check_phase(phase: str | None) -> None:
    if phase is not None and phase not in PHASES:
        raise ValueError(f"unknown phase {phase!r}; use one of {PHASES}")


@dataclass(frozen=True)
class CommRecord:
    """One collective: its phase, name, logical bytes, and the thread that issued it."""

    phase: str
    op: str
    bytes_sent: int
    bytes_received: int
    thread: str = ""


class CommCounter:
    """Context manager that counts calls and bytes of every collective the process issues
    through this module while it is active, from any thread; safe to read while others record.

    Example::

        with CommCounter() as cc:
            model(x).mean().backward()
            opt.step()
        assert cc.calls("optimizer") == 0 and cc.bytes("optimizer") == 0
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
        _check_phase(phase)
        with _lock:
            return [r for r in self.records if phase is None or r.phase == phase]

    def calls(self, phase: str | None = None) -> int:
        """Number of collectives issued (in ``phase``, or in all phases)."""
        return len(self._select(phase))

    def bytes(self, phase: str | None = None, direction: str = "total") -> int:
        """Bytes moved: ``direction`` is ``"sent"``, ``"received"`` or ``"total"`` (both)."""
        if direction not in ("sent", "received", "total"):
            raise ValueError(f"direction must be 'sent', 'received' or 'total', got {direction!r}")
        recs = self._select(phase)
        return sum(r.bytes_sent * (direction != "received") + r.bytes_received * (direction != "sent") for r in recs)

    def by_phase(self) -> dict[str, dict[str, int]]:
        """``{phase: {"calls", "bytes_sent", "bytes_received"}}`` for all four phases."""
        out = {p: {"calls": 0, "bytes_sent": 0, "bytes_received": 0} for p in PHASES}
        for r in self._select(None):
            out[r.phase]["calls"] += 1
            out[r.phase]["bytes_sent"] += r.bytes_sent
            out[r.phase]["bytes_received"] += r.bytes_received
        return out

    def by_op(self, phase: str | None = None) -> dict[str, int]:
        """``{op name: calls}`` (in ``phase``, or in all phases)."""
        return dict(Counter(r.op for r in self._select(phase)))


@contextlib.contextmanager
def comm_phase(phase: str) -> Iterator[None]:
    """Attribute collectives this thread issues inside the block to ``phase`` (other threads keep theirs)."""
    _check_phase(phase)
    previous = current_phase()
    _local.phase = phase
    try:
        yield
    finally:
        _local.phase = previous


def record(op: str, bytes_sent: int, bytes_received: int, phase: str | None = None) -> None:
    """Report one collective, issued by the calling thread, to every active counter."""
    _check_phase(phase)
    if not _active:  # unlocked peek: the common case, no counter, costs no lock
        return
    rec = CommRecord(
        phase or current_phase(), op, int(bytes_sent), int(bytes_received), threading.current_thread().name
    )
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
    """``dist.all_to_all_single`` with uneven splits, counted (``async_op``: when issued)."""
    W, rank = _world(group)
    row = (input[0].numel() if input.dim() > 1 and input.shape[0] else 1) * input.element_size()
    ins = [input.shape[0] // W] * W if input_split_sizes is None else list(input_split_sizes)
    outs = [output.shape[0] // W] * W if output_split_sizes is None else list(output_split_sizes)
    record(op, (sum(ins) - ins[rank]) * row, (sum(outs) - outs[rank]) * row)
    return dist.all_to_all_single(
        output,
        input,
        output_split_sizes=None if output_split_sizes is None else outs,
        input_split_sizes=None if input_split_sizes is None else ins,
        group=group,
        async_op=async_op,
    )


def all_reduce(tensor: torch.Tensor, op: Any = None, group: Any = None, name: str = "all_reduce") -> None:
    W, _ = _world(group)
    ring = 2 * (W - 1) * _nbytes(tensor) // W if W > 1 else 0
    record(name, ring, ring)
    dist.all_reduce(tensor, op=op if op is not None else dist.ReduceOp.SUM, group=group)


def _all_gather_single(output: torch.Tensor, input: torch.Tensor, group: Any) -> None:
    """torch's even all-gather into one tensor (``all_gather_single`` where torch 2.13 has it)."""
    getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(output, input, group=group)


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
    """``dist.broadcast`` from ``group_src`` (a rank of ``group``), counted."""
    W, rank = _world(group)
    n = _nbytes(tensor)
    sends = rank == group_src
    record(name, n * (W - 1) if sends else 0, 0 if sends else n)
    return dist.broadcast(tensor, group_src=group_src, group=group, async_op=async_op)


def object_device(group: Any = None) -> torch.device:
    """Where a group's collectives take their tensors: the current CUDA device under NCCL, else the CPU."""
    nccl = "nccl" in str(dist.get_backend(group)).lower()
    if nccl and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _decode(data: torch.Tensor) -> Any:
    data = data.cpu().contiguous()  # its bytes without numpy (torch's *_object collectives need it)
    return pickle.loads(ctypes.string_at(data.data_ptr(), data.numel()))


def _pickled(obj: Any, group: Any) -> tuple[torch.Tensor, list[int], int]:
    """``obj``'s pickled bytes padded to the longest rank's, every rank's length, and that longest."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(object_device(group))
    sizes = torch.empty(dist.get_world_size(group), dtype=torch.int64, device=data.device)
    _all_gather_single(sizes, torch.tensor([data.numel()], device=data.device), group)
    n = int(sizes.max())
    return torch.nn.functional.pad(data, (0, n - data.numel())), [int(k) for k in sizes.tolist()], n


def all_gather_object(obj: Any, group: Any = None, name: str = "all_gather_object") -> list[Any]:
    """Every rank's picklable ``obj``, in rank order: ``dist.all_gather_object`` without numpy."""
    W, _ = _world(group)
    data, sizes, n = _pickled(obj, group)
    out = torch.empty(W * n, dtype=torch.uint8, device=data.device)
    _all_gather_single(out, data, group)
    record(name, (n + 8) * (W - 1), (n + 8) * (W - 1))
    return [_decode(out[r * n : r * n + sizes[r]]) for r in range(W)]


def gather_object(obj: Any, dst: int, group: Any = None, name: str = "gather_object") -> list[Any] | None:
    """Every rank's picklable ``obj`` on global rank ``dst``, None elsewhere (without numpy)."""
    W, _ = _world(group)
    data, sizes, n = _pickled(obj, group)
    receiving = dist.get_rank() == dst
    parts = [torch.empty(n, dtype=torch.uint8, device=data.device) for _ in range(W)] if receiving else None
    dist.gather(data, parts, dst=dst, group=group)
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
    """Counted ``dist.all_gather``, also with differently sized outputs (NCCL)."""
    W, rank = _world(group)
    record(name, _nbytes(input) * (W - 1), sum(_nbytes(t) for r, t in enumerate(output_list) if r != rank))
    return dist.all_gather(output_list, input, group=group, async_op=async_op)


def reduce_scatter(
    output: torch.Tensor,
    input_list: list[torch.Tensor],
    op: Any = None,
    group: Any = None,
    name: str = "reduce_scatter",
    async_op: bool = False,
) -> Any:
    """Counted ``dist.reduce_scatter``, also with differently sized inputs (NCCL)."""
    W, rank = _world(group)
    record(name, sum(_nbytes(t) for r, t in enumerate(input_list) if r != rank), _nbytes(output) * (W - 1))
    return dist.reduce_scatter(
        output, input_list, op=op if op is not None else dist.ReduceOp.SUM, group=group, async_op=async_op
    )

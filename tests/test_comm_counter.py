"""CommCounter counts collectives from every thread, each in the phase its own thread set.

On CUDA the autograd engine runs backward (and so the owner runtime's hooks and their
reduce-scatters) on a device thread, not on the thread that entered the counter. These checks
issue collectives from another thread, and run a whole owner-layout backward on another
thread, and require the counter entered on the main thread to see them with their bytes.
All checks share one two-rank spawn.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from _ranks import spawn_ranks
from _ref import fully_shard_model
from matrix_owner_optim import comm
from matrix_owner_optim.comm import CommCounter, comm_phase, current_phase
from matrix_owner_optim.toolbox.models.gpt import GPT, GPTConfig

N = 1000  # float32 elements per test all-reduce


def _on_thread(fn: Callable[[], Any], name: str) -> None:
    """Run ``fn`` on a new thread and re-raise its exception here."""
    errors: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as exc:  # re-raised on the calling thread
            errors.append(exc)

    t = threading.Thread(target=target, name=name)
    t.start()
    t.join()
    if errors:
        raise errors[0]


def _raw_collectives(rank: int, W: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with CommCounter() as cc, comm_phase("forward"):
        # the worker sets its own phase, as the runtime does inside its hooks
        def in_backward() -> None:
            with comm_phase("backward"):
                comm.all_reduce(torch.ones(N), name="from_worker")

        _on_thread(in_backward, "worker-backward")
        # no phase set on that thread: "other", not the main thread's "forward"
        _on_thread(lambda: comm.all_reduce(torch.ones(N), name="no_phase"), "worker-plain")
        comm.all_reduce(torch.ones(N), name="from_main")
        out["main_phase_after"] = current_phase()
    out["records"] = [(r.phase, r.op, r.bytes_sent, r.bytes_received, r.thread) for r in cc.records]
    with CommCounter() as cc2:
        pass
    _on_thread(lambda: comm.all_reduce(torch.ones(N), name="after_exit"), "worker-late")
    out["calls_after_exit"] = (cc.calls(), cc2.calls())
    return out


def _backward_on_thread(rank: int, W: int) -> dict[str, Any]:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=16, seq_len=8, n_layers=2, d_model=16, n_heads=2)
    model = fully_shard_model(GPT(cfg))
    gen = torch.Generator().manual_seed(rank)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=gen)
    y = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=gen)
    by_thread: dict[str, dict[str, dict[str, int]]] = {}
    for where in ("main", "device-thread"):
        loss = model(x, y)
        with CommCounter() as cc:  # entered on the main thread, no phase set here
            if where == "main":
                loss.backward()
            else:
                _on_thread(loss.backward, "autograd-device")
        by_thread[where] = cc.by_phase()
        by_thread[where]["threads"] = sorted({r.thread for r in cc.records})  # type: ignore
        for p in model.parameters():
            p.grad = None
    return by_thread


def _all_checks(rank: int, W: int) -> dict[str, Any]:
    return {"raw": _raw_collectives(rank, W), "backward": _backward_on_thread(rank, W)}


# one xdist worker runs the whole module, so its module fixtures run once
pytestmark = [pytest.mark.xdist_group("comm_counter"), pytest.mark.multirank]


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return spawn_ranks(_all_checks, 2, strict_shutdown=True)


def test_collectives_from_other_threads_are_counted_in_their_phase(results: list[dict]) -> None:
    ring = 2 * (2 - 1) * N * 4 // 2  # ring all-reduce at W=2: n bytes each way
    for res in results:
        raw = res["raw"]
        assert raw["records"] == [
            ("backward", "from_worker", ring, ring, "worker-backward"),
            ("other", "no_phase", ring, ring, "worker-plain"),
            ("forward", "from_main", ring, ring, "MainThread"),
        ]
        assert raw["main_phase_after"] == "forward"
        # an exited counter sees nothing more, from any thread
        assert raw["calls_after_exit"] == (3, 0)


def test_backward_on_a_device_thread_counts_like_on_the_main_thread(results: list[dict]) -> None:
    for res in results:
        main, device = res["backward"]["main"], res["backward"]["device-thread"]
        assert main["threads"] == ["MainThread"]
        assert device["threads"] == ["autograd-device"]
        # the runtime sets "backward" inside its hooks: same calls and bytes, none elsewhere
        assert main["backward"]["calls"] > 0 and main["backward"]["bytes_sent"] > 0
        assert device["backward"] == main["backward"]
        for phase in ("forward", "optimizer", "other"):
            assert device[phase]["calls"] == 0 == main[phase]["calls"], phase

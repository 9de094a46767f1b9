"""How the suite starts ranks: ``spawn_ranks`` forked from one forkserver.

The suite starts a few hundred short multi-rank jobs; a spawned rank spends about 2.5 s of a
2-core CPU importing torch and the package before its first collective, a rank forked from a
forkserver that imported them once about 0.5 s (``toolbox.launch.FORKSERVER_PRELOAD``). Tests
whose subject is the process itself keep the launcher's default, ``spawn``: test_exit.py (the
exit code after interpreter teardown, ``atexit`` aborts) and test_without_numpy.py (a process
that never imported numpy).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from matrix_owner_optim.toolbox import launch

__all__ = ["spawn_ranks"]


def spawn_ranks(fn: Callable[..., Any], world_size: int, *args: Any, **kwargs: Any) -> list[Any]:
    """:func:`matrix_owner_optim.toolbox.launch.spawn_ranks` with ``start_method="forkserver"``
    unless the caller names one."""
    kwargs.setdefault("start_method", "forkserver")
    return launch.spawn_ranks(fn, world_size, *args, **kwargs)


def attempt(fn: Callable[[], Any]) -> dict[str, Any]:
    """Run ``fn`` on this rank once every rank is ready (a barrier) and return what it raised
    (type and text, or None) and how long it took: the failure-time checks' one measurement."""
    import time

    import torch.distributed as dist

    dist.barrier()
    start = time.monotonic()
    try:
        fn()
        error = None
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    return {"error": error, "elapsed": time.monotonic() - start}

"""A thin convenience over PyTorch's own checkpointing: ``dcp.save`` / ``dcp.load`` of
``{"model": get_model_state_dict(...), "optim": get_optimizer_state_dict(...)}``, plus checks that
name the file, the parameter and both shapes before any tensor is read, and an atomic replace of
the checkpoint directory. Collective over ``process_group``; guarantees: docs/reliability.md.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from . import comm
from .agreement import agree_verdict
from .tensors import local_tensor

__all__ = ["save", "load", "is_initialisation_step", "CheckpointError", "MODEL_KEY", "OPTIM_KEY"]

MODEL_KEY = "model"
OPTIM_KEY = "optim"
SAVING_SUFFIX = ".moo-saving"  # the directory a save writes into
PREVIOUS_SUFFIX = ".moo-previous"  # the old checkpoint, for the instant between two renames
_METADATA = ".metadata"


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model or optimizer it is loaded into."""


@contextlib.contextmanager
def _quiet() -> Any:
    """DCP warns on every one-process call and on DeviceMesh pickling; both are expected here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        warnings.filterwarnings("ignore", category=FutureWarning)
        yield


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _dcp_kwargs(process_group: Any) -> dict[str, Any]:
    return {"process_group": process_group} if _distributed() else {"no_dist": True}


def _coordinator(process_group: Any) -> bool:
    """Whether this rank is DCP's coordinator (rank 0 of the group, or the only process)."""
    return not _distributed() or dist.get_rank(process_group) == 0


def _barrier(process_group: Any) -> None:
    if _distributed():
        comm.barrier(group=process_group)


def _fsync_dir(path: str) -> None:
    """Make renames inside ``path`` durable (a no-op where directories cannot be opened)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _dcp_files_only(path: str) -> bool:
    """Whether the directory ``path`` holds DCP files only (the only kind ever replaced)."""
    return all(n == _METADATA or n.endswith(".distcp") or n.startswith(_METADATA + ".") for n in os.listdir(path))


def save(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    process_group: Any = None,
) -> None:
    """Save ``model`` (and ``optimizer``) to the DCP directory ``path`` (collective): written into
    ``<path>.moo-saving``, it replaces ``path`` only once complete on disk. Raises
    :class:`CheckpointError`, writing nothing, when ``path`` holds anything but DCP files."""
    path = os.fspath(path).rstrip(os.sep) or os.sep
    if os.path.isfile(path) or (os.path.isdir(path) and not _dcp_files_only(path)):
        raise CheckpointError(
            f"checkpoint path {path!r} exists and is not a checkpoint directory (it is a file, or "
            "holds files DCP did not write); refusing to replace it: pick another path"
        )
    staging, previous = path + SAVING_SUFFIX, path + PREVIOUS_SUFFIX
    with _quiet():
        state: dict[str, Any] = {MODEL_KEY: get_model_state_dict(model)}
        if optimizer is not None:
            state[OPTIM_KEY] = get_optimizer_state_dict(model, optimizer)
    if _coordinator(process_group):
        shutil.rmtree(staging, ignore_errors=True)  # what a failed or killed save left behind
    _barrier(process_group)
    try:
        with _quiet():
            dcp.save(state, checkpoint_id=staging, **_dcp_kwargs(process_group))
    except BaseException as exc:
        # DCP raises on every rank once each has finished writing: the staging directory can go
        if _coordinator(process_group):
            shutil.rmtree(staging, ignore_errors=True)
        if isinstance(exc, CheckpointException):  # a BaseException: `except Exception` misses it
            errors = {r: (e[0] if isinstance(e, tuple) else e) for r, e in exc.failures.items()}
            causes = "; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, e in sorted(errors.items()))
            raise RuntimeError(
                f"checkpoint save to {path!r} failed ({causes}); the previous checkpoint at that "
                "path, if any, is unchanged and loadable. Fix the cause (disk space, permissions) "
                "and save again"
            ) from exc
        raise
    # dcp.save returns after the coordinator wrote .metadata: every rank's data is on disk
    if _coordinator(process_group):
        if os.path.exists(path):
            shutil.rmtree(previous, ignore_errors=True)
            os.rename(path, previous)
        os.rename(staging, path)
        _fsync_dir(os.path.dirname(os.path.abspath(path)))
        shutil.rmtree(previous, ignore_errors=True)
    _barrier(process_group)  # nobody reads path before the new checkpoint is there


def _resolve(path: str) -> str:
    """``path``, or the previous checkpoint when a save died between its two renames."""
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, _METADATA)):
        return path
    previous = path + PREVIOUS_SUFFIX
    if not os.path.exists(path) and os.path.isfile(os.path.join(previous, _METADATA)):
        warnings.warn(
            f"checkpoint {path!r} is missing but {previous!r} is complete: a save was interrupted "
            "while replacing it; loading the previous checkpoint",
            RuntimeWarning,
            stacklevel=3,
        )
        return previous
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path!r} is not a DCP checkpoint (no such file or directory)")
    if not os.path.isdir(path):
        raise CheckpointError(
            f"{path!r} is a file, not a DCP checkpoint directory (matrix_owner_optim.checkpoint."
            "save writes a directory; a torch.save file is read with torch.load)"
        )
    entries = sorted(os.listdir(path))
    if any(n.endswith(".distcp") for n in entries):
        raise CheckpointError(
            f"checkpoint {path!r} is incomplete: it holds data files but no {_METADATA}, so the "
            "save that wrote it did not finish; load an earlier checkpoint"
        )
    raise CheckpointError(
        f"{path!r} is not a DCP checkpoint: it has no {_METADATA} file (it holds "
        f"{entries[:5]}{' ...' if len(entries) > 5 else ''})"
    )


def _metadata(path: str) -> Metadata:
    """The DCP metadata of ``path``, once every data file it names is complete and ``save`` wrote it."""
    try:
        meta = dcp.FileSystemReader(path).read_metadata()
    except FileNotFoundError:
        raise FileNotFoundError(f"{path!r} is not a DCP checkpoint (no .metadata file)") from None
    except Exception as exc:  # unpickling a cut or foreign file fails in many ways
        raise CheckpointError(
            f"checkpoint {path!r}: its {_METADATA} file cannot be read ({type(exc).__name__}: "
            f"{exc}); it is truncated or was not written by DCP"
        ) from exc
    if not isinstance(meta, Metadata):
        raise CheckpointError(
            f"checkpoint {path!r}: its {_METADATA} file holds a {type(meta).__name__}, not DCP metadata"
        )
    needed: dict[str, int] = {}
    for info in (meta.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if rel is not None:
            needed[rel] = max(needed.get(rel, 0), int(info.offset) + int(info.length))
    for rel, end in sorted(needed.items()):
        file = os.path.join(path, rel)
        size = os.path.getsize(file) if os.path.isfile(file) else None
        if size is None or size < end:
            have = "is missing" if size is None else f"has {size} bytes"
            raise CheckpointError(
                f"checkpoint {path!r} is truncated: data file {rel!r} {have} but its metadata "
                f"needs {end}; it was not written or copied completely. Load an earlier checkpoint"
            )
    keys = meta.state_dict_metadata
    if not any(k.startswith(MODEL_KEY + ".") for k in keys):
        raise CheckpointError(
            f"checkpoint {path!r} was not written by matrix_owner_optim.checkpoint.save: it has "
            f"no '{MODEL_KEY}.*' entries (it holds {sorted(keys)[:4]}); read it with "
            "torch.distributed.checkpoint.load into the state dict its writer used"
        )
    return meta


def _check_param_groups(path: str, groups: list[dict[str, Any]], saved: dict[str, Any]) -> None:
    """Refuse an optimizer whose param groups' hyperparameter names the checkpoint lacks."""
    group_prefix = f"{OPTIM_KEY}.param_groups."
    saved_groups: dict[str, set[str]] = {}
    for k in saved:
        if k.startswith(group_prefix):
            index, _, name = k[len(group_prefix) :].partition(".")
            saved_groups.setdefault(index, set()).add(name)
    for i, group in enumerate(groups):
        have = saved_groups.get(str(i))
        absent = sorted(set(group) - (have or set()) - {"params", "param_names", "optimizer"})
        if have is None or absent:
            role = group.get("role", "?")
            raise CheckpointError(
                f"checkpoint {path!r}: param group {i} (role {role!r}) of this optimizer has "
                f"{'no counterpart' if have is None else 'hyperparameters ' + str(absent[:4])} in "
                f"the checkpoint (saved groups: {len(saved_groups)}, this optimizer's: "
                f"{len(groups)}); it was saved with another optimizer or other param groups. Build "
                "the optimizer the checkpoint was written with, or load the model alone"
            )


def _check_model(
    path: str, here: dict[str, Any], saved: Mapping[str, Any], strict: bool
) -> tuple[list[str], list[str]]:
    """Refuse other shapes and (``strict``) missing or unexpected model keys; returns those."""
    prefix = MODEL_KEY + "."
    for key, value in here.items():
        meta = saved.get(key)
        if isinstance(meta, TensorStorageMetadata) and tuple(meta.size) != tuple(value.shape):
            raise CheckpointError(
                f"checkpoint {path!r}: {key[len(prefix) :]!r} has shape {tuple(meta.size)} in the checkpoint "
                f"but {tuple(value.shape)} in the model; load it into a model built with the same configuration"
            )
    missing = sorted(k for k in here if k not in saved)
    unexpected = sorted(
        k for k, v in saved.items() if k.startswith(prefix) and k not in here and isinstance(v, TensorStorageMetadata)
    )
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"checkpoint {path!r}: model keys missing from it: {missing}; model entries this model has no "
            f"parameter or buffer for: {unexpected}; pass strict=False to skip them explicitly"
        )
    return missing, unexpected


def _check_optimizer_state(path: str, optim: dict[str, Any], saved: Mapping[str, Any]) -> None:
    """Refuse an optimizer keeping state the checkpoint lacks (other optimizers or roles)."""
    absent = [
        f"{fqn}.{name}"
        for fqn, st in optim["state"].items()
        for name in st
        if f"{OPTIM_KEY}.state.{fqn}.{name}" not in saved
    ]
    if absent:
        raise CheckpointError(
            f"checkpoint {path!r} has no optimizer state {absent[:4]}{' ...' if len(absent) > 4 else ''} "
            "that this optimizer keeps; build it with the same optimizers, param groups and roles "
            "(e.g. OwnerRoutedOptimizer(model, ...) on every layout, so names give the roles)"
        )


def _checked(error_of: Callable[[], None]) -> CheckpointError | None:
    """What ``error_of()`` refuses with (for :func:`~.agreement.agree_verdict`), or None."""
    try:
        error_of()
    except CheckpointError as exc:
        return exc
    return None


def _is_fresh(optimizer: torch.optim.Optimizer) -> bool:
    """Whether torch's ``get/set_optimizer_state_dict`` would initialise ``optimizer``."""
    return not optimizer.state and all(p.grad is None for g in optimizer.param_groups for p in g["params"])


def is_initialisation_step(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a ``step()`` about to run is torch's ``_init_optim_state`` of a fresh optimizer."""
    groups = optimizer.param_groups
    if optimizer.state or any(float(g.get("lr", 0.0)) != 0.0 for g in groups):
        return False
    grads = [p.grad for g in groups for p in g["params"] if p.requires_grad]
    return all(gr is not None and not local_tensor(gr).any() for gr in grads)


def load(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    strict: bool = True,
    process_group: Any = None,
) -> list[str]:
    """Load a checkpoint written by :func:`save` (any world size and layout) into ``model`` (and
    ``optimizer``); collective when distributed.

    Raises :class:`CheckpointError` naming the file, the fqn and both shapes for a mismatch, and
    (``strict``) for missing or unexpected model entries; ``strict=False`` skips and returns
    them. A refusal is agreed by every rank before any tensor is read and changes nothing.
    """
    path = _resolve(os.fspath(path).rstrip(os.sep) or os.sep)
    saved = _metadata(path).state_dict_metadata
    options = StateDictOptions(strict=strict)
    groups = [process_group]
    who = f"checkpoint.load({path!r})"
    with _quiet():
        model_state = get_model_state_dict(model, options=options)
    here = {MODEL_KEY + "." + k: v for k, v in model_state.items()}
    with_optim = optimizer is not None and (strict or any(k.startswith(OPTIM_KEY + ".") for k in saved))

    def before_init() -> None:  # what can be refused without the optimizer's state
        _check_model(path, here, saved, strict)
        if optimizer is not None and strict and not any(k.startswith(OPTIM_KEY + ".") for k in saved):
            raise CheckpointError(
                f"checkpoint {path!r} holds no optimizer state (it was saved without an "
                "optimizer); load the model alone or pass strict=False"
            )
        if with_optim and strict:
            assert optimizer is not None
            _check_param_groups(path, optimizer.param_groups, saved)

    agree_verdict(_checked(before_init), groups, who=who)
    missing, unexpected = _check_model(path, here, saved, strict)
    state: dict[str, Any] = {MODEL_KEY: model_state}
    if with_optim:
        assert optimizer is not None
        fresh = optimizer.state_dict() if _is_fresh(optimizer) else None
        with _quiet():
            state[OPTIM_KEY] = get_optimizer_state_dict(model, optimizer, options=options)  # initialises a fresh one

        def after_init() -> None:
            if strict:
                _check_optimizer_state(path, state[OPTIM_KEY], saved)
                _check_param_groups(path, state[OPTIM_KEY].get("param_groups", []), saved)

        try:
            agree_verdict(_checked(after_init), groups, who=who)
        except Exception:
            if fresh is not None:  # as it was: no state (every rank refuses, so every rank does this)
                optimizer.load_state_dict(fresh)
            raise
    for key in missing:
        del state[MODEL_KEY][key[len(MODEL_KEY) + 1 :]]
    with _quiet():
        dcp.load(
            state,
            checkpoint_id=path,
            planner=DefaultLoadPlanner(allow_partial_load=not strict),
            **_dcp_kwargs(process_group),
        )
        set_model_state_dict(model, state[MODEL_KEY], options=options)
        if OPTIM_KEY in state:
            set_optimizer_state_dict(model, optimizer, state[OPTIM_KEY], options=options)  # type: ignore[arg-type]
    return missing + unexpected

"""A thin convenience over PyTorch's own checkpointing: DCP and its ``get/set_*_state_dict``.

``save(path, model, optimizer)`` is ``dcp.save({"model": get_model_state_dict(model), "optim":
get_optimizer_state_dict(model, optimizer)})``; ``load`` is the matching ``dcp.load`` followed
by ``set_model_state_dict`` / ``set_optimizer_state_dict``. Everything that makes the owner
layout checkpointable lives in the state dicts themselves (``model.state_dict()`` and
``OwnerRoutedOptimizer.state_dict()`` give pieces of global tensors keyed by fqn), so a trainer
can call those tools directly; this module adds only error messages that name the file, the
parameter and both shapes before any tensor is read. A checkpoint written at W ranks on any
layout (owner layout, stock FSDP2, DDP, one process) loads at any W' on any layout.

Every call is collective over ``process_group`` (default: the world group) when a process group
is initialized; with none, both run in one process.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

__all__ = ["save", "load", "CheckpointError", "MODEL_KEY", "OPTIM_KEY"]

MODEL_KEY = "model"
OPTIM_KEY = "optim"


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model or optimizer it is loaded into."""


@contextlib.contextmanager
def _quiet() -> Any:
    """DCP warns on every one-process call and on DeviceMesh pickling; both are expected here."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
        )
        warnings.filterwarnings("ignore", category=FutureWarning)
        yield


def _dcp_kwargs(process_group: Any) -> dict[str, Any]:
    if dist.is_available() and dist.is_initialized():
        return {"process_group": process_group}
    return {"no_dist": True}


def _state(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, strict: bool = True
) -> dict[str, Any]:
    options = StateDictOptions(strict=strict)
    state: dict[str, Any] = {MODEL_KEY: get_model_state_dict(model, options=options)}
    if optimizer is not None:
        state[OPTIM_KEY] = get_optimizer_state_dict(model, optimizer, options=options)
    return state


def save(
    path: "str | os.PathLike[str]",
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    process_group: Any = None,
) -> None:
    """Save ``model`` (and ``optimizer``) to the DCP directory ``path``; collective when distributed."""
    with _quiet():
        dcp.save(
            _state(model, optimizer), checkpoint_id=os.fspath(path), **_dcp_kwargs(process_group)
        )


def _metadata(path: str) -> Metadata:
    try:
        return dcp.FileSystemReader(path).read_metadata()
    except FileNotFoundError:
        raise FileNotFoundError(f"{path!r} is not a DCP checkpoint (no .metadata file)") from None


def load(
    path: "str | os.PathLike[str]",
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    strict: bool = True,
    process_group: Any = None,
) -> list[str]:
    """Load a checkpoint written by :func:`save` (any world size and layout) into ``model`` (and
    ``optimizer``) as this rank holds them; collective when distributed.

    Raises :class:`CheckpointError` naming the file, the fqn and both shapes for a shape that
    does not match, and for model entries missing from the checkpoint (or, with ``strict``,
    checkpoint model entries the model lacks); every rank checks before any tensor is read, so
    all fail alike. ``strict=False`` skips those keys and returns them (model keys missing from
    the checkpoint, then checkpoint model entries the model has no parameter or buffer for).
    """
    path = os.fspath(path)
    saved = _metadata(path).state_dict_metadata
    with _quiet():
        state = _state(model, optimizer, strict)
    prefix = MODEL_KEY + "."
    here = {prefix + k: v for k, v in state[MODEL_KEY].items()}
    for key, value in here.items():
        meta = saved.get(key)
        if isinstance(meta, TensorStorageMetadata) and tuple(meta.size) != tuple(value.shape):
            raise CheckpointError(
                f"checkpoint {path!r}: {key[len(prefix) :]!r} has shape {tuple(meta.size)} in the checkpoint "
                f"but {tuple(value.shape)} in the model; load it into a model built with the same configuration"
            )
    missing = sorted(k for k in here if k not in saved)
    unexpected = sorted(
        k
        for k, v in saved.items()
        if k.startswith(prefix) and k not in here and isinstance(v, TensorStorageMetadata)
    )
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"checkpoint {path!r}: model keys missing from it: {missing}; model entries this model has no "
            f"parameter or buffer for: {unexpected}; pass strict=False to skip them explicitly"
        )
    if optimizer is not None and not any(k.startswith(OPTIM_KEY + ".") for k in saved):
        if strict:
            raise CheckpointError(
                f"checkpoint {path!r} holds no optimizer state (it was saved without an "
                "optimizer); load the model alone or pass strict=False"
            )
        del state[OPTIM_KEY]
    if strict and OPTIM_KEY in state:
        absent = [
            f"{fqn}.{name}"
            for fqn, st in state[OPTIM_KEY]["state"].items()
            for name in st
            if f"{OPTIM_KEY}.state.{fqn}.{name}" not in saved
        ]
        if absent:
            raise CheckpointError(
                f"checkpoint {path!r} has no optimizer state {absent[:4]}{' ...' if len(absent) > 4 else ''} "
                "that this optimizer keeps; build it with the same optimizers, param groups and roles "
                "(e.g. OwnerRoutedOptimizer(model, ...) on every layout, so names give the roles)"
            )
    for key in missing:
        del state[MODEL_KEY][key[len(prefix) :]]
    with _quiet():
        dcp.load(
            state,
            checkpoint_id=path,
            planner=DefaultLoadPlanner(allow_partial_load=not strict),
            **_dcp_kwargs(process_group),
        )
        options = StateDictOptions(strict=strict)
        set_model_state_dict(model, state[MODEL_KEY], options=options)
        if OPTIM_KEY in state:
            set_optimizer_state_dict(model, optimizer, state[OPTIM_KEY], options=options)  # type: ignore[arg-type]
    return missing + unexpected

"""Model state-dict hooks of the owner layout: ``state_dict()`` gives pieces of global tensors.

Installed by ``fully_shard`` on every module it records. ``state_dict()`` fixes a lazy plan, then
turns the unit's sharded parameters into pieces (:mod:`matrix_owner_optim.pieces`: ``Shard(0)``
DTensors for row blocks, ``OwnedTensor`` for tensors held whole by one owner), so DCP,
``get_model_state_dict`` and ``full_state_dict=True`` work unchanged. ``load_state_dict()`` takes
those pieces, or full tensors, back. Pieces alias the parameters' storage, so
``dcp.load(get_model_state_dict(model))`` writes straight into the model, as it does for FSDP2.

HSDP: pieces live on the shard group's mesh; replicas hold identical pieces and write identical
DCP items, which DCP's planner de-duplicates.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..pieces import local_piece, piece_of, shard_info

__all__ = ["install_state_dict_hooks"]

_HOOKS_ATTR = "_moo_state_dict_hooks"


# -- model hooks ------------------------------------------------------------------------------------------
def _ensure_sharded(module: nn.Module) -> None:
    from .api import _ensure_sharded as ensure  # the runtime imports this module

    ensure(module)


def _subtree_params(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(module.named_parameters(remove_duplicate=False))


def _save_pre_hook(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    _ensure_sharded(module)  # state_dict() fixes a lazy plan, as FSDP2's lazy init would


def _save_post_hook(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    """Turn this unit's sharded parameters into pieces of their global tensors (no copy).

    Runs after the subtree's entries are in; nested units converted theirs already.
    """
    for name, param in _subtree_params(module):
        key = prefix + name
        value = state_dict.get(key)
        if value is None or isinstance(value, DTensor):
            continue
        info = shard_info(param)
        if info is None:
            continue
        shard, rank, group = info
        local = value.detach()
        if tuple(local.shape) != tuple(shard.local_shape(rank)):
            if tuple(local.shape) == tuple(
                shard.shape
            ):  # unshard()-ed: the full tensor is a fine entry
                continue
            raise RuntimeError(
                f"state_dict: parameter {key!r} holds shape {tuple(local.shape)}, neither its piece "
                f"{tuple(shard.local_shape(rank))} nor its full shape {tuple(shard.shape)}; call "
                "state_dict() outside forward and backward"
            )
        state_dict[key] = piece_of(local, shard, rank, group)


def _load_pre_hook(
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """Replace each entry of this unit's sharded parameters by this rank's piece of it."""
    _ensure_sharded(module)
    if local_metadata.get("assign_to_params_buffers", False):
        raise ValueError(
            "load_state_dict(assign=True) would replace the sharded parameters of a fully_shard "
            "module; load with assign=False (the default)"
        )
    for name, param in _subtree_params(module):
        key = prefix + name
        if key not in state_dict:
            continue
        info = shard_info(param)
        if info is None:
            continue
        shard, rank, _ = info
        if tuple(param.shape) != tuple(shard.local_shape(rank)):
            continue  # unshard()-ed: the full tensor is registered, torch loads it as is
        state_dict[key] = local_piece(
            state_dict[key], shard, rank, what=f"parameter {key!r}", like=param
        )


def install_state_dict_hooks(module: nn.Module) -> None:
    """Install the state-dict hooks of a module passed to ``fully_shard`` (idempotent).

    ``state_dict()`` gives pieces of the global tensors (see the module docstring) for the
    parameters this module's unit manages; ``load_state_dict()`` takes those pieces, or full
    tensors, back. Both fix a lazy plan first.
    """
    if module.__dict__.get(_HOOKS_ATTR, False):
        return
    module.register_state_dict_pre_hook(_save_pre_hook)
    module.register_state_dict_post_hook(_save_post_hook)
    module.register_load_state_dict_pre_hook(_load_pre_hook)
    module.__dict__[_HOOKS_ATTR] = True

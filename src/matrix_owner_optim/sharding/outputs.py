"""The tensors of a forward output that a backward can reach, as FSDP2's ``collect_grad_tensors``:
pytree leaves and the fields of dataclasses among them (opaque leaves to pytree).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

__all__ = ["grad_tensors"]

_MAX_DEPTH = 64  # a cycle through dataclass fields would otherwise recurse forever


def grad_tensors(output: Any) -> list[torch.Tensor]:
    """Every tensor in ``output`` that requires a gradient, in traversal order."""
    if isinstance(output, torch.Tensor):  # the common case, without pytree
        return [output] if output.requires_grad else []
    found: list[torch.Tensor] = []
    _collect(output, found, 0)
    return found


def _collect(tree: Any, found: list[torch.Tensor], depth: int) -> None:
    if depth > _MAX_DEPTH:
        raise RuntimeError(
            f"a fully_shard module's forward output nests dataclasses deeper than {_MAX_DEPTH} levels "
            "(a reference cycle?); return tensors in tuples, dicts or dataclasses without cycles"
        )
    for leaf in tree_flatten(tree)[0]:
        if isinstance(leaf, torch.Tensor):
            if leaf.requires_grad:
                found.append(leaf)
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            for field in dataclasses.fields(leaf):
                _collect(getattr(leaf, field.name), found, depth + 1)

"""What the rules read of an owner-layout tensor: the base class ``OwnerDTensor`` (tensor.py)
derives from, so that ``dispatch.py``, ``decisions.py`` and ``two_dim.py`` type and test for it
without importing tensor.py (which imports them). DESIGN.md, "The representation", has the rules.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor

__all__ = ["OwnerTensorBase"]


class OwnerTensorBase(DTensor):
    """An owner-layout DTensor (``tensor.py: OwnerDTensor`` is the one class deriving from it)."""

    _holder: int | None
    _gathered_view: bool = False  # a view of a gathered copy (dispatch.py): writing it is refused

    if TYPE_CHECKING:  # provided by OwnerDTensor

        @staticmethod
        def make(
            local: torch.Tensor,
            mesh: Any,
            placement: Any,
            shape: Sequence[int],
            stride: Sequence[int] | None = None,
            *,
            requires_grad: bool = False,
            holder: int | None = None,
        ) -> Any: ...

        @staticmethod
        def _wrap(local: torch.Tensor, spec: Any, holder: int | None, *, requires_grad: bool = False) -> Any: ...

        @property
        def placement(self) -> Any: ...

        @property
        def holder(self) -> int | None: ...

        @property
        def is_holder(self) -> bool: ...

        def full_value(self) -> torch.Tensor: ...

        def piece_of_full(self, full: torch.Tensor) -> torch.Tensor: ...

        def relayout(self, local: torch.Tensor, placement: Any, *, holder: int | None = None) -> None: ...

        def _as_stock(self) -> DTensor: ...

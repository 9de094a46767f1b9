"""Single-tensor matrix optimizers: Muon, Shampoo, SOAP.

Each is an ordinary :class:`torch.optim.Optimizer` over whole 2D tensors (per-tensor loop, no
communication, no ``torch.distributed``); a non-2D parameter or gradient is a ``ValueError``
naming its shape. Each class carries ``cost_model`` (from :mod:`matrix_owner_optim.planning.cost`)
so the planner can balance owners by what the optimizer really costs.
"""

from __future__ import annotations

from ._common import matrix_inverse_root, require_2d
from .muon import Muon
from .shampoo import Shampoo
from .soap import SOAP

__all__ = ["Muon", "Shampoo", "SOAP", "require_2d", "matrix_inverse_root"]

"""Single-tensor matrix optimizers: Muon, Shampoo, SOAP.

Each is an ordinary :class:`torch.optim.Optimizer` over whole 2D tensors (per-tensor loop, no
communication, no ``torch.distributed``); a non-2D parameter or gradient is a ``ValueError``
naming its shape. Each class carries ``cost_model`` (from :mod:`matrix_owner_optim.planning.cost`)
so the planner can balance owners by what the optimizer really costs.

As torch's ``torch.optim._muon``, each class gathers its param groups' parameters, gradients and
state and calls a pure function that computes the update: :func:`muon`, :func:`shampoo`,
:func:`soap` (lists of tensors and explicit hyperparameters, no optimizer object). (The names
shadow the submodules as attributes of this package; ``from .shampoo import ...`` still works.)
"""

from __future__ import annotations

from ._common import matrix_inverse_root, require_2d
from .muon import Muon, muon
from .shampoo import Shampoo, shampoo
from .soap import SOAP, soap

__all__ = ["Muon", "Shampoo", "SOAP", "muon", "shampoo", "soap", "require_2d", "matrix_inverse_root"]

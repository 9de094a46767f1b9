"""The owner layout as a DTensor: what a sharded parameter, its gradient and its state are.

Every tensor of the owner layout is an :class:`OwnerDTensor`, a ``DTensor`` whose local tensor is
this rank's piece: ``OwnerShard(0, ranges)`` (held whole by its owner, or split at row ranges),
``Shard(0)`` (FSDP2's row blocks) or ``Replicate()`` (before the plan); on a 2D (dp, tp) mesh a
tensor-parallel slice held by its dp owner. Every operator is exact on every rank or refused on
every rank. DESIGN.md, "The representation", describes the layout and the rule table once;
the modules: ``placement.py`` (placements), ``base.py`` / ``tensor.py`` (the tensor), ``ops.py``
(operator classes), ``dispatch.py`` (the rules), ``two_dim.py`` (the 2D mesh's local rules),
``lists.py`` (list operators), ``decisions.py`` (decisions cached), ``values.py`` (whole values,
pieces, ``copy_``), ``holder_agreement.py``, ``assign.py`` (``t.data =``), ``dcp.py`` (DCP).
"""

from .placement import OwnerShard, contiguous_stride, owned_ranges, same_placement
from .tensor import (
    OwnerDTensor,
    as_owner_dtensor,
    is_owner_dtensor,
    like_layout,
    mesh_of_group,
)

__all__ = [
    "OwnerShard",
    "OwnerDTensor",
    "as_owner_dtensor",
    "contiguous_stride",
    "is_owner_dtensor",
    "like_layout",
    "mesh_of_group",
    "owned_ranges",
    "same_placement",
]

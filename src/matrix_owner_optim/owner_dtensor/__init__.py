"""The owner layout as a DTensor: what a sharded parameter, its gradient and its state are.

(``placement.py``: the placements; ``tensor.py``: the tensor and its operators; ``ops.py``: which
operators run piecewise; ``dcp.py``: DCP's checkpoint protocol.)

Every tensor of the owner layout is an :class:`OwnerDTensor`: a ``DTensor`` over the shard
group's 1D mesh whose local tensor is this rank's piece. Its placement says which piece:

* ``OwnerShard(0, ranges)``: a ``Shard(0)`` whose per-rank pieces are explicit row ranges
  instead of ``torch.chunk``'s. A tensor held whole by its owner (matrices, tail tensors) has
  the range ``[0, rows)`` on the owner and an empty range elsewhere; several non-empty ranges
  describe a tensor split at row boundaries over several owners. ``compute_local_shape_and_
  global_offset`` (DCP, ``get/set_model_state_dict``) reads the ranges through the placement.
* ``Shard(0)``: row blocks split as ``torch.chunk`` splits them (embeddings, heads): FSDP2's own
  form, so every operator DTensor knows runs as it does on FSDP2.
* ``Replicate()``: every rank holds the whole tensor. A module's parameters are this between
  ``fully_shard`` and the moment the plan is fixed, so the same objects can become owner pieces
  in place (``_local_tensor`` and ``_spec`` replaced) and an optimizer built in between holds
  the right tensors; its operators run locally, as on plain tensors.

Operators (``__torch_dispatch__``) keep the layout's meaning without communicating wherever the
layout allows it:

* *holder-local*: all tensors of an operator held by one rank (one owner; replicated values and
  plain tensors taken as replicated) are computed by that rank alone, whatever the operator
  (pointwise, views, matmuls, reductions), and the result is held by the same rank. Other ranks
  compute nothing and hold an empty piece; a 0-dim result is a ``Partial`` (``_NormPartial`` for
  norms) with zeros elsewhere, which is exactly true, so torch's reductions over many tensors
  (``clip_grad_norm_``: ``_foreach_norm``, ``stack``, ``vector_norm``) sum the owners' values in
  one all-reduce. An optimizer step on the owner therefore issues no collective, and one that
  every rank runs (``torch.optim.AdamW`` given the parameters) neither.
* *same layout*: elementwise operators on tensors of one placement and shape run on the local
  pieces (row blocks, split ranges).
* row blocks otherwise: DTensor's own rules (``Shard(0)`` is FSDP2's form).
* anything else (tensors of different owners together, a split tensor reshaped): the pieces
  are gathered to full tensors first (a collective, as DTensor redistributes), the operator runs
  on them, and an in-place result writes back this rank's piece. Slow, never wrong.

Reading a value (``item()``, ``bool()``) of a held tensor is a collective over the mesh, as it is
for any DTensor: every rank must ask. ``full_tensor()`` / ``redistribute(Replicate())`` gather.
DCP's checkpoint protocol is implemented here, so a checkpoint reshards across world sizes and
layouts, and ``torch.load(weights_only=True)`` accepts these tensors.
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

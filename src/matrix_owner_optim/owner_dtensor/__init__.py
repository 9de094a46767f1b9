"""The owner layout as a DTensor: what a sharded parameter, its gradient and its state are.

(``placement.py``: the placements; ``base.py`` / ``tensor.py``: the tensor; ``ops.py``: operator
classes; ``dispatch.py``: the rule each call takes; ``decisions.py``: decisions cached;
``values.py``: whole values, pieces, the ``copy_`` rule; ``holder_agreement.py``; ``lists.py``:
list operators; ``two_dim.py``: 2D meshes; ``assign.py``: ``t.data =``; ``dcp.py``: DCP's
checkpoint protocol. DESIGN.md, "The representation", describes the rules once.)

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

Operators (``__torch_dispatch__``) are exact on every rank or refused on every rank. Each call
takes one rule, chosen from the operator's class (``ops.py``: read from its schema and tags) and
the arguments' placements, shapes and meshes, never from a value or a piece's size, so every rank
takes the same rule and issues the same collectives (``dispatch.py`` lists the rules in order):

* *refused*: torch.distributed collectives given an owner-layout tensor (as stock DTensor refuses
  them) and storage surgery (``set_``, ``resize_``): ``NotImplementedError`` on every rank, naming
  the operator and what to do.
* *lists* (``_foreach_*``, ``_fused_*``, GradScaler's ``_amp_foreach_*``): per element; elements of
  one layout run on local pieces in one kernel call, others on whole values; GradScaler's
  ``found_inf`` is agreed over the mesh.
* *value reads* (``item()``, ``bool()``, ``tolist()``, ``equal``): collectives every rank takes
  part in; every rank gets the value.
* *random* (``uniform_``, ``normal_``, ``nn.init.*``, dropout): every rank draws the whole tensor
  and keeps its piece, so under one seed a parameter gets the values one process draws for it.
* *holder-local*: all tensors of an operator held by one rank (replicated values and plain
  tensors taken as replicated) are computed by that rank alone, whatever the operator
  (pointwise, views, matmuls, reductions); the others compute shapes on ``meta`` and hold an empty
  piece; a 0-dim result is a ``Partial`` (``_NormPartial`` for norms) with zeros elsewhere, which
  is exactly true, so torch's reductions over many tensors (``clip_grad_norm_``) sum the owners'
  values in one all-reduce and an optimizer step on the owner issues no collective.
* *same layout*: pointwise operators on tensors of one placement and shape: local pieces.
* *row blocks*: ``Shard(0)`` (FSDP2's form) follows DTensor's own sharding rules.
* *gathered*: anything else: whole values on every rank, the operator, and every argument it
  writes (in place, ``out=``, lists) gets its piece back. Slow, never wrong.

``full_tensor()`` / ``redistribute(Replicate())`` return new storage on every rank, the holder
included. DCP's checkpoint protocol is implemented here, so a checkpoint reshards across world
sizes and layouts, and ``torch.load(weights_only=True)`` accepts these tensors.
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

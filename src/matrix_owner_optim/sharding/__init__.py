"""Owner-shaped ZeRO-3 runtime: ``fully_shard``, its units and collectives, global-norm clipping.

``fully_shard`` places every matrix whole on one owner rank (empty elsewhere) following a
model-wide :class:`~matrix_owner_optim.planning.ShardingPlan`; forward all-gathers and backward
reduce-scatters each unit's owner segments once per pass, so ``optimizer.step()`` moves nothing.
"""

from torch.distributed.fsdp import MixedPrecisionPolicy

from .api import fully_shard
from .clip import clip_grad_norm_
from .module import OwnerShardedModule, UnshardHandle, register_fsdp_forward_method

__all__ = [
    "fully_shard",
    "OwnerShardedModule",
    "MixedPrecisionPolicy",
    "UnshardHandle",
    "clip_grad_norm_",
    "register_fsdp_forward_method",
]

"""Owner-shaped ZeRO-3 runtime: ``fully_shard``, its units and collectives, global-norm clipping
(DESIGN.md, "The runtime").
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

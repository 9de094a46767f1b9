"""One rank (W=1): units that move nothing skip the machinery that exists to move data.

At one rank with no replicas every resident piece is the whole tensor (owned matrices and
``rows`` tensors alike), so compute reads the resident storage and a unit is *local-only*
(``ShardedUnit.local_only``): no post-backward identity is registered, the end-of-backward
callback lands the gradients. A mixed-precision unit (a low-precision compute copy) is not
local-only and keeps the per-unit post-backward. Checked in one gloo process against the plain
model: gradients, post-accumulate-grad hook calls (once per parameter per backward) and the
parameters after three AdamW steps, bitwise.
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import pytest
import torch

from _ranks import spawn_ranks
from _ref import fully_shard_model
from matrix_owner_optim.sharding import MixedPrecisionPolicy
from matrix_owner_optim.sharding.module import context_of
from matrix_owner_optim.tensors import local_tensor
from matrix_owner_optim.toolbox.models.gpt import GPT, GPTConfig

pytestmark = pytest.mark.multirank

CFG = GPTConfig(vocab_size=14, n_layers=2, d_model=32, n_heads=4, seq_len=8)


def _job(rank: int, W: int) -> dict[str, Any]:
    torch.manual_seed(0)
    plain = GPT(CFG)
    owner = fully_shard_model(copy.deepcopy(plain))
    calls: Counter[str] = Counter()
    for n, p in owner.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _p, n=n: calls.update([n]))
    gen = torch.Generator().manual_seed(1)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (plain, owner)]
    grads_equal, hook_calls = [], []
    for _ in range(3):
        x = torch.randint(0, CFG.vocab_size, (4, CFG.seq_len), generator=gen)
        for m in (plain, owner):
            m(x, x).backward()
        grads_equal.append(
            all(
                torch.equal(local_tensor(q.grad), p.grad)
                for (_, p), (_, q) in zip(plain.named_parameters(), owner.named_parameters(), strict=True)
            )
        )
        hook_calls.append(dict(calls))
        calls.clear()
        for o in opts:
            o.step()
            o.zero_grad()
    ctx = context_of(owner)
    mixed = fully_shard_model(GPT(CFG), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    mixed(x, x).backward()
    return {
        "local_only": [u.local_only for u in ctx.units],
        "rows_alias": {
            h.shard.fqn: h.unsharded.untyped_storage().data_ptr() == h.local.untyped_storage().data_ptr()
            for u in ctx.units
            for h in u.handles
            if h.shard.owner is None
        },
        "mixed_local_only": [u.local_only for u in context_of(mixed).units],
        "grads_equal": grads_equal,
        "hook_calls": hook_calls,
        "names": [n for n, _ in owner.named_parameters()],
        "params_equal": all(
            torch.equal(p.detach(), local_tensor(q.detach()))
            for p, q in zip(plain.parameters(), owner.parameters(), strict=True)
        ),
    }


def test_one_rank_units_are_local_only_and_equal_the_plain_model() -> None:
    (r,) = spawn_ranks(_job, 1)
    assert all(r["local_only"]), r["local_only"]
    assert r["rows_alias"] and all(r["rows_alias"].values()), r["rows_alias"]  # embeddings: rows tensors
    assert not any(r["mixed_local_only"]), r["mixed_local_only"]
    assert r["grads_equal"] == [True, True, True]
    once = dict.fromkeys(r["names"], 1)
    assert r["hook_calls"] == [once, once, once], r["hook_calls"]
    assert r["params_equal"]

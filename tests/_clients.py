"""Shared pieces of the client tests: tiny transformers decoders built in code, their data, the
optimizer settings, and one-process references.

Every model is built from a config in code (no download), seeded, in float32. The reference
is the same ``OwnerRoutedOptimizer`` in one process on the unsharded model over the global batch
(every rank's micro-batch concatenated), so DDP-averaged gradients are its gradients.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

VOCAB, SEQ = 64, 8
GLOBAL_BATCH = 6  # divisible by 2 and 3: rank r of W takes rows [r*6/W, (r+1)*6/W)
STEPS = 3
# float32 Newton-Schulz: the parity tolerance is then round-off of the summation orders
OPTIM = dict(
    matrix="muon",
    matrix_options={"lr": 0.02, "weight_decay": 0.01, "ns_dtype": torch.float32},
    tail="adamw",
    tail_options={"lr": 3e-3, "weight_decay": 0.01, "eps": 1e-6},
)


def _common() -> dict[str, Any]:
    return dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )


def build_hf(kind: str, seed: int = 0) -> nn.Module:
    """A tiny transformers decoder: ``llama`` (GQA: 4 query heads over 2 key/value heads, untied
    head), ``qwen2`` (GQA, head tied to the embedding), ``mixtral`` and ``qwen3_moe`` (4 fused
    experts, top 2)."""
    import transformers as tf

    torch.manual_seed(seed)
    if kind == "llama":
        cfg = tf.LlamaConfig(**_common(), tie_word_embeddings=False)
        model = tf.LlamaForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = tf.Qwen2Config(**_common(), tie_word_embeddings=True)
        model = tf.Qwen2ForCausalLM(cfg)
    elif kind == "mixtral":
        cfg = tf.MixtralConfig(**_common(), num_local_experts=4, num_experts_per_tok=2)
        model = tf.MixtralForCausalLM(cfg)
    elif kind == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(
            **_common(),
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
        model = tf.Qwen3MoeForCausalLM(cfg)
    else:
        raise ValueError(kind)
    return model.float()


HF_KINDS = ("llama", "qwen2", "mixtral", "qwen3_moe")


def global_tokens(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)


def local_tokens(step: int, rank: int, world_size: int) -> torch.Tensor:
    per = GLOBAL_BATCH // world_size
    return global_tokens(step)[rank * per : (rank + 1) * per]


def hf_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens, labels=tokens).loss


def train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    batch: Callable[[int], torch.Tensor],
    steps: int = STEPS,
    start: int = 0,
) -> list[float]:
    losses = []
    for step in range(start, start + steps):
        loss = hf_loss(model, batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def reference_params(kind: str, steps: int = STEPS) -> dict[str, torch.Tensor]:
    """Parameters after ``steps`` steps in one process over the global batch."""
    from matrix_owner_optim import OwnerRoutedOptimizer

    model = build_hf(kind)
    train(model, OwnerRoutedOptimizer(model, **copy.deepcopy(OPTIM)), global_tokens, steps)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (collective on a sharded model), keyed by the model's own names."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {n: sd[n].detach().clone() for n, _ in model.named_parameters()}


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max(((float((a[n] - b[n]).abs().max()), n) for n in a), key=lambda t: t[0])


def changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> list[str]:
    """Names of the parameters that moved."""
    return [n for n in before if not torch.equal(before[n], after[n])]

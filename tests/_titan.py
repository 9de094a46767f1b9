"""torchtitan's own models and parallelize functions, driven on CPU gloo ranks.

The tiny models come from torchtitan's config builders (``Llama3Model.Config`` with
``_build_llama3_layers``, float32). torchtitan's parallelize functions are then called as its
Trainer calls them. The CPU adaptations, each the least that lets torchtitan's code run on gloo:

* ``ParallelDims`` builds its meshes on ``torchtitan.tools.utils.device_type``, which is
  ``"cuda"`` on a machine without an accelerator; :func:`parallel_dims` points the
  ``parallel_dims`` module's name at ``"cpu"`` before building them (torchtitan's code is
  otherwise unchanged; torch is not touched);
* ``spmd_backend="partial_dtensor"``: the backend that makes tensor- and expert-parallel
  parameters DTensors on their meshes (the layout this package reads); the default
  ``spmd_types`` backend keeps them plain tensors typed by its own checker;
* attention is torchtitan's ``ScaledDotProductAttention`` (causal) instead of FlexAttention,
  which needs per-document block masks and compiled kernels;
* no ``torch.compile``, no activation checkpointing, no mixed precision (``float32`` params);
* torchtitan disables FSDP's gradient division (its loss is divided by the global token count),
  which FSDP carries out with ``ReduceOp.PREMUL_SUM(1.0)``; gloo has no ``PREMUL_SUM``, so
  :func:`sum_reductions` calls FSDP's public ``set_force_sum_reduction_for_comms(True)``: a
  plain ``SUM``, divided by the same factor 1.0.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

VOCAB, DIM, HEADS, HIDDEN, LAYERS, SEQ = 32, 16, 4, 32, 2, 8


def _sdpa(layers: list[Any]) -> list[Any]:
    from torchtitan.models.common.attention import ScaledDotProductAttention

    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return layers


def llama_config() -> Any:
    """A tiny Llama3 (fused wqkv, 2 layers, dim 16, 4 heads, untied head) from torchtitan's
    builders, as its ``debugmodel`` is built."""
    import torchtitan.models.llama3 as llama3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm

    return llama3.Llama3Model.Config(
        dim=DIM,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=llama3._output_linear_init(DIM)),
        layers=_sdpa(
            llama3._build_llama3_layers(
                fuse_qkv=True,
                n_layers=LAYERS,
                dim=DIM,
                n_heads=HEADS,
                hidden_dim=HIDDEN,
                rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=4 * SEQ, theta=10000, scaling="none"),
                attn_backend="flex",
            )
        ),
    )


def parallelism(**degrees: int) -> Any:
    """torchtitan's ``ParallelismConfig`` with these degrees, on the DTensor backend."""
    from torchtitan.config import ParallelismConfig

    return ParallelismConfig(spmd_backend="partial_dtensor", **degrees)


def build(config: Any, par: Any, seed: int = 0) -> nn.Module:
    """The model, its sharding declared for ``par`` (``update_from_config``, as the Trainer
    does), built and initialized with torchtitan's ``init_weights`` under ``seed``: the same
    weights with or without parallelism, since parallelize distributes the full tensors."""

    class _JobConfig:  # update_from_config reads only ``.parallelism`` off non-Trainer configs
        parallelism = par

    config.update_from_config(config=_JobConfig)
    torch.manual_seed(seed)
    model = config.build()
    with torch.no_grad():
        model.init_weights()
    return model


def parallel_dims(par: Any, world_size: int) -> Any:
    """torchtitan's ``ParallelDims`` for ``par``, its meshes on CPU (see the module docstring)."""
    import torchtitan.distributed.parallel_dims as pd_module

    pd_module.device_type = "cpu"  # type: ignore[attr-defined]
    dims = pd_module.ParallelDims.from_config(par, world_size)
    dims.build_mesh()
    return dims


def sum_reductions(model: nn.Module) -> None:
    """FSDP's reduce-scatter as ``SUM`` (gloo has no ``PREMUL_SUM``); the factor stays 1.0."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def parallelize(model: nn.Module, parallelize_fn: Any, par: Any, world_size: int) -> Any:
    """``parallelize_fn`` (torchtitan's ``parallelize_llama`` / ``parallelize_qwen3`` ...)
    with the keyword configs torchtitan's Trainer passes; returns the ``ParallelDims``."""
    from torchtitan.config import CompileConfig, TrainingConfig

    dims = parallel_dims(par, world_size)
    parallelize_fn(
        model,
        parallel_dims=dims,
        training=TrainingConfig(mixed_precision_param="float32"),
        parallelism=par,
        compile_config=CompileConfig(),
        ac_config=None,
        dump_folder="",
    )
    sum_reductions(model)
    return dims


def batches(steps: int, batch: int, seed: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` global batches of ``batch`` token rows and their targets."""
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, VOCAB, (batch, SEQ), generator=g), torch.randint(0, VOCAB, (batch, SEQ), generator=g))
        for _ in range(steps)
    ]


def loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor, global_tokens: int) -> torch.Tensor:
    """torchtitan's loss normalization: the sum over this rank's tokens divided by the global
    token count, so the dp-summed gradients (FSDP's division is off) are the global mean's."""
    logits = model(tokens)
    if hasattr(logits, "full_tensor"):
        logits = logits.full_tensor()
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum") / global_tokens

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
* MoE experts (:class:`Float32GroupedExperts`): torchtitan's ``GroupedExperts`` casts the expert
  matmuls to bfloat16 for ``torch._grouped_mm``. Under expert parallelism each ep rank's partial
  expert gradient is then rounded to bfloat16 before FSDP sums the partials over efsdp, which
  moves expert gradients by ~2e-3 relative against one process (measured): model numerics that
  would hide any optimizer error. The subclass runs the same grouped matmuls in float32;
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


def llama_config(fuse_qkv: bool = True) -> Any:
    """A tiny Llama3 (2 layers, dim 16, 4 heads, untied head) from torchtitan's builders, as its
    ``debugmodel`` is built: fused ``wqkv`` by default; ``fuse_qkv=False`` gives separate
    ``wq``/``wk``/``wv`` for torch's state-dict tools (see :func:`qwen3_moe_config`)."""
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
                fuse_qkv=fuse_qkv,
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
    """torchtitan's ``ParallelismConfig`` with these degrees, on the DTensor backend, which is
    also made the process's active backend (``set_spmd_backend``, as torchtitan's Trainer does:
    its MoE token dispatch reads it)."""
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed.utils import set_spmd_backend

    set_spmd_backend("partial_dtensor")
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


def owner_tp_llama(world_size: int, fuse_qkv: bool = True) -> tuple[nn.Module, Any]:
    """The tiny Llama3 with the TP plan torchtitan's parallelize_llama applies
    (``model.parallelize``: vocab-parallel embedding, colwise q/k/v (or fused wqkv), w1, w3 and
    lm_head, rowwise wo and w2, SequenceParallel norms) on dp_shard=2, tp=2, and this package's
    fully_shard over its fsdp mesh in place of torchtitan's apply_fsdp_to_decoder (the same units:
    the embedding, each block, norm with lm_head, the root), gradient division off as
    torchtitan's (its loss is divided by the global token count). The model and its dp mesh."""
    from _ref import fully_shard_model
    from matrix_owner_optim.sharding import OwnerShardedModule

    par = parallelism(data_parallel_shard_degree=2, tensor_parallel_degree=2)
    model = build(llama_config(fuse_qkv=fuse_qkv), par)
    dims = parallel_dims(par, world_size)
    model.parallelize(dims)
    dp_mesh = dims.get_mesh("fsdp")
    blocks = [model.tok_embeddings, *model.layers.values(), [model.norm, model.lm_head]]
    fully_shard_model(model, blocks=blocks, mesh=dp_mesh)
    for m in model.modules():
        if isinstance(m, OwnerShardedModule):
            m.set_gradient_divide_factor(1.0)
    return model, dp_mesh


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


EXPERTS, TOP_K, MOE_HIDDEN, HEAD_DIM, KV_HEADS = 4, 2, 8, 4, 2


def _float32_experts_class() -> type:
    from dataclasses import dataclass

    from torchtitan.models.common.moe import GroupedExperts

    class Float32GroupedExperts(GroupedExperts):
        """torchtitan's ``GroupedExperts``, its grouped matmuls in float32 (see the module doc)."""

        @dataclass(kw_only=True, slots=True)
        class Config(GroupedExperts.Config):
            pass

        def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
            w1, w2, w3 = (
                w.to_local() if hasattr(w, "to_local") else w for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD)
            )
            offsets = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
            h = nn.functional.silu(torch._grouped_mm(x_RD, w1.transpose(-2, -1), offs=offsets))
            h = h * torch._grouped_mm(x_RD, w3.transpose(-2, -1), offs=offsets)
            return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offsets)

    return Float32GroupedExperts


def qwen3_moe_config() -> Any:
    """A tiny Qwen3-MoE (2 layers, dim 16, 4 query heads over 2 key/value heads, qk norms,
    4 routed experts of hidden size 8, top 2) from torchtitan's builders, as its
    ``debugmodel_moe`` is built, with separate q/k/v projections (``fuse_qkv=False``, as its
    ``debugmodel_non_fused_qkv``): the fused ``wqkv`` renames itself to ``wq``/``wk``/``wv`` in a
    ``state_dict`` hook, which torch's ``get_model_state_dict`` cannot map back to parameters
    (torchtitan's own checkpointer wraps the model instead)."""
    import torchtitan.models.qwen3 as qwen3
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear

    config = qwen3.Qwen3Model.Config(
        vocab_size=VOCAB,
        dim=DIM,
        norm=qwen3._qwen3_norm(DIM),
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=qwen3._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=qwen3._LINEAR_INIT),
        layers=_sdpa(
            qwen3._build_qwen3_moe_layers(
                fuse_qkv=False,  # see qwen3_moe_config's docstring
                n_layers=LAYERS,
                dim=DIM,
                n_heads=HEADS,
                n_kv_heads=KV_HEADS,
                head_dim=HEAD_DIM,
                moe_hidden_dim=MOE_HIDDEN,
                num_experts=EXPERTS,
                top_k=TOP_K,
                attn_backend="flex",
                rope=CosSinRoPE.Config(dim=HEAD_DIM, max_seq_len=4 * SEQ, theta=1000000.0),
                moe_comm_backend="standard",
            )
        ),
    )
    experts = _float32_experts_class()
    for layer in config.layers:
        inner = layer.moe.routed_experts.inner_experts
        layer.moe.routed_experts.inner_experts = experts.Config(
            dim=inner.dim, hidden_dim=inner.hidden_dim, num_experts=inner.num_experts, param_init=inner.param_init
        )
    return config

"""torchtune 0.6.1's distributed full-finetune recipe flow on the owner layout, at W=2 (run by
tests/test_clients_torchtune.py under the torchtune venv of tests/_torchtune_env.py; prints one
JSON line of measurements).

What ``recipes/full_finetune_distributed.py`` does, step by step, with a tiny ``llama3``:

1. build the model on ``meta``;
2. ``training.shard_model`` (``fully_shard`` on every ``TransformerSelfAttentionLayer``, then the
   root): torchtune calls the ``fully_shard`` its ``training._distributed`` module imported, so
   the one line a user changes is that name (torchtune has no other hook; torch is untouched);
3. ``rope_init()`` on the real device;
4. ``training.load_from_full_model_state_dict``: with torch 2.13 torchtune 0.6.1 takes its own
   path (``distribute_tensor`` of each full tensor over the parameter's mesh and placements,
   then ``load_state_dict(assign=True)``; its ``set_model_state_dict`` path is switched off);
5. the optimizer over ``model.parameters()`` (here ``OwnerRoutedOptimizer``);
6. train; checkpoint with ``training.gather_cpu_state_dict`` and
   ``training.get_full_optimizer_state_dict`` (full, on rank 0, which writes the files that every
   rank reads back: a broadcast here);
7. resume: a second meta model through 1-4 from the saved model state, a fresh optimizer given
   ``training.load_from_full_optimizer_state_dict``, train on.

The reference is the same ``llama3`` and optimizer in one process over the global batch, 3 steps
straight; the sharded run trains 2, checkpoints, resumes and trains the 3rd.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from matrix_owner_optim import OwnerRoutedOptimizer, fully_shard  # noqa: E402
from matrix_owner_optim.toolbox.launch import spawn_ranks  # noqa: E402

W = 2
STEPS = 3  # 2, a checkpoint, 1 more
SAVE_AT = 2
VOCAB, SEQ, MICRO = 64, 8, 2
OPTIM: dict[str, Any] = dict(
    matrix="muon",
    matrix_options={"lr": 0.02, "weight_decay": 0.01, "ns_dtype": torch.float32},
    tail="adamw",
    tail_options={"lr": 3e-3, "weight_decay": 0.01, "eps": 1e-6},
)


def build(device: str | torch.device = "cpu") -> torch.nn.Module:
    from torchtune.models.llama3._component_builders import llama3

    torch.manual_seed(0)
    with torch.device(device):
        return llama3(
            vocab_size=VOCAB,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            embed_dim=32,
            max_seq_len=64,
            intermediate_dim=64,
        )


def tokens(step: int, rank: int = 0, world: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(500 + step)
    full = torch.randint(0, VOCAB, (W * MICRO, SEQ + 1), generator=g)
    per = full.shape[0] // world
    return full[rank * per : (rank + 1) * per]


def loss_of(model: torch.nn.Module, t: torch.Tensor) -> torch.Tensor:
    logits = model(t[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), t[:, 1:].flatten())


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range, rank: int, world: int) -> list[float]:
    losses = []
    for s in steps:
        loss = loss_of(model, tokens(s, rank, world))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def recipe_model(full_sd: dict[str, torch.Tensor], rank: int) -> torch.nn.Module:
    """Steps 1-4 of the recipe."""
    import torchtune.training._distributed as tt_dist
    from torchtune import training
    from torchtune.modules import TransformerSelfAttentionLayer

    # --8<-- [start:shard_name]
    tt_dist.fully_shard = fully_shard  # the one line: torchtune's shard_model calls this name
    # --8<-- [end:shard_name]
    with torch.device("meta"):
        model = build("meta")
    training.shard_model(
        model,
        [lambda n, m: isinstance(m, TransformerSelfAttentionLayer)],
        cpu_offload=False,
        reshard_after_forward=True,
    )
    with torch.device("cpu"):
        for m in model.modules():
            if hasattr(m, "rope_init"):
                m.rope_init()
    training.load_from_full_model_state_dict(model, full_sd, torch.device("cpu"), strict=True)
    training.validate_no_params_on_meta_device(model)
    return model


def job(rank: int, world: int, full_sd: dict[str, torch.Tensor]) -> dict[str, Any]:
    from torchtune import training

    model = recipe_model(full_sd, rank)
    sharded = sorted({type(p).__name__ for p in model.parameters()})
    # --8<-- [start:optimizer]
    opt = OwnerRoutedOptimizer(model.parameters(), **copy.deepcopy(OPTIM))
    # --8<-- [end:optimizer]
    losses = train(model, opt, range(SAVE_AT), rank, world)
    saved = [
        training.gather_cpu_state_dict(model, rank == 0),
        training.get_full_optimizer_state_dict(model, opt, rank == 0),
    ]
    torch.distributed.broadcast_object_list(saved, src=0)  # rank 0 writes, every rank reads the file
    saved_model, saved_opt = saved
    step_types = sorted({type(v["step"]).__name__ for v in saved_opt["state"].values() if "step" in v})

    resumed = recipe_model(saved_model, rank)
    # --8<-- [start:resume]
    opt2 = OwnerRoutedOptimizer(resumed.parameters(), **copy.deepcopy(OPTIM))
    training.load_from_full_optimizer_state_dict(resumed, opt2, saved_opt, torch.device("cpu"))
    # --8<-- [end:resume]
    losses += train(resumed, opt2, range(SAVE_AT, STEPS), rank, world)
    mean = torch.tensor(losses, dtype=torch.float64)
    torch.distributed.all_reduce(mean)
    final = training.gather_cpu_state_dict(resumed, rank == 0)
    return {
        "sharded": sharded,
        "losses": (mean / world).tolist(),
        "params": {k: v.detach().clone() for k, v in final.items()},
        "step_types": step_types,
    }


def main() -> None:
    ref = build()
    full_sd = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    # the model itself: roles by module type, as the plan gives the sharded parameters theirs
    ref_losses = train(ref, OwnerRoutedOptimizer(ref, **copy.deepcopy(OPTIM)), range(STEPS), 0, 1)
    ref_params = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    moved = max(float((ref_params[k] - v).abs().max()) for k, v in full_sd.items())
    results = spawn_ranks(job, W, full_sd)
    out: dict[str, Any] = {"moved": moved, "ranks": []}
    for r in results:
        params = r["params"]
        out["ranks"].append(
            {
                "sharded": r["sharded"],
                "loss_err": max(abs(a - b) for a, b in zip(r["losses"], ref_losses, strict=True)),
                "param_err": max(float((params[k] - v).abs().max()) for k, v in ref_params.items()) if params else None,
                "param_keys_match": (not params) or params.keys() == ref_params.keys(),
                "step_types": r["step_types"],
            }
        )
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()

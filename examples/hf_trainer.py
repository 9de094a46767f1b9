"""The Hugging Face Trainer with OwnerRoutedOptimizer: train, checkpoint, resume.

    python examples/hf_trainer.py --steps 4 --out /tmp/trainer

Versus the stock Trainer script one line changes: ``optimizers=(OwnerRoutedOptimizer(model,
...), None)`` hands the Trainer Muon for every weight matrix and AdamW for the rest (embeddings,
head, norms). The Trainer still builds its own LR schedule on it (``None``), clips gradients
(``max_grad_norm``), and saves and restores the optimizer with its checkpoints.

The script trains a tiny Llama built from a config (no download) for ``--steps`` steps with a
checkpoint every ``--steps // 2``, then plays a restart: a new Trainer with a fresh model (other
random weights) and optimizer resumes from the half-way checkpoint and finishes. It prints both
runs' losses and the largest difference of the final parameters (0 when the weights, the
optimizer state, the schedule and the data order all came back).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from matrix_owner_optim import OwnerRoutedOptimizer

VOCAB, SEQ, BATCH = 64, 16, 4
# Muon on the weight matrices, AdamW on embeddings, head and norms; each with its own lr
OPTIMIZER = dict(matrix="muon", matrix_options={"lr": 0.02}, tail="adamw", tail_options={"lr": 3e-3})


def build_model(seed: int) -> torch.nn.Module:
    """A tiny Llama (GQA: 4 query heads over 2 key/value heads), from a config, no download."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg).float()


def dataset(n: int) -> list[dict[str, torch.Tensor]]:
    """Counting sequences mod VOCAB (learnable), from a fixed seed."""
    g = torch.Generator().manual_seed(0)
    seqs = (torch.randint(0, VOCAB, (n, 1), generator=g) + torch.arange(SEQ)) % VOCAB
    return [{"input_ids": s, "labels": s} for s in seqs]


def run(out: Path, steps: int, save_every: int, seed: int, resume: str | None = None) -> tuple[Trainer, list[float]]:
    """Train to ``steps`` (from the checkpoint ``resume`` if given); the Trainer and its losses."""
    model = build_model(seed)
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=BATCH,
        save_strategy="steps",
        save_steps=save_every,
        logging_steps=1,
        lr_scheduler_type="cosine",
        max_grad_norm=1.0,
        use_cpu=not torch.cuda.is_available(),
        report_to=[],
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    # --8<-- [start:trainer]
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=dataset(steps * BATCH),
        # stock: no optimizers argument (the Trainer builds AdamW)
        optimizers=(OwnerRoutedOptimizer(model, **OPTIMIZER), None),
    )  # <- the one line that changes
    # --8<-- [end:trainer]
    trainer.train(resume_from_checkpoint=resume)
    # the log history comes back with a checkpoint: keep this run's steps
    first = 0 if resume is None else int(Path(resume).name.split("-")[-1])
    return trainer, [h["loss"] for h in trainer.state.log_history if "loss" in h and h["step"] > first]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", required=True, help="directory of the Trainer's output and checkpoints")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error(f"--steps must be at least 2 (a checkpoint half way), got {args.steps}")
    half = args.steps // 2
    out = Path(args.out)

    print(f"uninterrupted run, checkpoint every {half} steps:")
    straight, straight_losses = run(out / "straight", args.steps, half, seed=0)
    ckpt = out / "straight" / f"checkpoint-{half}"
    print(f"resumed run (fresh model and optimizer) from {ckpt}:")
    resumed, resumed_losses = run(out / "resumed", args.steps, half, seed=1, resume=str(ckpt))

    final = dict(straight.model.named_parameters())
    diff = max(float((final[n] - p).detach().abs().max()) for n, p in resumed.model.named_parameters())
    print(f"resumed from step {half}: losses {' '.join(f'{v:.4f}' for v in resumed_losses)}")
    print(f"uninterrupted, same steps: losses {' '.join(f'{v:.4f}' for v in straight_losses[half:])}")
    print(f"final loss: uninterrupted {straight_losses[-1]:.4f} resumed {resumed_losses[-1]:.4f}")
    print(f"max |param diff| resumed vs uninterrupted: {diff:.3e}")


if __name__ == "__main__":
    main()

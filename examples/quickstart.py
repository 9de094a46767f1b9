"""The ten-line use of the package (the README's and the Quickstart's code), run as written.

    torchrun --nproc-per-node 2 examples/quickstart.py

Two CPU ranks (gloo) train a small GPT on the owner layout: ``fully_shard`` on every block, then
the root (FSDP2's call pattern), ``OwnerRoutedOptimizer`` with Muon on the weight matrices and
AdamW on the rest, torch's ``clip_grad_norm_``, and a ``CommCounter`` around each step that checks
the step moved zero bytes. Rank 0 prints the first and last loss (``tests/test_docs.py`` runs it
and checks that the loss fell and every rank exited with 0).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from matrix_owner_optim.toolbox.launch import shutdown_process_groups

VOCAB, SEQ, BATCH = 64, 16, 4


def batches(steps: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Counting sequences mod VOCAB (learnable), this rank's micro-batch of each step."""
    import torch.distributed as dist

    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
        seq = (torch.randint(0, VOCAB, (BATCH, 1), generator=g) + torch.arange(SEQ + 1)) % VOCAB
        yield seq[:, :-1], seq[:, 1:]


def run() -> list[float]:
    """The ten lines, between the markers the docs include; the losses of rank 0."""
    losses = []
    # --8<-- [start:use]
    import torch
    import torch.distributed as dist

    from matrix_owner_optim import CommCounter, OwnerRoutedOptimizer, fully_shard
    from matrix_owner_optim.toolbox.models.gpt import GPT, GPTConfig

    dist.init_process_group("gloo")  # torchrun starts the ranks; "nccl" on GPUs
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layers=2, d_model=32, n_heads=2))
    for block in model.layers:
        fully_shard(block)  # FSDP2's call pattern: the blocks first ...
    fully_shard(model)  # ... then the root; each weight matrix now lives whole on one rank
    opt = OwnerRoutedOptimizer(
        model, matrix="muon", matrix_options={"lr": 0.02}, tail="adamw", tail_options={"lr": 3e-3}
    )
    for x, y in batches(steps=20):
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the global norm: parameters are DTensors
        with CommCounter() as cc:
            opt.step()  # Muon on each matrix's owner, AdamW on the rest
        assert cc.bytes() == 0  # the step moved nothing
        opt.zero_grad()
        # --8<-- [end:use]
        losses.append(float(loss.detach()))
    if dist.get_rank() == 0:
        print(f"{dist.get_world_size()} ranks, owner layout, Muon + AdamW: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
        print(f"optimizer step bytes: {cc.bytes()}")
    return losses


def main() -> None:
    run()
    shutdown_process_groups()  # join gloo's threads before exit (see toolbox/launch.py)


if __name__ == "__main__":
    main()

"""PyTorch Lightning's ``ModelParallelStrategy`` (Lightning 2.6) with the owner layout, as its docs
show FSDP2: ``fully_shard`` in ``configure_model`` over the strategy's data-parallel mesh,
``OwnerRoutedOptimizer`` in ``configure_optimizers``, 2 CPU processes (gloo).

The job trains 2 steps and saves with ``trainer.save_checkpoint`` (Lightning's distributed
checkpoint: DCP of ``get_model_state_dict`` / ``get_optimizer_state_dict``); a fresh module and
Trainer resume from it (``fit(ckpt_path=...)``) for 2 more steps. Losses of every step and the
final parameters equal 4 uninterrupted steps in one process on the global batch (the strategy's
each rank reads its own 2 of each global batch of 4 sequences).

Lightning runs inside ranks the suite spawns: the environment variables of an external launcher
(``LOCAL_RANK``, ``WORLD_SIZE``, ...) make it join the existing process group instead of
re-launching the script.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from _ranks import spawn_ranks
from _ref import ADAMW_OPTS, CFG, MUON_OPTS, fully_shard_model
from _tolerances import CLIENT_ATOL
from matrix_owner_optim import OwnerRoutedOptimizer
from matrix_owner_optim.toolbox.models.gpt import GPT

pytestmark = pytest.mark.multirank

W = 2
MICRO = 2  # sequences per rank per step
STEPS = 4  # 2 before the checkpoint, 2 after
OPTIM: dict[str, Any] = dict(matrix="muon", matrix_options=MUON_OPTS, tail="adamw", tail_options=ADAMW_OPTS)


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(31)
    idx = torch.randint(0, CFG.vocab_size, (STEPS * W * MICRO, CFG.seq_len), generator=g)
    tgt = torch.randint(0, CFG.vocab_size, (STEPS * W * MICRO, CFG.seq_len), generator=g)
    return TensorDataset(idx, tgt)


def _micro_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s 2 of the 4 sequences of ``step``. Chosen by the step, not by the position of
    a DataLoader: a plain DataLoader is not resumable, and Lightning re-reads its first batches
    after a resume mid-epoch, which is about data loading, not about this package."""
    idx, tgt = _data().tensors
    at = step * W * MICRO + rank * MICRO
    return idx[at : at + MICRO], tgt[at : at + MICRO]


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    """4 steps in one process: step s reads the 4 sequences the two ranks read at step s."""
    model = _gpt()
    opt = OwnerRoutedOptimizer(model, **copy.deepcopy(OPTIM))
    idx, tgt = _data().tensors
    losses = []
    per = W * MICRO
    for s in range(STEPS):
        loss = model(idx[s * per : (s + 1) * per], tgt[s * per : (s + 1) * per])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _job(rank: int, world: int, ckpt: str) -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))

    class GPTModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _gpt()
            self.losses: list[float] = []

        # --8<-- [start:lightning]
        def configure_model(self) -> None:
            fully_shard_model(self.model, mesh=self.device_mesh["data_parallel"])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return OwnerRoutedOptimizer(self.model, **copy.deepcopy(OPTIM))

        # --8<-- [end:lightning]

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = self.model(*_micro_batch(self.trainer.global_step, rank))
            mean = loss.detach().clone()
            torch.distributed.all_reduce(mean)  # the global batch's loss, for the comparison
            self.losses.append(float(mean) / world)
            return loss

    def trainer(max_steps: int) -> Any:
        return pl.Trainer(
            accelerator="cpu",
            devices=world,
            strategy=ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
            max_steps=max_steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            use_distributed_sampler=False,  # each rank's loader holds its own micro-batches
        )

    ticks = DataLoader(range(STEPS), batch_size=1)  # the step's data comes from global_step
    first = GPTModule()
    t1 = trainer(2)
    t1.fit(first, ticks)
    t1.save_checkpoint(ckpt)
    second = GPTModule()
    t2 = trainer(STEPS)
    t2.fit(second, ticks, ckpt_path=ckpt)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(second.model, options=StateDictOptions(full_state_dict=True))
    return {
        "losses": first.losses + second.losses,
        "params": {n: full[n].detach().clone() for n, _ in second.model.named_parameters()},
        "sharded": type(next(second.model.parameters())).__name__,
        "checkpoint_dir": Path(ckpt).is_dir(),
    }


def test_lightning_model_parallel_strategy_save_and_resume(tmp_path: Path) -> None:
    ref_losses, ref_params = _reference()
    results = spawn_ranks(_job, W, str(tmp_path / "lightning.ckpt"))
    for r in results:
        assert r["sharded"] == "OwnerDTensor" and r["checkpoint_dir"], r["sharded"]
        assert len(r["losses"]) == STEPS
        loss_err = max(abs(a - b) for a, b in zip(r["losses"], ref_losses, strict=True))
        param_err = max(float((r["params"][n] - p).abs().max()) for n, p in ref_params.items())
        print(f"lightning W=2, save at step 2, resume: loss {loss_err:.2g}, params {param_err:.2g}")
        assert loss_err <= CLIENT_ATOL and param_err <= CLIENT_ATOL, (loss_err, param_err, r["losses"], ref_losses)

"""The package's own ``fully_shard`` over the dp mesh on tensor-parallel blocks, on 4 gloo ranks.

torch's ``parallelize_module`` cuts each block (``ColwiseParallel`` w1, ``RowwiseParallel`` w2)
on the tp dim of a (dp=2, tp=2) mesh, then ``matrix_owner_optim.fully_shard(block,
mesh=mesh["dp"])`` per block and on the root: every parameter becomes an owner-layout DTensor on
the 2D mesh, ``(OwnerShard(0, ranges over the global rows), <TP placement>)``, the TP slice whole
on its dp owner (``owner_dtensor/two_dim.py``); forward and backward gather and reduce over dp
only, TP's own collectives run untouched; ``OwnerRoutedOptimizer`` assembles each matrix over
its owners' TP group and steps it whole (``optim/owner_tp_layout.py``). The model, batches and
reference are tests/_tp.py's two TP blocks (hidden sizes 10 and 6). One spawned job:

* torch.optim.Muon (``matrix="torch_muon"``) + AdamW, and this package's Muon with float32
  Newton-Schulz + AdamW, each with torch's ``clip_grad_norm_`` every step, against one process
  running the same optimizers on the unsharded model over the whole batch: clip norms (on every
  rank), losses and full parameters equal at the noise floor;
* the layouts: placements and local pieces as the plan says (the TP slice on the owner, empty
  elsewhere), and DCP's view of them (``compute_local_shape_and_global_offset``);
* every matrix's optimizer state only on its owners ``(o, *)``, and the resident bytes per rank;
* the 2D operator rules: a pointwise result keeps the layout (ranges included), a reduction or
  another unplaceable call is gathered (and written back), as on a 1D mesh;
* DCP of the model's state dict (each owner writes its TP slice) loads bitwise into a fresh
  planned model;
* a steady step's collectives: one all-gather over tp per dtype on the owners, the bytes
  ``bytes_per_step()`` says, after the step check over the TP group;
* what ``fully_shard`` still refuses at the call, naming the parameter: a TP block sharded over
  its own tp mesh, and HSDP x TP;
* torch's tools on the layout, against the same layout and one process: DCP of
  ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` (and the model's) resumes bitwise
  and continues bitwise; ``full_state_dict=True`` model and optimizer state dicts load bitwise;
  ``load_state_dict`` of full tensors and ``_foreach_copy_`` of full tensors set every piece;
  torch's AdamW given the parameters directly, fused and foreach, equals one process;
  ``GradScaler``'s ``unscale_`` gives the one-process clip norm, and an inf on one rank's piece
  makes every rank skip the step and halve the scale;
* torchtitan's Llama3 on this layout saves a DCP checkpoint at step 1 (``_titan_checkpoint``
  with ``source="owner_tp"``) that loads bitwise on the 1D owner layout at W=2 and W=4, on stock
  FSDP2 and on stock FSDP2 x TP, and back from the W=4 owner layout; every continued run equals
  one process.
"""

from __future__ import annotations

import functools
import tempfile
from typing import Any

import pytest
import torch
from torch.distributed.tensor import Replicate

import _titan_checkpoint
from _ranks import spawn_ranks
from _ref import bitwise_equal, dcp_load, full_optimizer_state, full_param_copies, sharded_state
from _tolerances import TITAN_PARAM_RTOL, TP_LOSS_RTOL, TP_NORM_RTOL, TP_PARAM_RTOL
from _tp import (
    ADAMW,
    CLIP,
    LLAMA_CHECKPOINT,
    LLAMA_MUON,
    MUON,
    STEPS,
    TITAN_BATCH,
    TITAN_STEPS,
    Block,
    Net,
    batches,
    build,
    clipped_run,
    micro,
    parallelize_block,
    rel,
    titan_reference,
    tp_sharded,
)
from matrix_owner_optim import CommCounter, OwnerRoutedOptimizer
from matrix_owner_optim.preconditioners import Muon

# one xdist worker runs the module, so its cached gloo job (results()) spawns once per run
pytestmark = [pytest.mark.multirank, pytest.mark.xdist_group("tensor_parallel_owner")]

MUON_F32 = {**MUON, "ns_dtype": torch.float32}
CASES = {
    "torch_muon": {"matrix": "torch_muon", "matrix_options": MUON, "tail": "adamw", "tail_options": ADAMW},
    "muon_f32": {"matrix": "muon", "matrix_options": MUON_F32, "tail": "adamw", "tail_options": ADAMW},
}
MATRICES = ("w1.weight", "w2.weight")


def _reference_optimizers(model: Net, case: str) -> list[torch.optim.Optimizer]:
    mats = [p for n, p in model.named_parameters() if n.endswith(MATRICES)]
    rest = [p for n, p in model.named_parameters() if not n.endswith(MATRICES)]
    matrix: torch.optim.Optimizer = torch.optim.Muon(mats, **MUON) if case == "torch_muon" else Muon(mats, **MUON_F32)
    return [matrix, torch.optim.AdamW(rest, **ADAMW)]


def reference(case: str, order: str = "forward") -> dict[str, Any]:
    """One process, whole batch (``order="reversed"``: each batch's rows reversed, the noise floor)."""
    model = build()
    return clipped_run(model, _reference_optimizers(model, case), batches(), model, order)


@functools.cache
def reference_run(case: str) -> dict[str, Any]:
    return reference(case)


# -- the spawned job ----------------------------------------------------------------------------
def _layout(model: Net) -> dict[str, Any]:
    """Per parameter: placements, local shape, DCP's local shape and offset, the planned owner."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from matrix_owner_optim.planning import get_matrix_shard

    out = {}
    for n, p in model.named_parameters():
        shard = get_matrix_shard(p)
        assert shard is not None
        dcp_shape, dcp_offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        out[n] = {
            "type": type(p).__name__,
            "placements": repr(tuple(p.placements)),
            "mesh": tuple(p.device_mesh.mesh_dim_names),
            "local": tuple(p._local_tensor.shape),
            "dcp": (tuple(dcp_shape), tuple(dcp_offset)),
            "owner": shard.owner,
        }
    return out


def _train(mesh: Any, case: str, ckpt: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    from matrix_owner_optim.tensors import local_tensor

    model = tp_sharded(mesh, stock=False)
    opt = OwnerRoutedOptimizer(model, **CASES[case])
    out: dict[str, Any] = {"losses": [], "norms": [], "layout": _layout(model)}
    for step in range(STEPS):
        loss = model(*micro(step, mesh))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        out["norms"].append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        if step == STEPS - 1:
            with CommCounter() as cc:
                opt.step()
            out["ops"] = cc.by_op("optimizer")
            moved = [r for r in cc.records if r.phase == "optimizer" and r.op != "step_check"]
            out["sent"] = sum(r.bytes_sent for r in moved)  # the layout's (the step check is the optimizer's)
            out["received"] = sum(r.bytes_received for r in moved)
            layout = next(pl for pl in opt.layouts() if pl.name == "owner_tp")
            out["bytes_per_step"] = layout.bytes_per_step()
        else:
            opt.step()
        opt.zero_grad()
        out["losses"].append(loss.item())
    names = {id(p): n for n, p in model.named_parameters()}
    matrix, tail = opt.matrix_optimizer, opt.tail_optimizer
    assert matrix is not None and tail is not None
    owner_tp = next(pl for pl in opt.layouts() if pl.name == "owner_tp")
    out["matrix_state"] = sorted(
        names[id(rp.param)] for rp in owner_tp.entries if rp.proxy is not None and rp.proxy in matrix.state
    )
    out["state_bytes"] = sum(
        v.numel() * v.element_size()
        for o in (matrix, tail)
        for s in o.state.values()
        for k, v in s.items()
        if k != "step" and isinstance(v, torch.Tensor)
    )
    out["param_bytes"] = sum(local_tensor(p).numel() * local_tensor(p).element_size() for p in model.parameters())
    out["params"] = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    # the 2D operator rules: pointwise keeps the layout (ranges included); what no 2D rule places
    # is gathered, as on a 1D mesh (a sum of the whole tensor, and an in-place write back)
    w = model.layers[1].w2.weight
    doubled = w.detach() * 2
    out["doubled"] = (repr(tuple(doubled.placements)), repr(tuple(w.placements)))
    out["doubled_exact"] = torch.equal(doubled.full_tensor(), 2 * out["params"]["layers.1.w2.weight"])
    full = out["params"]["layers.1.w2.weight"]
    total = w.detach().sum()
    out["sum_exact"] = torch.equal(total.full_tensor(), full.sum()) and total.placements == (Replicate(), Replicate())
    rolled = doubled.clone()
    rolled.copy_(doubled.roll(1, 0))  # roll is not pointwise: gathered, this rank's piece written back
    out["rolled_exact"] = torch.equal(rolled.full_tensor(), (2 * full).roll(1, 0)) and repr(
        tuple(rolled.placements)
    ) == repr(tuple(w.placements))
    # DCP of the model: each owner writes its TP slice; a fresh planned model loads it in place
    dcp.save(model.state_dict(), checkpoint_id=f"{ckpt}/{case}")
    fresh = tp_sharded(mesh, stock=False)
    OwnerRoutedOptimizer(fresh, **CASES[case])  # fixes the plan: the parameters are pieces now
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=f"{ckpt}/{case}")
    out["loaded"] = {n: p.full_tensor().detach().clone() for n, p in fresh.named_parameters()}
    return out


def _titan_owner(rank: int, W: int) -> dict[str, Any]:
    """torchtitan's Llama3 with its TP plan on the package's fully_shard over the fsdp mesh
    (``_titan.owner_tp_llama``: fused wqkv). This package's Muon (float32 Newton-Schulz) +
    AdamW, torch's clip_grad_norm_ every step."""
    import _titan

    model, dp_mesh = _titan.owner_tp_llama(W)
    opt = OwnerRoutedOptimizer(model, matrix="muon", matrix_options=LLAMA_MUON, tail="adamw", tail_options=ADAMW)
    dp = dp_mesh.get_local_rank()
    norms, losses = [], []
    for tokens, targets in _titan.batches(TITAN_STEPS, TITAN_BATCH):
        rows = slice(2 * dp, 2 * dp + 2)
        loss = _titan.loss(model, tokens[rows], targets[rows], tokens.numel())
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return {
        "placements": {n: str(tuple(p.placements)) for n, p in model.named_parameters()},
        "routes": {r["name"]: r["role"] for r in opt.routes()},
        "norms": norms,
        "losses": losses,
        "params": {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()},
    }


def _refused(mesh: Any) -> dict[str, str]:
    """What the package's fully_shard still refuses at the call, naming the parameter."""
    from matrix_owner_optim import fully_shard

    out = {}
    for case, shard_mesh in (("tp_mesh", mesh["tp"]), ("hsdp", mesh)):
        block = Block(10)
        parallelize_block(block, mesh["tp"])
        try:
            fully_shard(block, mesh=shard_mesh)
            out[case] = "no error"
        except ValueError as exc:
            out[case] = str(exc)
    return out


def _train_steps(model: Net, opt: torch.optim.Optimizer, mesh: Any, steps: range) -> None:
    for step in steps:
        model(*micro(step, mesh)).backward()
        opt.step()
        opt.zero_grad()


def _state_dicts(mesh: Any, ckpt: str) -> dict[str, Any]:
    """torch's state-dict tools on the layout: DCP of the sharded model and optimizer state dicts
    (resumed into a fresh model and optimizer, continued one step), full state dicts, a plain
    ``load_state_dict`` and ``_foreach_copy_`` of full tensors; each against the live run."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    def fresh() -> tuple[Net, OwnerRoutedOptimizer]:
        model = tp_sharded(mesh, stock=False)
        return model, OwnerRoutedOptimizer(model, **CASES["muon_f32"])

    model, opt = fresh()
    _train_steps(model, opt, mesh, range(2))
    dcp.save(sharded_state(model, opt), checkpoint_id=ckpt)
    saved, saved_state = full_param_copies(model), full_optimizer_state(model, opt)
    _train_steps(model, opt, mesh, range(2, 3))
    final, final_state = full_param_copies(model), full_optimizer_state(model, opt)
    out: dict[str, Any] = {}
    resumed, resumed_opt = fresh()
    dcp_load(resumed, resumed_opt, ckpt, via=fresh())
    out["dcp_loaded"] = bitwise_equal(full_param_copies(resumed), saved) and bitwise_equal(
        full_optimizer_state(resumed, resumed_opt), saved_state
    )
    _train_steps(resumed, resumed_opt, mesh, range(2, 3))
    out["dcp_continued"] = bitwise_equal(full_param_copies(resumed), final)
    full = StateDictOptions(full_state_dict=True)
    loaded, loaded_opt = fresh()
    set_model_state_dict(loaded, get_model_state_dict(model, options=full), options=full)
    set_optimizer_state_dict(loaded, loaded_opt, get_optimizer_state_dict(model, opt, options=full), options=full)
    out["full_loaded"] = bitwise_equal(full_param_copies(loaded), final) and bitwise_equal(
        full_optimizer_state(loaded, loaded_opt), final_state
    )
    plain, _ = fresh()
    plain.load_state_dict({n: p.full_tensor() for n, p in model.state_dict().items()})
    out["load_state_dict_full"] = bitwise_equal(full_param_copies(plain), final)
    copied, _ = fresh()
    with torch.no_grad():
        torch._foreach_copy_(list(copied.parameters()), [final[n] for n, _ in copied.named_parameters()])
    out["foreach_copy_full"] = bitwise_equal(full_param_copies(copied), final)
    return out


def _torch_optimizers_and_scaler(mesh: Any, rank: int) -> dict[str, Any]:
    """torch's AdamW given the parameters directly (fused and foreach, 2 steps), against one
    process; GradScaler: unscale_ then torch's clip norm against one process's unscaled norm,
    then an inf written into one rank's piece: found_inf, the skipped step and the scale on
    every rank."""
    out: dict[str, Any] = {"adamw": {}}
    for kind in ("fused", "foreach"):
        ref = build()
        ref_opt = torch.optim.AdamW(ref.parameters(), **ADAMW)
        model = tp_sharded(mesh, stock=False)
        OwnerRoutedOptimizer(model, **CASES["muon_f32"])  # fixes the plan: the parameters are pieces
        opt = torch.optim.AdamW(model.parameters(), **ADAMW, **{kind: True})
        _train_steps(model, opt, mesh, range(2))
        for x, y in batches()[:2]:
            ref(x, y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        out["adamw"][kind] = max(
            rel(p, dict(ref.named_parameters())[n].detach()) for n, p in full_param_copies(model).items()
        )
    model = tp_sharded(mesh, stock=False)
    OwnerRoutedOptimizer(model, **CASES["muon_f32"])
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(model(*micro(0, mesh))).backward()
    scaler.unscale_(opt)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    out["scaled_norm"] = float(norm.full_tensor())
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    scaler.scale(model(*micro(1, mesh))).backward()
    if rank == 3:  # one rank's piece only
        grad = next(p.grad._local_tensor for p in model.parameters() if p.grad._local_tensor.numel())  # type: ignore[union-attr]
        grad.view(-1)[0] = float("inf")
    scaler.unscale_(opt)
    out["found_inf"] = float(sum(v.item() for v in scaler._found_inf_per_device(opt).values()))
    before = full_param_copies(model)
    scaler.step(opt)
    scaler.update()
    out["skipped"] = bitwise_equal(full_param_copies(model), before)
    out["scale"] = float(scaler.get_scale())
    return out


def owner_tp_job(rank: int, W: int, ckpt: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out: dict[str, Any] = {case: _train(mesh, case, ckpt) for case in CASES}
    out["refused"] = _refused(mesh)
    out["state_dicts"] = _state_dicts(mesh, f"{ckpt}/state_dicts")
    out["torch_optimizers"] = _torch_optimizers_and_scaler(mesh, rank)
    out["llama"] = _titan_owner(rank, W)
    out["llama_checkpoint"] = _titan_checkpoint.round_trips(mesh, LLAMA_CHECKPOINT, f"{ckpt}/llama", source="owner_tp")
    if rank == 0:  # the one-process torchtitan references, where torchtitan is imported already
        out["llama_reference"] = titan_reference()
        out["llama_separate_qkv"] = titan_reference(fuse_qkv=False)
    return out


@functools.cache
def results() -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="moo-owner-tp-") as ckpt:
        return spawn_ranks(owner_tp_job, 4, ckpt, threads_per_rank=1)


# -- the tests ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", list(CASES))
def test_owner_layout_on_tp_blocks_equals_one_process(case: str) -> None:
    ref = reference_run(case)
    res = results()
    for rank, r in enumerate(res):
        t = r[case]
        for i, (a, b) in enumerate(zip(t["norms"], ref["norms"], strict=True)):
            assert abs(a - b) <= TP_NORM_RTOL * b, f"rank {rank} step {i}: clip norm {a} vs {b}"
        worst = max(rel(t["params"][n], p) for n, p in ref["params"].items())
        print(f"{case} rank {rank}: worst parameter rel err {worst:.2e}")
        for n, p in ref["params"].items():
            assert rel(t["params"][n], p) <= TP_PARAM_RTOL, f"rank {rank}: {n} rel err {rel(t['params'][n], p):.2e}"
    for i, b in enumerate(ref["losses"]):  # each dp coordinate's micro-batch mean; the two average to the batch's
        a = (res[0][case]["losses"][i] + res[2][case]["losses"][i]) / 2
        assert abs(a - b) <= TP_LOSS_RTOL * abs(b), f"{case} step {i}: loss {a} vs {b}"


def test_tp_slices_are_held_whole_by_their_dp_owner() -> None:
    res = results()
    full = dict(build().named_parameters())
    for rank, r in enumerate(res):
        d, t = divmod(rank, 2)
        for n, lay in r["muon_f32"]["layout"].items():
            shape = tuple(full[n].shape)
            assert lay["type"] == "OwnerDTensor" and lay["mesh"] == ("dp", "tp"), lay
            tp = "Shard(dim=0)" if n.endswith("w1.weight") or n.endswith("w1.bias") else None
            tp = "Shard(dim=1)" if n.endswith("w2.weight") else tp
            tp = tp or "Replicate()"
            ranges = tuple((0, shape[0]) if c == lay["owner"] else (shape[0], shape[0]) for c in range(2))
            assert lay["placements"] == f"(OwnerShard(dim=0, ranges={ranges}), {tp})", (n, lay)
            if tp == "Replicate()":
                slice_shape, offset = shape, (0,) * len(shape)
            else:
                dim = int(tp[-2])
                slice_shape = tuple(s // 2 if i == dim else s for i, s in enumerate(shape))
                offset = tuple(t * slice_shape[dim] if i == dim else 0 for i in range(len(shape)))
            if d == lay["owner"]:
                assert lay["local"] == slice_shape and lay["dcp"] == (slice_shape, offset), (rank, n, lay)
            else:
                assert lay["local"][0] == 0 and lay["local"][1:] == slice_shape[1:], (rank, n, lay)
                assert lay["dcp"][0] == lay["local"], (rank, n, lay)
        # every tp coordinate planned the same owners
        assert {n: x["owner"] for n, x in r["muon_f32"]["layout"].items()} == {
            n: x["owner"] for n, x in res[0]["muon_f32"]["layout"].items()
        }


def test_2d_operator_rules_keep_the_layout_or_gather() -> None:
    for r in results():
        t = r["muon_f32"]
        assert t["doubled"][0] == t["doubled"][1] and "OwnerShard" in t["doubled"][0], t["doubled"]
        assert t["doubled_exact"]
        assert t["sum_exact"] and t["rolled_exact"]


def test_dcp_of_the_model_loads_bitwise_into_a_fresh_planned_model() -> None:
    for rank, r in enumerate(results()):
        for case in CASES:
            t = r[case]
            for n, p in t["params"].items():
                assert torch.equal(t["loaded"][n], p), (rank, case, n)


def test_matrix_state_only_on_its_owners_and_resident_bytes() -> None:
    res = results()
    for rank, r in enumerate(res):
        d = rank // 2
        t = r["muon_f32"]
        owned = sorted(n for n, x in t["layout"].items() if x["owner"] == d and n.endswith(MATRICES))
        assert t["matrix_state"] == owned, (rank, t["matrix_state"], owned)
        print(f"rank {rank}: parameters {t['param_bytes']} B, optimizer state {t['state_bytes']} B resident")
    # per rank ~ 1/D of the TP slices: the two dp coordinates together hold each slice once
    for t in range(2):
        total = sum(res[d * 2 + t]["muon_f32"]["param_bytes"] for d in range(2))
        slices = sum(p.numel() * 4 // (1 if n.endswith("w2.bias") else 2) for n, p in build().named_parameters())
        assert total == slices, (t, total, slices)


def test_steady_step_moves_what_bytes_per_step_says() -> None:
    for rank, r in enumerate(results()):
        for case in CASES:
            t = r[case]
            owns = any(x["owner"] == rank // 2 and n.endswith(MATRICES) for n, x in t["layout"].items())
            if owns:  # one dtype; the step opens with its step check over the TP group (24 B)
                assert t["ops"] == {"step_check": 1, "owner_tp_gather": 1}, (rank, t["ops"])
            else:
                assert not t["ops"], (rank, t["ops"])
            assert t["sent"] + t["received"] == t["bytes_per_step"], (rank, case, t["sent"], t["received"])


def test_torchtitan_llama_tp_on_the_owner_layout_equals_one_process() -> None:
    res = results()
    ref = res[0]["llama_reference"]
    for rank, r in enumerate(res):
        t = r["llama"]
        assert t["placements"]["layers.0.feed_forward.w2.weight"].endswith("Shard(dim=1))"), t["placements"]
        assert t["placements"]["tok_embeddings.weight"].startswith("(OwnerShard"), t["placements"]
        for i, (a, b) in enumerate(zip(t["norms"], ref["norms"], strict=True)):
            assert abs(a - b) <= TP_NORM_RTOL * b, f"rank {rank} step {i}: clip norm {a} vs {b}"
        worst = max(rel(t["params"][n], p) for n, p in ref["params"].items())
        print(f"torchtitan Llama3 rank {rank}: worst parameter rel err {worst:.2e}")
        assert worst <= TITAN_PARAM_RTOL, f"rank {rank}: rel err {worst:.2e}"
    for i, b in enumerate(ref["losses"]):  # the loss is divided by the global token count: the dp sum
        a = res[0]["llama"]["losses"][i] + res[2]["llama"]["losses"][i]
        assert abs(a - b) <= TP_LOSS_RTOL * abs(b), f"step {i}: loss {a} vs {b}"


def test_state_dicts_of_model_and_optimizer_round_trip_bitwise() -> None:
    for rank, r in enumerate(results()):
        assert r["state_dicts"] == {
            "dcp_loaded": True,
            "dcp_continued": True,
            "full_loaded": True,
            "load_state_dict_full": True,
            "foreach_copy_full": True,
        }, (rank, r["state_dicts"])


def test_torch_adamw_fused_and_foreach_and_grad_scaler_on_the_layout() -> None:
    ref = reference_run("torch_muon")  # its first clip norm: the unscaled gradient's, one process
    for rank, r in enumerate(results()):
        t = r["torch_optimizers"]
        print(f"rank {rank}: AdamW on the parameters vs one process {t['adamw']}")
        for kind, err in t["adamw"].items():
            assert err <= TP_PARAM_RTOL, (rank, kind, err)
        assert abs(t["scaled_norm"] - ref["norms"][0]) <= TP_NORM_RTOL * ref["norms"][0], (rank, t["scaled_norm"])
        assert t["found_inf"] == 1.0 and t["skipped"] and t["scale"] == 512.0, (rank, t)


def test_torchtitan_owner_tp_checkpoint_moves_to_the_1d_layouts_and_back() -> None:
    """torchtitan's Llama3 on the 2D owner layout saves model and optimizer with DCP at step 1;
    the checkpoint loads bitwise (parameters and torch's full optimizer state) on the 1D owner
    layout at W=2 and W=4, on stock FSDP2 at W=4 and on stock FSDP2 x TP; the W=4 owner layout's
    checkpoint loads back on the 2D owner layout. Every run continued to step 3 equals the
    uninterrupted one-process run at the noise floor."""
    ref = results()[0]["llama_separate_qkv"]["params"]
    _titan_checkpoint.check_round_trips([r["llama_checkpoint"] for r in results()], "owner_tp", ref, TITAN_PARAM_RTOL)


def test_fully_shard_refuses_unsupported_tp_forms_at_the_call() -> None:
    for r in results():
        for case, msg in r["refused"].items():
            assert msg.startswith("fully_shard(Block): parameter 'w1.weight' is a DTensor"), (case, msg)
            assert "(Shard(dim=0),)" in msg and "(dp, tp) DeviceMesh" in msg, (case, msg)


if __name__ == "__main__":  # the noise floor: the references against themselves, summation order changed
    for name in CASES:
        a, b = reference(name), reference(name, "reversed")
        print(name, "params", max(rel(a["params"][n], b["params"][n]) for n in a["params"]))
        print(name, "norms", max(abs(x - y) / y for x, y in zip(a["norms"], b["norms"], strict=True)))
        print(name, "losses", max(abs(x - y) / abs(y) for x, y in zip(a["losses"], b["losses"], strict=True)))

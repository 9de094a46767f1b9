"""Rank jobs for the parts of the OwnerDTensor contract (issue 32) that OpInfo does not drive.

Each check runs a small function on every rank and gathers every rank's outcome (the value it
got, or the exception it raised) with ``all_gather_object``, so the parent sees all ranks side by
side. A check whose operator may raise on some ranks runs in two agreed steps (:func:`staged`):
the operator, then the read, so a rank that raised never leaves the others waiting in the read's
collective. The tests in tests/test_owner_dtensor_opinfo.py assert on the gathered outcomes:

* :func:`reads_job`: Python-value reads of held tensors (``item()``, ``bool()``, ``float()``,
  ``tolist()``, ``torch.equal``) give every rank the one-process value (contract item 3);
  ``full_tensor()`` and ``redistribute(Replicate())`` return new storage on every rank, the
  holder included (item 4); random in-place ops under one seed draw bitwise what one process
  draws, tensor by tensor in order (item 6); plain tensors mixed in are replicated full values
  (item 7); ``register_hook`` on a non-leaf owner-layout tensor fires with the right gradient.
* :func:`collectives_job`: ``torch.distributed`` collectives given an owner-layout tensor behave
  as stock DTensor does in torch 2.13 for the same call on the stock placement the layout is a
  case of (refused with the same exception type on every rank), or run on every rank on the
  local piece (item 5).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from _owner_layouts import SINGLE, Placed, build, placement_for, world_mesh

__all__ = ["STOCK_COUNTERPART", "Outcome", "agreed", "collectives_job", "reads_job", "staged"]

Outcome = tuple  # ("ok", value) or ("raised", exception type name, message)


def agreed(fn: Callable[[], Any]) -> list[Outcome]:
    """``fn()`` on this rank, then every rank's outcome (one all_gather_object)."""
    try:
        mine: Outcome = ("ok", fn())
    except Exception as exc:
        mine = ("raised", type(exc).__name__, str(exc).splitlines()[0][:300] if str(exc) else "")
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every


def staged(make: Callable[[], Any], *steps: Callable[[Any], Any]) -> list[Outcome]:
    """``make()``, then each of ``steps`` on the previous result, each step agreed over the ranks
    (every rank's outcome gathered) before the next one runs. A step that raises on some ranks
    ends the chain there, reported as such, instead of leaving the other ranks waiting in the
    next step's collective. Give each step one operator (or the final read)."""
    value: list[Any] = []

    def first() -> str:
        value.append(make())
        return "made"

    outcome = agreed(first)
    for i, step in enumerate(steps):
        if not all(o[0] == "ok" for o in outcome):
            return outcome
        last = i == len(steps) - 1

        def run(step: Callable[[Any], Any] = step, last: bool = last) -> Any:
            value.append(step(value[-1]))
            return value[-1] if last else "made"

        outcome = agreed(run)
    return outcome


def _full(t: Any) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _layouts(x: torch.Tensor, W: int) -> dict[str, Placed]:
    """The single-tensor layouts (tests/_owner_layouts.py) ``x`` takes, by name."""
    return {lay: placement_for(lay, 0, x, W) for lay in SINGLE}


# -- item 3: Python-value reads ---------------------------------------------------------------------
def _reads(W: int) -> dict[str, list[Outcome]]:
    """Every read on every layout; each outcome's value is (got, want) on that rank. ``x`` has 4
    rows, so at W=3 the last rank's row block is empty (torch.chunk: 2, 2, 0), as FSDP2's is."""
    torch.manual_seed(3)
    x = torch.randn(4, 3)
    s = torch.tensor(-1.25)
    one = torch.tensor([2.5])
    out: dict[str, list[Outcome]] = {}
    for lay, placed in _layouts(x, W).items():
        t = build(x, placed)
        u = build(one, placement_for(lay, 0, one, W))
        out[f"{lay}: max().item()"] = staged(lambda t=t: t.max(), lambda m: (m.item(), x.max().item()))
        out[f"{lay}: [1, 2].item()"] = staged(lambda t=t: t[1, 2], lambda v: (v.item(), x[1, 2].item()))
        out[f"{lay}: bool(max() > 0)"] = staged(
            lambda t=t: t.max(), lambda m: m > 0, lambda v: (bool(v), bool(x.max() > 0))
        )
        out[f"{lay}: tolist()"] = agreed(lambda t=t: (t.tolist(), x.tolist()))
        out[f"{lay}: torch.equal(t, same layout)"] = agreed(
            lambda t=t, placed=placed: (torch.equal(t, build(x, placed)), True)
        )
        out[f"{lay}: torch.equal(t, plain)"] = agreed(lambda t=t: (torch.equal(t, x), True))
        out[f"{lay}: torch.equal(t, plain + 1)"] = agreed(lambda t=t: (torch.equal(t, x + 1), False))
        out[f"{lay}: bool(1-element > 1)"] = staged(lambda u=u: u > 1, lambda v: (bool(v), bool(one > 1)))
        out[f"{lay}: float(1-element)"] = agreed(lambda u=u: (float(u), float(one)))
    for owner in range(W):  # 0-dim values held by one rank (Partial with a holder)
        v = build(s, Placed("held", owner))
        out[f"0-dim held{owner}: item()"] = agreed(lambda v=v: (v.item(), s.item()))
        out[f"0-dim held{owner}: bool()"] = agreed(lambda v=v: (bool(v), bool(s)))
        out[f"0-dim held{owner}: float(t * 2)"] = staged(lambda v=v: v * 2, lambda d: (float(d), float(s * 2)))
    return out


# -- the holder-local rule's agreement and the row-block reductions -----------------------------------
def _holder_agreement(W: int) -> dict[str, list[Outcome]]:
    """Cases the OpInfo long form found, kept in the default run. Each value: (got, want) on
    that rank, or the exception every rank must raise alike.

    * ``native_batch_norm`` in eval mode on a held input: torch's meta kernel gives ``(C,)``
      statistics where the CPU kernel gives empty ones, so the other ranks' shapes would differ
      from the holder's; the agreement sends it to the gathered rule.
    * ``index_select`` / ``gather`` with an index out of range on a held tensor (operators that
      read indices, so the holder-local rule agrees): the holder's error on every rank.
    * ``amax`` / ``norm(inf)`` of row blocks holding a NaN: gathered (a partial max combined by
      the backend's MAX loses the NaN); ``sum`` stays a row-block reduction and is exact.
    * ``addmm(b, x, w.t())`` with ``x`` and ``w`` held by two ranks (gathered): bitwise the plain
      result. The gathered ``w.t()`` must keep its transposed strides, or BLAS sums in another
      order (multi_head_attention_forward was 0.1 off after three such products)."""
    x = torch.arange(24.0).reshape(3, 2, 4) / 7
    w, b, mean, var = torch.ones(2), torch.zeros(2), torch.full((2,), 0.5), torch.full((2,), 2.0)
    nan = torch.arange(12.0).reshape(4, 3)
    nan[1, 1] = float("nan")
    bad_index = torch.tensor([0, 5])
    out: dict[str, list[Outcome]] = {}
    for owner in range(W):

        def batch_norm(owner: int = owner) -> Any:
            got = torch.ops.aten.native_batch_norm(build(x, Placed("held", owner)), w, b, mean, var, False, 0.1, 1e-5)
            want = torch.ops.aten.native_batch_norm(x, w, b, mean, var, False, 0.1, 1e-5)
            return ([tuple(_full(g).shape) for g in got], [tuple(t.shape) for t in want]), all(
                torch.equal(_full(g), t) for g, t in zip(got, want, strict=True)
            )

        out[f"native_batch_norm eval, held{owner}"] = agreed(batch_norm)
        out[f"index_select out of range, held{owner}"] = agreed(
            lambda owner=owner: torch.index_select(build(x, Placed("held", owner)), 0, bad_index) and None
        )
        out[f"gather out of range, held{owner}"] = agreed(  # structured, but it reads indices
            lambda owner=owner: torch.gather(build(x, Placed("held", owner)), 0, bad_index.expand(2, 2, 4)) and None
        )
    torch.manual_seed(5)
    xm, wm, bm = torch.randn(3, 4) * 9, torch.randn(4, 4) * 9, torch.randn(4) * 9
    out["addmm(b, x, w.t()), x and w on two owners"] = agreed(
        lambda: torch.equal(
            _full(torch.addmm(bm, build(xm, Placed("held", 0)), build(wm, Placed("held", W - 1)).t())),
            torch.addmm(bm, xm, wm.t()),
        )
    )
    rows = Placed("rows")
    for name, fn in {
        "amax(dim=0)": lambda t: t.amax(dim=0),
        "norm(inf, dim=0)": lambda t: torch.linalg.vector_norm(t, float("inf"), dim=0),
        "sum(dim=0)": lambda t: t.sum(dim=0),
    }.items():
        out[f"rows with a NaN: {name}"] = agreed(lambda fn=fn: (_full(fn(build(nan, rows))).tolist(), fn(nan).tolist()))
    return out


# -- item 4: full_tensor() / redistribute() are copies -----------------------------------------------
def _copies(W: int) -> dict[str, list[Outcome]]:
    """Each value: which of the four copy properties hold on that rank."""
    torch.manual_seed(4)
    x = torch.randn(5, 3)
    cases = dict(_layouts(x, W))
    for owner in range(W):
        cases[f"0-dim held{owner}"] = Placed("held", owner)
    mesh = world_mesh()
    out: dict[str, list[Outcome]] = {}
    for name, placed in cases.items():
        base = x[0, 0].clone() if name.startswith("0-dim") else x

        def run(base: torch.Tensor = base, placed: Placed = placed) -> dict[str, bool]:
            t = build(base, placed, mesh)
            f = t.full_tensor()
            g = t.redistribute(t.device_mesh, [Replicate()]).to_local()
            f.add_(1)  # mutating a result never changes the tensor ...
            g.mul_(3)
            unchanged = bool(torch.equal(t.full_tensor(), base))
            with torch.no_grad():
                t.add_(10)  # ... and later changes of the tensor never show in a result
            return {
                "tensor unchanged by mutating full_tensor()/redistribute()": unchanged,
                "full_tensor() taken before unchanged by t.add_": bool(torch.equal(f, base + 1)),
                "redistribute() taken before unchanged by t.add_": bool(torch.equal(g, base * 3)),
                "t.add_ took effect": bool(torch.equal(t.full_tensor(), base + 10)),
            }

        out[name] = agreed(run)
    return out


# -- item 6: random in-place ops under one seed --------------------------------------------------------
RANDOM_INITS: dict[str, Callable[[torch.Tensor], Any]] = {
    "nn.init.normal_": lambda t: torch.nn.init.normal_(t, 0.0, 0.02),
    "nn.init.uniform_": lambda t: torch.nn.init.uniform_(t, -0.1, 0.1),
    "nn.init.trunc_normal_": lambda t: torch.nn.init.trunc_normal_(t, std=0.02),
    "nn.init.kaiming_uniform_": lambda t: torch.nn.init.kaiming_uniform_(t, a=math.sqrt(5)),
    "nn.init.xavier_uniform_": torch.nn.init.xavier_uniform_,
    "nn.init.orthogonal_": torch.nn.init.orthogonal_,
    "Tensor.uniform_": lambda t: t.uniform_(),
    "Tensor.normal_": lambda t: t.normal_(),
    "Tensor.bernoulli_(0.5)": lambda t: t.bernoulli_(0.5),
    "Tensor.exponential_": lambda t: t.exponential_(),
    "Tensor.random_(0, 10)": lambda t: t.random_(0, 10),
}
RANDOM_SHAPES = [(6, 4), (5, 3), (7, 4), (4, 6), (3, 5)]  # one per layout of SINGLE, drawn in order


def _random(W: int) -> dict[str, list[Outcome]]:
    """Every random init applied under one seed to a tensor in each layout, in order, against one
    process drawing for plain tensors of the same shapes in the same order. Each value lists the
    layouts whose values are not bitwise the one-process draw (empty: all are)."""
    out: dict[str, list[Outcome]] = {}
    for name, init in RANDOM_INITS.items():

        def run(init: Callable[[torch.Tensor], Any] = init) -> list[str]:
            zeros = [torch.zeros(s) for s in RANDOM_SHAPES]
            tensors = [build(z, placement_for(lay, 0, z, W)) for z, lay in zip(zeros, SINGLE, strict=True)]
            raised: dict[str, str] = {}
            torch.manual_seed(1234)
            with torch.no_grad():
                for lay, t in zip(SINGLE, tensors, strict=True):
                    try:
                        init(t)
                    except Exception as exc:  # refused on this layout: named; the next ones still drawn
                        raised[lay] = f"{lay} raised {type(exc).__name__}: {str(exc)[:120]}"
            torch.manual_seed(1234)
            for z in zeros:
                init(z)
            return [
                raised.get(lay, lay)
                for lay, t, z in zip(SINGLE, tensors, zeros, strict=True)
                if lay in raised or not torch.equal(_full(t), z)
            ]

        out[name] = agreed(run)

    def dropout() -> list[str]:  # out of place: the mask drawn whole
        xs = [torch.randn(s, generator=torch.Generator().manual_seed(9)) for s in RANDOM_SHAPES]
        tensors = [build(x, placement_for(lay, 0, x, W)) for x, lay in zip(xs, SINGLE, strict=True)]
        torch.manual_seed(77)
        got = [F.dropout(t, 0.5, training=True) for t in tensors]
        torch.manual_seed(77)
        want = [F.dropout(x, 0.5, training=True) for x in xs]
        return [lay for lay, g, w in zip(SINGLE, got, want, strict=True) if not torch.equal(_full(g), w)]

    out["F.dropout(p=0.5)"] = agreed(dropout)
    return out


# -- item 7: plain tensors are replicated full values ----------------------------------------------------
PLAIN_MIXES: dict[str, Callable[[Any, torch.Tensor], Any]] = {
    "t + plain": lambda t, x: t + x,
    "plain + t": lambda t, x: x + t,
    "t * plain row (broadcast)": lambda t, x: t * x[0],
    "torch.where(plain mask, t, plain)": lambda t, x: torch.where(x > 0, t, -x),
    "t @ plain": lambda t, x: t @ x.T,
    "plain @ t": lambda t, x: x.T @ t,
    "torch.cat([t, plain])": lambda t, x: torch.cat([t, x]),
    "t.add_(plain)": lambda t, x: t.add_(x),
    "t.copy_(plain * 2)": lambda t, x: t.copy_(x * 2),
    "torch.add(t, plain, out=t)": lambda t, x: torch.add(t, x, out=t),
}


def _plain_mixes(W: int) -> dict[str, list[Outcome]]:
    """Each value: (whether the result, or the written tensor, equals the one-process result,
    its shape and type)."""
    torch.manual_seed(7)
    x, y = torch.randn(5, 3), torch.randn(5, 3)
    out: dict[str, list[Outcome]] = {}
    for lay, placed in _layouts(x, W).items():
        for name, fn in PLAIN_MIXES.items():

            def make(fn: Callable[[Any, torch.Tensor], Any] = fn, placed: Placed = placed) -> Any:
                return fn(build(x, placed), y)

            def read(got: Any, fn: Callable[[Any, torch.Tensor], Any] = fn) -> tuple[bool, str]:
                want = fn(x.clone(), y)
                g = _full(got)
                same = g.shape == want.shape and torch.allclose(g, want, rtol=1.3e-6, atol=1e-5)
                return bool(same), f"{tuple(g.shape)} {type(got).__name__}"

            out[f"{lay}: {name}"] = staged(make, read)
    return out


# -- autograd hooks ------------------------------------------------------------------------------------------
def _hooks(W: int) -> dict[str, list[Outcome]]:
    """``y = x * 2`` (non-leaf), ``y.register_hook``, ``loss = (y * w).sum()``: the hook sees
    ``dloss/dy = w`` and ``x.grad = 2 w`` (a hook returning ``3 g``: ``6 w``)."""
    torch.manual_seed(8)
    x0, w = torch.randn(5, 3), torch.randn(5, 3)
    out: dict[str, list[Outcome]] = {}
    for lay, placed in _layouts(x0, W).items():
        for scale in (None, 3.0):

            def make(placed: Placed = placed, scale: float | None = scale) -> tuple:
                x = build(x0, placed).requires_grad_(True)
                seen: list[torch.Tensor] = []

                def hook(g: torch.Tensor) -> torch.Tensor | None:
                    seen.append(g)
                    return None if scale is None else g * scale

                y = x * 2
                y.register_hook(hook)
                loss = (y * w).sum()
                loss.backward()
                return x, seen, loss

            def read(made: tuple, scale: float | None = scale) -> dict[str, bool]:
                x, seen, loss = made
                k = 1.0 if scale is None else scale
                return {
                    "hook fired once": len(seen) == 1,
                    "hook gradient": len(seen) == 1 and bool(torch.allclose(_full(seen[0]), w)),
                    "x.grad": x.grad is not None and bool(torch.allclose(_full(x.grad), 2 * k * w)),
                    "loss": bool(torch.allclose(_full(loss.detach()), (x0 * 2 * w).sum())),
                }

            out[f"{lay}: hook {'observes' if scale is None else 'scales'}"] = staged(make, read)
    return out


def reads_job(rank: int, W: int) -> dict[str, dict[str, list[Outcome]]]:
    torch.set_num_threads(1)
    return {
        "reads": _reads(W),
        "copies": _copies(W),
        "random": _random(W),
        "plain": _plain_mixes(W),
        "hooks": _hooks(W),
        "agreement": _holder_agreement(W),
    }


# -- item 5: c10d collectives ---------------------------------------------------------------------------------
def _collective_calls(W: int) -> dict[str, Callable[[torch.Tensor], Any]]:
    def all_gather_list(t: torch.Tensor) -> Any:
        return dist.all_gather([torch.empty_like(t.to_local()) for _ in range(W)], t)

    return {
        "all_reduce": lambda t: dist.all_reduce(t),
        "broadcast": lambda t: dist.broadcast(t, src=0),
        "all_gather": all_gather_list,
        "all_gather_into_tensor": lambda t: dist.all_gather_into_tensor(
            torch.empty((W * max(t.to_local().numel(), 1),)), t
        ),
        "reduce_scatter_tensor": lambda t: dist.reduce_scatter_tensor(t, torch.ones((W * t.to_local().numel(),))),
    }


STOCK_COUNTERPART = {  # the stock DTensor placement each owner layout is a case of
    "held0": "Shard(0)",
    "held_last": "Shard(0)",
    "rows": "Shard(0)",
    "split": "Shard(0)",
    "replicated": "Replicate()",
}


def collectives_job(rank: int, W: int) -> dict[str, dict[str, Any]]:
    """Per (collective, layout): the stock DTensor outcome on the counterpart placement and the
    owner-layout outcome, every rank's."""
    torch.set_num_threads(1)
    mesh = world_mesh()
    x = torch.arange(float(W * 2)).reshape(W, 2)
    s = torch.tensor(2.0)
    stock: dict[str, Callable[[], DTensor]] = {
        "Shard(0)": lambda: distribute_tensor(x.clone(), mesh, [Shard(0)]),
        "Replicate()": lambda: distribute_tensor(x.clone(), mesh, [Replicate()]),
        "Partial() 0-dim": lambda: DTensor.from_local(s.clone() / W, mesh, [Partial()], run_check=False),
    }
    owner: dict[str, Callable[[], Any]] = {lay: (lambda p=p: build(x, p)) for lay, p in _layouts(x, W).items()}
    for o in range(W):
        owner[f"0-dim held{o}"] = lambda o=o: build(s, Placed("held", o))
    out: dict[str, dict[str, Any]] = {}
    for cname, call in _collective_calls(W).items():
        stock_outcomes = {
            name: agreed(lambda make=make, call=call: call(make()) and None) for name, make in stock.items()
        }
        for lay, make in owner.items():

            def run(make: Callable[[], Any] = make, call: Callable[[torch.Tensor], Any] = call) -> list[float]:
                t = make()
                local_before = t.to_local().clone()
                call(t)
                # it ran: on the local piece, as the same collective on a plain copy of it does
                plain = local_before.clone()
                call(plain)
                return [float(torch.equal(t.to_local(), plain))]

            counterpart = STOCK_COUNTERPART.get(lay, "Partial() 0-dim")
            out[f"{cname} on {lay}"] = {
                "stock": stock_outcomes[counterpart],
                "stock_placement": counterpart,
                "owner": agreed(run),
            }
    return out


# -- whole-parameter assignment idioms (issue 40) -------------------------------------------------------------
def _sharded_pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    """A small GPT sharded by this package (every block, then the root) and an unsharded copy."""
    import copy

    from _ref import CFG
    from matrix_owner_optim.sharding import fully_shard
    from matrix_owner_optim.toolbox.models.gpt import GPT

    torch.manual_seed(0)
    model = GPT(CFG)
    ref = copy.deepcopy(model)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    return model, ref


def _max_rel_err(model: torch.nn.Module, ref: torch.nn.Module) -> float:
    errs = []
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        full = p.detach().full_tensor()
        if full.dtype != q.dtype:
            return math.inf
        errs.append(float((full - q.detach()).norm() / q.detach().norm().clamp_min(1e-30)))
    return max(errs)


def _assign_vector(model: torch.nn.Module, ref: torch.nn.Module) -> None:
    for m in (model, ref):
        vec = torch.nn.utils.parameters_to_vector(m.parameters())
        torch.nn.utils.vector_to_parameters(vec * 0.5, m.parameters())


def _assign_data_same_layout(model: torch.nn.Module, ref: torch.nn.Module) -> None:
    for m in (model, ref):
        for p in m.parameters():
            p.data = p.data * 0.5 + 1


def _assign_data_plain(model: torch.nn.Module, ref: torch.nn.Module) -> None:
    torch.manual_seed(5)
    values = [torch.randn(q.shape) for q in ref.parameters()]
    for m in (model, ref):
        for p, v in zip(m.parameters(), values, strict=True):
            p.data = v.clone()


def _assign_data_dtype(model: torch.nn.Module, ref: torch.nn.Module) -> None:
    for m in (model, ref):
        for p in m.parameters():
            p.data = p.data.to(torch.float64)


def _copy_full_after_vector(model: torch.nn.Module, ref: torch.nn.Module) -> None:
    for m in (model, ref):
        vec = torch.nn.utils.parameters_to_vector(m.parameters()) * 0.5
        offset = 0
        for p in m.parameters():
            n = p.numel()
            p.copy_(vec[offset : offset + n].view_as(p))
            offset += n


ASSIGNMENTS: dict[str, Callable[[torch.nn.Module, torch.nn.Module], None]] = {
    "vector_to_parameters(vec * 0.5)": _assign_vector,
    "p.data = p.data * 0.5 + 1": _assign_data_same_layout,
    "p.data = plain tensor": _assign_data_plain,
    "p.data = p.data.to(float64)": _assign_data_dtype,
    "p.copy_(full) after parameters_to_vector": _copy_full_after_vector,
}


def assignment_job(rank: int, W: int) -> dict[str, list[Outcome]]:
    """Each idiom on a fresh sharded model and its unsharded copy: every rank's largest relative
    error of a parameter against the copy (0: right), and, after ``vector_to_parameters``, the
    forward's loss on both (the sharded forward reads the new values). The refused idioms
    (``p.set_``, ``p.data =`` of another shape): every rank's exception."""
    torch.set_num_threads(1)
    from _ref import global_batch

    out: dict[str, list[Outcome]] = {}
    for name, idiom in ASSIGNMENTS.items():

        def run(idiom: Callable[[torch.nn.Module, torch.nn.Module], None] = idiom) -> float:
            model, ref = _sharded_pair()
            with torch.no_grad():
                idiom(model, ref)
            return _max_rel_err(model, ref)

        out[name] = agreed(run)

    def forward_after_vector() -> tuple[float, float]:
        model, ref = _sharded_pair()
        with torch.no_grad():
            _assign_vector(model, ref)
        idx, tgt = global_batch(0, 1)
        return float(model(idx, tgt)), float(ref(idx, tgt))

    out["forward after vector_to_parameters"] = agreed(forward_after_vector)
    model, _ = _sharded_pair()
    p = next(model.parameters())
    out["p.set_(t)"] = agreed(lambda: p.detach().set_(p.detach() * 0.5))
    out["p.data = another shape"] = agreed(lambda: setattr(p, "data", torch.zeros(3)))
    return out

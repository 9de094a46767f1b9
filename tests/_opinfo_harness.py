"""Every OpInfo operator on owner-layout tensors against the same operator on plain tensors.

Driven by ``torch.testing._internal.common_methods_invocations.op_db``, as torch's own
test/distributed/tensor/test_dtensor_ops.py is: float32 samples on CPU. Each *trial* is one
(operator, sample, layout, variant): the sample's tensors are put in a layout of
tests/_owner_layouts.py, the operator runs out of place, in place (``op.get_inplace()``) or
with ``out=``, and every rank compares what it reads back (``full_tensor()`` of a DTensor
result, of the mutated input, of the ``out`` tensors) with the operator run on the plain full
tensors in this process. The contract (issue 32): the same value (bitwise, or within the
OpInfo's own float32 tolerances where a gathered path may sum in another order), or a refusal
on every rank (the same exception type everywhere, a message naming the operator); never a
wrong value, an error on some ranks only, a result whose metadata differs across ranks, nor a
hang.

Ranks run the trials in lockstep. Before reading a result back (a collective), the ranks agree
that every rank got a result of the same structure (one all-gather of a digest), so a rank that
raised never leaves another waiting in ``full_tensor()``. Each rank appends its verdicts to its
own JSON-lines file; the parent compares the files across ranks (:func:`summarize`), so the
verdicts of a job that a hang aborted survive it. A hang is a process-group timeout
(:data:`PG_TIMEOUT_S`); the parent records the trial in flight as ``ABORTED`` and resumes at
the next operator (:func:`run_world`).

Every rank must run the same calls: the ranks fork from one forkserver (tests/_ranks.py), so
they share its string-hash seed (a sample function that iterates a set of strings orders it by
that seed: meshgrid's ``{'xy', 'ij'}``), and they agree on each operator's samples (one
all-gather of a digest) before its trials; samples that differ are reported as
``SAMPLES-DIFFER``, a violation.

Random operators (``bernoulli``, ``normal``, dropout, ...) are compared under the same seed:
every trial seeds torch's generator identically before the plain call and before the owner
call, on every rank. An operator whose plain result differs between two calls under the same
seed is nondeterministic and not compared (``n/a``).
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import tempfile
import time
import warnings
import zlib
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from _owner_layouts import SINGLE, applicable, assign, build, placement_for, world_mesh
from _ranks import spawn_ranks
from matrix_owner_optim.toolbox.launch import RankError

__all__ = [
    "GOOD",
    "PG_TIMEOUT_S",
    "Summary",
    "run_world",
    "summarize",
]

PG_TIMEOUT_S = 20.0  # a collective that waits this long for a peer is a hang: the job aborts
GOOD = ("exact", "close", "refused")  # every other verdict is a contract violation ("other")
VARIANTS = ("out_of_place", "inplace", "out")
DTYPE = torch.float32
# torch.testing.assert_close's float32 defaults, used when an OpInfo names no tolerance of its own
DEFAULT_ATOL, DEFAULT_RTOL = 1e-5, 1.3e-6
# OpInfos whose results are uninitialised memory: only shapes and dtypes compare
UNINITIALISED = ("empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided", "empty_permuted")
_NAMES_OPERATOR = re.compile(r"\b(aten|c10d)(::|\.)[A-Za-z_]\w*")


# -- the operators ---------------------------------------------------------------------------------
def operators() -> list[Any]:
    """Every OpInfo with float32 samples on CPU, in op_db's order (the same on every rank)."""
    from torch.testing._internal.common_methods_invocations import op_db

    return [op for op in op_db if DTYPE in op.supported_dtypes("cpu")]


def operator_names_without_float32() -> list[str]:
    from torch.testing._internal.common_methods_invocations import op_db

    return sorted({_full_name(op) for op in op_db if DTYPE not in op.supported_dtypes("cpu")})


def _full_name(op: Any) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def tolerance(op: Any) -> tuple[float, float]:
    """The OpInfo's own float32 (atol, rtol) on CPU: the loosest ``toleranceOverride`` any of its
    CPU tests declares, else ``assert_close``'s float32 defaults."""
    from torch.testing._internal.common_device_type import toleranceOverride
    from torch.testing._internal.opinfo.core import DecorateInfo

    atol, rtol = DEFAULT_ATOL, DEFAULT_RTOL
    for dec in op.decorators:
        infos = dec.decorators if isinstance(dec, DecorateInfo) else [dec]
        if isinstance(dec, DecorateInfo) and dec.device_type not in (None, "cpu"):
            continue
        if isinstance(dec, DecorateInfo) and dec.dtypes is not None and DTYPE not in dec.dtypes:
            continue
        for d in infos:
            if isinstance(d, toleranceOverride) and DTYPE in d.d:
                atol, rtol = max(atol, d.d[DTYPE].atol), max(rtol, d.d[DTYPE].rtol)
    return atol, rtol


def samples(op: Any, seed: int) -> Iterator[Any]:
    """The OpInfo's float32 CPU samples, drawn under ``seed`` (the same on every rank).

    Straight from ``sample_inputs_func``: ``op.sample_inputs`` wraps it in a tracker that
    walks the interpreter stack (``inspect.stack()``) for a unittest method on every call, a
    quarter of a second per operator in a rank process, and reseeds per sample; one seed per
    operator keeps the draw the same on every rank just as well. Python's ``random`` is seeded
    too: some samples draw plain-number arguments from it (a loss's ``margin``), which would
    otherwise differ from rank to rank."""
    random.seed(seed)
    torch.manual_seed(seed)
    return iter(op.sample_inputs_func(op, "cpu", DTYPE, False))


# -- one trial -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Trial:
    op_index: int
    op_name: str
    sample_index: int
    layout: str
    variant: str

    @property
    def key(self) -> str:
        return f"{self.op_name}|s{self.sample_index}|{self.layout}|{self.variant}"

    @property
    def seed(self) -> int:
        return zlib.crc32(self.key.encode()) & 0x7FFFFFFF


def _supported(t: torch.Tensor) -> bool:
    """A strided dense tensor DTensor can wrap (as torch's DTensorConverter decides)."""
    return not (t.is_sparse or t.is_sparse_csr or t.is_quantized or t.is_nested or t.is_neg() or t.is_conj()) and (
        t.layout == torch.strided
    )


def _call_parts(sample: Any) -> tuple[list[Any], Any]:
    """The sample's (input, args, kwargs) flattened, and the spec to rebuild them."""
    return tree_flatten((sample.input, tuple(sample.args), dict(sample.kwargs)))


def _tensors(flat: list[Any]) -> list[torch.Tensor]:
    return [a for a in flat if isinstance(a, torch.Tensor)]


def _fill_like(t: torch.Tensor) -> torch.Tensor:
    """An ``out=`` buffer of ``t``'s shape and dtype filled with a value no operator of these
    samples writes everywhere by chance (7), so an unwritten region shows. Without ``t``'s
    conjugate / negative bit (a lazy ``conj()`` result): a buffer a user allocates has none, and
    torch's own ``out=`` kernels leave one that has it unwritten (``fft.ihfftn``)."""
    return torch.full_like(t.resolve_conj().resolve_neg(), True if t.dtype == torch.bool else 7)


def _invoke(op: Any, variant: str, flat: list[Any], spec: Any, out: Any) -> tuple[Any, Any]:
    """Call ``op`` on the rebuilt arguments; returns (what to compare, the call's result)."""
    inp, args, kwargs = tree_unflatten(flat, spec)
    if variant == "out_of_place":
        r = op(inp, *args, **kwargs)
        return r, r
    if variant == "inplace":
        r = op.get_inplace()(inp, *args, **kwargs)
        return inp, r
    r = op(inp, *args, **kwargs, out=out)
    return out, r


def _plain(op: Any, variant: str, sample: Any, seed: int) -> tuple[str, Any]:
    """The operator on the plain full tensors: ("ok", what to compare) or ("n/a", why)."""
    flat, spec = _call_parts(sample)

    def fresh() -> list[Any]:
        return [a.clone() if isinstance(a, torch.Tensor) else a for a in flat]

    def once() -> tuple[Any, Any]:
        out = None
        if variant == "out":  # buffers shaped as the out-of-place result, filled with 7
            leaves, ospec = tree_flatten(_invoke(op, "out_of_place", fresh(), spec, None)[0])
            out = tree_unflatten([_fill_like(a) if isinstance(a, torch.Tensor) else a for a in leaves], ospec)
        args = fresh()
        torch.manual_seed(seed)
        return _invoke(op, variant, args, spec, out)[0], out

    try:
        want, out = once()
        again, _ = once()
    except Exception as exc:  # the sample does not apply to this variant
        return "n/a", f"plain raises {type(exc).__name__}"
    if variant == "out" and (out is None or not _tensors(tree_flatten(out)[0])):
        return "n/a", "no tensor result for out="
    values = op.name not in UNINITIALISED
    if _verdict_value(want, again, (0.0, 0.0), values=values)[0] != "exact":
        return "n/a", "nondeterministic under a fixed seed"
    if variant == "out":  # torch's own out= must agree with its out-of-place result to be a reference
        torch.manual_seed(seed)
        functional = _invoke(op, "out_of_place", fresh(), spec, None)[0]
        if _verdict_value(want, functional, tolerance(op), values=values)[0] not in GOOD:
            return "n/a", "torch's own out= result differs from its out-of-place result"
    return "ok", (want, out)


def _leaf_signature(a: Any) -> tuple:
    if isinstance(a, DTensor):
        return ("D", type(a).__name__, tuple(str(p) for p in a.placements), tuple(a.shape), str(a.dtype))
    if isinstance(a, torch.Tensor):
        return ("T", tuple(a.shape), str(a.dtype))
    return ("V", type(a).__name__)


def _sample_signature(sample: Any) -> list[tuple]:
    """What every rank must agree on before a sample's trials: each argument's shape and dtype,
    and every non-tensor argument's value (a sample function that iterates a ``set`` of strings,
    as meshgrid's does over ``{'xy', 'ij'}``, orders it by the process's string hash)."""
    flat, _ = _call_parts(sample)
    return [_leaf_signature(a) if isinstance(a, torch.Tensor) else ("V", repr(a)) for a in flat]


def _digest(obj: Any) -> int:
    return zlib.crc32(repr(obj).encode()) & 0x7FFFFFFF


def _agree(signature: Any) -> list[Any] | None:
    """None when every rank has the same ``signature`` (one all-gather of a digest); else every
    rank's signature (one all_gather_object, taken by all ranks together)."""
    W = dist.get_world_size()
    mine = torch.tensor([_digest(signature)], dtype=torch.int64)
    every = [torch.empty_like(mine) for _ in range(W)]
    dist.all_gather(every, mine)
    if all(int(e) == int(mine) for e in every):
        return None
    gathered: list[Any] = [None] * W
    dist.all_gather_object(gathered, signature)
    return gathered


def _any_rank(flag: bool) -> bool:
    t = torch.tensor([int(flag)], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _names_operator(op: Any, message: str) -> bool:
    """A refusal names the operator: an aten/c10d overload, or the OpInfo's own name."""
    names = {op.name, op.name.split(".")[-1], getattr(op, "aten_name", None) or op.name}
    return bool(_NAMES_OPERATOR.search(message)) or any(n and re.search(rf"\b{re.escape(n)}\b", message) for n in names)


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a plain dense strided tensor with no lazy conjugate or negative bit."""
    if t.layout != torch.strided:
        t = t.to_dense()
    return t.resolve_conj().resolve_neg()


def _same(got: torch.Tensor, want: torch.Tensor, tol: tuple[float, float], values: bool = True) -> tuple[str, str]:
    if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
        return "WRONG", f"dtype/shape {got.dtype}{tuple(got.shape)} vs {want.dtype}{tuple(want.shape)}"
    if not values:
        return "exact", ""
    got, want = _dense(got), _dense(want)
    if got.is_complex():
        got, want = torch.view_as_real(got), torch.view_as_real(want)
    if got.dtype == torch.bool or not (got.is_floating_point()):
        return ("exact", "") if torch.equal(got, want) else ("WRONG", "values differ")
    both_nan = torch.isnan(got) & torch.isnan(want)
    if bool(((got == want) | both_nan).all()) and torch.equal(
        torch.signbit(got[~both_nan]), torch.signbit(want[~both_nan])
    ):
        return "exact", ""
    try:
        torch.testing.assert_close(got, want, atol=tol[0], rtol=tol[1], equal_nan=True)
    except AssertionError:
        diff = (got.double() - want.double()).abs()
        diff = diff[~both_nan]
        return "WRONG", f"max abs diff {float(diff.max()) if diff.numel() else math.nan:.3g}"
    return "close", ""


def _verdict_value(got: Any, want: Any, tol: tuple[float, float], values: bool = True) -> tuple[str, str]:
    """Compare two results leaf by leaf (tensors already plain); ``values=False`` compares
    tensors' shapes and dtypes only (uninitialised memory: ``empty_like``)."""
    g, gs = tree_flatten(got)
    w, ws = tree_flatten(want)
    if len(g) != len(w):
        return "WRONG", f"{len(g)} results vs {len(w)}"
    worst = ("exact", "")
    for i, (a, b) in enumerate(zip(g, w, strict=True)):
        if isinstance(b, torch.Tensor):
            if not isinstance(a, torch.Tensor):
                return "WRONG", f"result {i}: {type(a).__name__}, expected a tensor"
            v = _same(a, b, tol, values)
        elif isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
            v = ("exact", "")
        else:
            v = ("exact", "") if a == b else ("WRONG", f"result {i}: {a!r} vs {b!r}")
        if v[0] == "WRONG":
            return v[0], f"result {i}: {v[1]}"
        if v[0] == "close":
            worst = v
    return worst


def run_trial(op: Any, trial: Trial, sample: Any, tol: tuple[float, float]) -> dict[str, Any]:
    """One trial on this rank (every rank calls it for the same trial, in the same order): the
    call on fresh arguments, and again where the first recorded a decision on some rank
    (``owner_dtensor/decisions.py``), so that the second takes it; the first verdict that is not
    good, else the last one's. (A call that recorded nothing would take the same rules again.)"""
    W = dist.get_world_size()
    plain = _plain(op, trial.variant, sample, trial.seed)
    if _any_rank(plain[0] == "n/a"):  # every rank skips the trial together
        return {"verdict": "n/a", "detail": plain[1] if plain[0] == "n/a" else "n/a on another rank"}
    want, out_plain = plain[1]
    result: dict[str, Any] = {}
    mesh = world_mesh()  # held across both calls: its recorded decisions live on it
    for call in ("first call", "second call (recorded decisions)"):
        recorded = _decisions(mesh)
        result = _one_call(op, trial, sample, tol, W, want, out_plain, mesh)
        if result["verdict"] not in GOOD:
            result["detail"] = f"{call}: {result['detail']}"
            return result
        if not _any_rank(_decisions(mesh) != recorded):
            break
    return result


def _decisions(mesh: Any) -> tuple[int, int]:
    """Which table of recorded decisions the mesh holds, and how many (``decisions._store``)."""
    table = mesh.__dict__.get("_owner_layout_decisions")
    return (id(table), len(table) if table is not None else 0)


def _one_call(
    op: Any, trial: Trial, sample: Any, tol: tuple[float, float], W: int, want: Any, out_plain: Any, mesh: Any
) -> dict[str, Any]:
    """The trial's call once, on owner-layout arguments built afresh, and its verdict."""
    flat, spec = _call_parts(sample)
    tensors = _tensors(flat)
    placed = iter(assign(trial.layout, tensors, W))
    flat_dt = [build(a, next(placed), mesh) if isinstance(a, torch.Tensor) else a for a in flat]
    out_dt = None
    if trial.variant == "out":
        leaves, ospec = tree_flatten(out_plain)
        out_dt = tree_unflatten(
            [
                build(_fill_like(a), placement_for(trial.layout, 0, a, W), mesh) if isinstance(a, torch.Tensor) else a
                for a in leaves
            ],
            ospec,
        )
    torch.manual_seed(trial.seed)
    try:
        got, _ = _invoke(op, trial.variant, flat_dt, spec, out_dt)
        raised: tuple[str, str] | None = None
    except Exception as exc:
        raised = (type(exc).__name__, str(exc).splitlines()[0][:300] if str(exc) else "")
        got = None
    signature = ("raised", raised[0]) if raised else ("ok", [_leaf_signature(a) for a in tree_flatten(got)[0]])
    disagreement = _agree(signature)
    if disagreement is not None:
        kinds = {s[0] for s in disagreement}
        verdict = "RAISED-ON-SOME-RANKS" if kinds == {"raised", "ok"} else "DIFFERS-ACROSS-RANKS"
        return {"verdict": verdict, "detail": f"{raised or ''} signatures {disagreement}"[:600]}
    if raised is not None:
        if _names_operator(op, raised[1]):
            return {"verdict": "refused", "detail": f"{raised[0]}: {raised[1]}"}
        return {"verdict": "RAISED-UNNAMED", "detail": f"{raised[0]}: {raised[1]}"}
    # every rank has a result of the same structure: read every DTensor leaf back (collectives)
    leaves, gspec = tree_flatten(got)
    read: list[Any] = []
    for a in leaves:
        if isinstance(a, DTensor):
            try:
                read.append(a.full_tensor())
            except Exception as exc:  # placement agreed on every rank: so does this
                return {"verdict": "READ-RAISED", "detail": f"full_tensor(): {type(exc).__name__}: {exc}"[:400]}
        else:
            read.append(a)
    try:
        verdict, detail = _verdict_value(tree_unflatten(read, gspec), want, tol, values=op.name not in UNINITIALISED)
    except Exception as exc:  # a result this harness cannot compare: reported, never passed
        verdict, detail = "HARNESS-ERROR", f"{type(exc).__name__}: {exc}"[:300]
    return {"verdict": verdict, "detail": detail}


# -- which trials ------------------------------------------------------------------------------------
def _layouts(mode: str, op_index: int, W: int, tensors: list[torch.Tensor]) -> list[str]:
    """Layouts of the trials of one sample: every applicable one in the long form; one, rotated
    over operators (and offset by W, so W=2 and W=3 cover different ones), by default."""
    from _owner_layouts import LAYOUTS

    fit = [lay for lay in LAYOUTS if applicable(lay, tensors)]
    if mode == "long" or not fit:
        return fit
    return [fit[(op_index + W) % len(fit)]]


def _variants(op: Any, sample: Any) -> list[str]:
    out = ["out_of_place"]
    if op.get_inplace() is not None and isinstance(sample.input, (torch.Tensor, list, tuple)):
        if not getattr(sample, "broadcasts_input", False):
            out.append("inplace")
    if op.supports_out:
        out.append("out")
    return out


FIRST_SAMPLES = 8  # the default run tries the first sample with a dense tensor among these


def _pick_samples(op: Any, name: str, mode: str) -> list[tuple[int, Any]]:
    """(index, sample) pairs to run: every sample in the long form; by default the first sample
    (of the first :data:`FIRST_SAMPLES`) whose arguments include a dense tensor to lay out
    (factory functions' first samples often have none)."""
    it = samples(op, zlib.crc32(name.encode()) & 0x7FFFFFFF)
    if mode == "long":
        return list(enumerate(it))
    for s, sample in enumerate(it):
        if s >= FIRST_SAMPLES:
            break
        tensors = _tensors(_call_parts(sample)[0])
        if tensors and all(_supported(t) for t in tensors):
            return [(s, sample)]
    return []


@dataclass
class _Log:
    """This rank's verdict file (JSON lines: a ``start`` line before each trial, then its verdict)."""

    path: str
    f: Any = None

    def __enter__(self) -> _Log:
        self.f = open(self.path, "a")  # noqa: SIM115 - closed by __exit__
        return self

    def __exit__(self, *exc: object) -> None:
        self.f.close()

    def write(self, **row: Any) -> None:
        self.f.write(json.dumps(row) + "\n")
        self.f.flush()


def rank_job(rank: int, W: int, mode: str, start: int, log_dir: str, only: frozenset[str] | None = None) -> int:
    """Run the trials of operators ``start:`` (those named in ``only``, if given) on this rank;
    returns how many it ran."""
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # deprecations the samples trigger, once per rank and op
    ops = operators()
    n = 0
    with _Log(os.path.join(log_dir, f"rank{rank}.jsonl")) as log:
        if start == 0:
            log.write(operators=[_full_name(op) for op in ops])
        for i in range(start, len(ops)):
            began = time.perf_counter()
            op = ops[i]
            name = _full_name(op)
            if only is not None and name not in only:
                continue
            tol = tolerance(op)
            try:
                sample_list = _pick_samples(op, name, mode)
            except Exception as exc:
                log.write(
                    op=i, name=name, key=f"{name}|samples", verdict="n/a", detail=f"samples raise {type(exc).__name__}"
                )
                sample_list = []
            if not sample_list:
                log.write(op=i, name=name, key=f"{name}|samples", verdict="n/a", detail="no sample with a dense tensor")
            differing = _agree([(s, _sample_signature(sample)) for s, sample in sample_list])
            if differing is not None:  # a trial would compare different calls across ranks
                log.write(op=i, name=name, key=f"{name}|samples", verdict="SAMPLES-DIFFER", detail=str(differing)[:600])
                sample_list = []
            for s, sample in sample_list:
                tensors = _tensors(_call_parts(sample)[0])
                if not tensors or not all(_supported(t) for t in tensors):
                    log.write(op=i, name=name, key=f"{name}|s{s}", verdict="n/a", detail="no dense tensor argument")
                    continue
                for layout in _layouts(mode, i, W, tensors):
                    for variant in _variants(op, sample):
                        trial = Trial(i, name, s, layout, variant)
                        log.write(op=i, name=name, key=trial.key, start=True)
                        res = run_trial(op, trial, sample, tol)
                        log.write(op=i, name=name, key=trial.key, layout=layout, variant=variant, **res)
                        n += 1
            log.write(op=i, name=name, done=True, seconds=round(time.perf_counter() - began, 4))
    return n


# -- the parent: run, resume after a hang, compare the ranks' files -----------------------------------
@dataclass
class Summary:
    """Every trial's verdict (one per trial when the ranks agree, ``other`` detail otherwise)."""

    W: int
    trials: dict[str, dict[str, Any]] = field(default_factory=dict)  # key -> {verdict, detail, op, ...}
    aborted: list[str] = field(default_factory=list)
    operator_names: list[str] = field(default_factory=list)  # every operator with float32 samples

    def counts(self) -> dict[str, int]:
        c = Counter("exact" if t["verdict"] in ("exact", "close") else t["verdict"] for t in self.trials.values())
        return dict(sorted(c.items()))

    def other(self) -> dict[str, dict[str, Any]]:
        return {k: t for k, t in self.trials.items() if t["verdict"] not in (*GOOD, "n/a")}

    def refused_operators(self) -> list[str]:
        return sorted({t["name"] for t in self.trials.values() if t["verdict"] == "refused"})

    def covered_operators(self) -> set[str]:
        """Operators with at least one compared (non-n/a) trial."""
        return {t["name"] for t in self.trials.values() if t["verdict"] != "n/a"}

    def grid(self) -> dict[str, dict[str, int]]:
        """Counts per (layout, variant): exact / refused / other."""
        g: dict[str, Counter] = defaultdict(Counter)
        for t in self.trials.values():
            if t["verdict"] == "n/a" or "layout" not in t:
                continue
            cls = (
                "exact"
                if t["verdict"] in ("exact", "close")
                else t["verdict"]
                if t["verdict"] == "refused"
                else "other"
            )
            g[f"{t['layout']}/{t['variant']}"][cls] += 1
        return {k: dict(v) for k, v in sorted(g.items())}


def _read(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    rows = []
    with open(path) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # the last line of a killed rank
                break
    return rows


def summarize(W: int, log_dir: str, summary: Summary) -> int | None:
    """Fold the ranks' files into ``summary``; returns the index of the operator a hang aborted
    (the first not done on every rank), or None when every rank finished."""
    per_rank = [_read(os.path.join(log_dir, f"rank{r}.jsonl")) for r in range(W)]
    verdicts: list[dict[str, dict[str, Any]]] = []
    done: list[set[int]] = []
    in_flight: list[str | None] = []
    for rows in per_rank:
        v: dict[str, dict[str, Any]] = {}
        d: set[int] = set()
        last = None
        for row in rows:
            if "operators" in row:
                summary.operator_names = row["operators"]
                continue
            if row.get("done"):
                d.add(row["op"])
            elif row.get("start"):
                last = row["key"]
            else:
                v[row["key"]] = row
                if row["key"] == last:
                    last = None
        verdicts.append(v)
        done.append(d)
        in_flight.append(last)
    keys = {k for v in verdicts for k in v}
    for key in sorted(keys):
        rows = [v.get(key) for v in verdicts]
        present = [r for r in rows if r is not None]
        base = dict(present[0])
        if len(present) < W:
            continue  # the aborted trial: recorded below
        # "exact" on one rank and "close" on another agree: both are within the OpInfo's
        # tolerance of the plain result (LAPACK's least squares can round differently in two
        # processes on the same input, as it does for two stock DTensor replicas)
        if len({"exact" if r["verdict"] == "close" else r["verdict"] for r in present}) > 1:
            base["verdict"] = "DIFFERS-ACROSS-RANKS"
        elif base["verdict"] == "exact" and any(r["verdict"] == "close" for r in present):
            base["verdict"] = "close"
        if len({r["detail"] for r in present}) > 1:
            base["detail"] = "; ".join(f"rank {r}: {x['verdict']} {x['detail']}" for r, x in enumerate(present))[:800]
        summary.trials[key] = base
    every_done = set.intersection(*done) if done else set()
    started = {row["op"] for rows in per_rank for row in rows if "op" in row}
    pending = sorted(started - every_done)
    if not pending:
        return None
    op = pending[0]
    flight = next((k for k in in_flight if k is not None), f"op {op}")
    name = next((row["name"] for rows in per_rank for row in rows if row.get("op") == op), str(op))
    summary.trials[flight] = {"op": op, "name": name, "verdict": "ABORTED", "detail": "a rank timed out or died"}
    summary.aborted.append(flight)
    return op


def run_world(
    W: int,
    mode: str,
    *,
    max_aborts: int | None = None,
    on_abort: Callable[[str], None] | None = None,
    only: frozenset[str] | None = None,
) -> Summary:
    """Every operator's trials at world size ``W``, resuming after each hang at the next
    operator (at most ``max_aborts`` times, then the rest is left unrun and reported)."""
    summary = Summary(W)
    start = 0
    with tempfile.TemporaryDirectory(prefix="moo-opinfo-") as root:
        attempt = 0
        while True:
            log_dir = os.path.join(root, f"attempt{attempt}")
            os.makedirs(log_dir)
            try:
                spawn_ranks(rank_job, W, mode, start, log_dir, only, timeout_s=PG_TIMEOUT_S)
                crashed = None
            except RankError as exc:
                crashed = str(exc)
            aborted_at = summarize(W, log_dir, summary)
            if crashed is None and aborted_at is None:
                break
            if aborted_at is None:  # a rank failed outside any trial: a harness error
                raise RuntimeError(f"the OpInfo job at W={W} failed outside a trial:\n{crashed}")
            summary.trials[summary.aborted[-1]]["detail"] = (crashed or "a rank timed out or died")[-800:]
            if on_abort is not None:
                on_abort(f"W={W}: aborted at {summary.aborted[-1]}: {(crashed or '')[:300]}")
            attempt += 1
            start = aborted_at + 1
            total = len(summary.operator_names)
            if start >= total or (max_aborts is not None and attempt > max_aborts):
                if start < total:
                    summary.trials[f"ops {start}.. not run"] = {
                        "op": start,
                        "name": f"{total - start} operators",
                        "verdict": "NOT-RUN",
                        "detail": f"left after {attempt} aborts",
                    }
                break
    return summary


__all__ += ["SINGLE", "operator_names_without_float32", "operators", "rank_job", "run_trial", "tolerance"]

"""Every package name the package's own docstrings and messages quote exists.

The strings read are every string literal of the package's source (docstrings, error and warning
messages, f-string text). A name is *quoted* when it stands in a code span: ````x````, ```x```
or a Sphinx role (``:class:`x```, ``:meth:`x```, ...). These rules check it (what no rule claims
is prose, a value, a shape or a call on a user object, and is not checked):

- **import path**: a dotted span starting ``torch.`` or ``matrix_owner_optim.`` or one of the
  package's subpackages (``planning.Role``, ``sharding.fully_shard``): it imports and each
  further part is an attribute (the last may be an attribute a package class sets on ``self``).
- **member**: ``Class.member`` where ``Class`` is a package class, quoted or not (an error
  message names ``OwnerDTensor.make`` in plain text): the class or a base of it has the member.
- **CamelCase name** (three or more characters): a name the package defines, a builtin (an
  exception type), a name of one of ``NAMESPACES``, the torch modules the package builds on, or
  one of ``OTHERS``.
- **source file**: ``x.py`` or ``a/b.py``: a file of the package (a bare name anywhere in it).

A span equal to a string value the package's code uses (an entry-point group, a dispatch key it
looks for) names that value and is not a symbol.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import re
from functools import cache
from types import ModuleType

from _package_index import PKG, package_index

# Where a CamelCase name the package quotes may come from besides the package itself: torch's
# modules it builds on, mirrors or refuses (module -> why its names are quoted).
NAMESPACES = {
    "torch": "tensors, dtypes, devices",
    "torch.nn": "the modules a plan reads (Linear, Embedding, ...)",
    "torch.optim": "the optimizers the package wraps or compares with",
    "torch.distributed": "process groups",
    "torch.distributed.device_mesh": "DeviceMesh",
    "torch.distributed.tensor": "DTensor and its placements",
    "torch.distributed.tensor.parallel": "TP's ColwiseParallel / RowwiseParallel",
    "torch.distributed.tensor.placement_types": "_StridedShard",
    "torch.distributed.fsdp": "FSDP2's API, mirrored (FSDPModule, MixedPrecisionPolicy, ...)",
    "torch.distributed.fsdp._fully_shard._fsdp_state": "FSDPState, the model for OwnerShardState",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group": "RegisterPostBackwardFunction, mirrored",
    "torch.distributed.optim": "ZeroRedundancyOptimizer, the replicated layout's model",
    "torch.distributed.checkpoint": "DCP's planners and metadata",
    "torch.distributed.checkpoint.state_dict": "StateDictOptions",
    "torch.distributed.pipelining": "PipelineStage",
    "torch.autograd": "Function, the post-backward hooks",
}
# Quoted names from outside torch: name -> where it is from and why it is named.
OTHERS = {"ModelOutput": "transformers' output dataclass, which sharding/outputs.py walks"}

SPAN = re.compile(r":[a-z]+:`~?([^`]+)`|``([^`]+)``|(?<![`\w])`([^`\s][^`]*)`(?![`\w])")
DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
CAMEL = re.compile(r"_?[A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*")
MEMBER = re.compile(r"(?<![\w.])(_?[A-Z]\w*[a-z]\w*)\.([A-Za-z_]\w*)")


# -- the package's strings ----------------------------------------------------------------------
@cache
def _read() -> tuple[list[tuple[str, int, str]], frozenset[str]]:
    """(module, line, text) for every string literal of the package, and the string values its
    code uses (the literals that are not docstrings); one walk of every module."""
    strings, docs, values = [], set(), []
    for mod, tree in package_index().modules.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = node.body[0] if node.body else None
                if isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant):
                    docs.add(id(doc.value))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                strings.append((mod, node.lineno, node.value))
                values.append(node)
    return strings, frozenset(n.value for n in values if id(n) not in docs)


def _strings() -> list[tuple[str, int, str]]:
    return _read()[0]


def _values() -> frozenset[str]:
    return _read()[1]


@cache
def _namespaces() -> tuple[ModuleType, ...]:
    return (builtins, *(importlib.import_module(m) for m in NAMESPACES))


@cache
def _subpackages() -> frozenset[str]:
    return frozenset(p.name for p in PKG.iterdir() if (p / "__init__.py").exists())


# -- the rules -----------------------------------------------------------------------------------
def _resolve_import(parts: list[str]) -> str | None:
    """None if ``parts`` imports (the longest importable module prefix, then attributes)."""
    for n in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:n]))
        except ImportError:
            continue
        for i, part in enumerate(parts[n:], start=n):
            if hasattr(obj, part):
                obj = getattr(obj, part)
            elif isinstance(obj, type) and i == len(parts) - 1 and package_index().has_member(obj.__name__, part):
                return None  # an attribute the class sets on self
            else:
                return f"{'.'.join(parts[:i])} has no attribute {part!r}"
        return None
    return "imports nothing"


def _claims(span: str) -> bool:
    """Whether a rule claims the code span ``span`` (see the module docstring)."""
    core = re.sub(r"\(.*\)$", "", span.strip())
    if re.fullmatch(r"[\w/]+\.py", core):
        return True
    if DOTTED.fullmatch(core):
        first = core.split(".")[0]
        return first in ("torch", "matrix_owner_optim") or first in _subpackages() or first in package_index().classes
    return bool(CAMEL.fullmatch(core)) and len(core) >= 3


def _problem(span: str) -> str | None:
    """None if the claimed span ``span`` names what exists; else what is wrong."""
    idx = package_index()
    core = re.sub(r"\(.*\)$", "", span.strip())
    if core in _values():
        return None
    if re.fullmatch(r"[\w/]+\.py", core):
        found = (PKG / core).exists() if "/" in core else any(PKG.rglob(core))
        return None if found else f"no file {core} in the package"
    if DOTTED.fullmatch(core):
        parts = core.split(".")
        if parts[0] in idx.classes:
            return None if idx.has_member(parts[0], parts[1]) else f"{parts[0]} has no member {parts[1]!r}"
        if parts[0] in _subpackages():
            parts = ["matrix_owner_optim", *parts]
        return _resolve_import(parts)
    if idx.defined(core) or core in OTHERS or any(hasattr(ns, core) for ns in _namespaces()):
        return None
    return f"no name {core} in the package, the builtins, NAMESPACES or OTHERS"


def _unquoted_member_problem(text: str) -> list[tuple[str, str]]:
    """``Class.member`` in plain text, ``Class`` a package class: (name, why) where the member
    is missing."""
    idx = package_index()
    out = []
    for m in MEMBER.finditer(text):
        cls, member = m.groups()
        if cls in idx.classes and not idx.has_member(cls, member) and m.group(0) not in _values():
            out.append((m.group(0), f"{cls} has no member {member!r}"))
    return out


def _spans(text: str) -> list[str]:
    return [next(g for g in m.groups() if g is not None) for m in SPAN.finditer(text)]


def _missing() -> list[tuple[str, int, str, str]]:
    out = []
    for mod, line, text in _strings():
        for span in _spans(text):
            if _claims(span):
                why = _problem(span)
                if why is not None:
                    out.append((mod, line, span, why))
        out += [(mod, line, name, why) for name, why in _unquoted_member_problem(text)]
    return sorted(set(out))


# -- the tests -----------------------------------------------------------------------------------
def test_the_rules_claim_the_quoted_names() -> None:
    """The rules see what they are meant to (a parser that claims nothing would pass the test
    below vacuously): names of each kind that the package's strings quote."""
    quoted = {span for _, _, text in _strings() for span in _spans(text)}
    claimed = {span for span in quoted if _claims(span)}
    for expected in ("OwnerRoutedOptimizer", "MatrixShard.row_owners", "DTensor", "planning.plan_tensors"):
        assert expected in claimed, expected
    for kind in (
        lambda s: s.startswith("torch."),
        lambda s: s.split(".")[0] in _subpackages(),
        lambda s: "." in s and s.split(".")[0] in package_index().classes,
        lambda s: s.endswith(".py"),
    ):
        assert any(kind(s) for s in claimed)
    for prose in ("matrix", "[out, in]", "model.parameters()", "p.grad", "W"):
        assert not _claims(prose), prose
    assert len(claimed) >= 150, len(claimed)


def test_the_rules_reject_names_that_do_not_exist() -> None:
    """The stale names issue 42 found, and one of each kind."""
    for wrong in (
        "OwnedTensor",
        "OwnerDTensor.from_full",
        "planning.NoSuchThing",
        "torch.distributed.fsdp.no_such_function",
        "MatrixShard.no_such_field",
        "no_such_module.py",
        "sharding/no_such_file.py",
    ):
        assert _claims(wrong) and _problem(wrong) is not None, wrong
    assert _unquoted_member_problem("use (OwnerDTensor.from_full) instead") != []
    assert _unquoted_member_problem("use OwnerDTensor.make instead") == []


def test_every_name_the_package_quotes_exists() -> None:
    missing = _missing()
    assert not missing, "the package's strings quote names that do not exist:\n" + "\n".join(
        f"  {mod} line {line}: `{span}`: {why}" for mod, line, span, why in missing
    )

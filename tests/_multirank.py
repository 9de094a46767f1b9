"""Which tests spawn ranks: the static check behind the ``multirank`` marker (see conftest.py).

A test spawns ranks when its function, or a fixture it uses, reaches one of the spawning
primitives below, directly or through module-level code of its own file or of a helper module
beside it in tests/ (``from _ref import ...``). The check reads source, not behaviour: it follows
every name a function mentions, called or not, so it errs towards "spawns" (a helper that could
spawn is enough), never towards "does not". What it cannot see: spawning hidden behind a name
built at run time (``getattr(mod, "spawn_" + "ranks")``), or inside the package other than the
CLI commands listed; no test here does that.

Spawning primitives, each a way this suite starts rank processes:

- ``spawn_ranks`` (toolbox/launch.py): the launcher, used by nearly every multi-rank test;
- ``<torch.>multiprocessing.spawn`` / ``start_processes`` / ``Process``: direct process starts;
- a string naming ``torchrun``, ``torch.distributed.run``, ``torch.multiprocessing``, ``mp.spawn``
  or ``spawn_ranks``: a subprocess (or a script it writes) that launches ranks itself;
- a list or tuple literal whose first element is ``"train"`` or ``"bench"``: the argv of the
  package CLI's two commands that call ``spawn_ranks`` (cli/train.py, cli/bench.py).
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass, field
from pathlib import Path

SPAWN_NAMES = frozenset({"spawn_ranks"})
MULTIPROCESSING_MODULES = frozenset({"multiprocessing", "torch.multiprocessing"})
MULTIPROCESSING_STARTS = frozenset({"spawn", "start_processes", "Process"})
SPAWN_STRINGS = ("torchrun", "torch.distributed.run", "torch.multiprocessing", "mp.spawn", "spawn_ranks")
CLI_SPAWNING_COMMANDS = frozenset({"train", "bench"})


@dataclass
class _Node:
    """One module-level definition: a function, a class or an assigned name."""

    reason: str | None = None  # the primitive it mentions itself, if any
    refs: set[str] = field(default_factory=set)  # module-level names it mentions


@dataclass
class _Module:
    nodes: dict[str, _Node]
    imports: dict[str, tuple[Path, str]]  # local name -> (helper file in tests/, its name there)


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of docstring constants: prose about spawning is not spawning."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def _direct_reason(tree: ast.AST, mp_aliases: set[str]) -> str | None:
    docstrings = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in SPAWN_NAMES:
            return node.id
        if isinstance(node, ast.Attribute):
            if node.attr in SPAWN_NAMES:
                return node.attr
            if node.attr in MULTIPROCESSING_STARTS and _dotted(node.value) in mp_aliases:
                return f"{_dotted(node.value)}.{node.attr}"
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            for s in SPAWN_STRINGS:
                if s in node.value:
                    return f"the string {s!r}"
        if isinstance(node, (ast.List, ast.Tuple)) and node.elts:
            first = node.elts[0]
            if isinstance(first, ast.Constant) and first.value in CLI_SPAWNING_COMMANDS:
                return f"the CLI command {first.value!r}"
    return None


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _names(tree: ast.AST) -> set[str]:
    """Every bare name the code mentions (loads and argument names: a test's arguments name its
    fixtures, and fixtures are module-level functions too)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            out.add(node.id)
        elif isinstance(node, ast.arg):
            out.add(node.arg)
    return out


@functools.cache
def _module(path: Path) -> _Module:
    tree = ast.parse(path.read_text(), filename=str(path))
    mp_aliases = set(MULTIPROCESSING_MODULES)
    imports: dict[str, tuple[Path, str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in MULTIPROCESSING_MODULES:
                    mp_aliases.add(a.asname or a.name)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                if f"{node.module}.{a.name}" in MULTIPROCESSING_MODULES:
                    mp_aliases.add(a.asname or a.name)
            helper = path.parent / f"{node.module}.py"
            if helper.is_file() and helper.name != Path(__file__).name:  # the check names, not spawns
                for a in node.names:
                    imports[a.asname or a.name] = (helper, a.name)
    nodes: dict[str, _Node] = {}
    for stmt in tree.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            targets = [stmt.name]
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            lhs = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            targets = [n.id for t in lhs for n in ast.walk(t) if isinstance(n, ast.Name)]
        else:
            continue
        for name in targets:
            node = nodes.setdefault(name, _Node())
            node.reason = node.reason or _direct_reason(stmt, mp_aliases)
            node.refs |= _names(stmt) - {name}
    return _Module(nodes, imports)


def spawn_path(path: Path, name: str, _seen: frozenset[tuple[Path, str]] = frozenset()) -> list[str] | None:
    """How module-level ``name`` of ``path`` reaches a spawning primitive: the chain of names
    ending in the primitive, or None if it does not."""
    key = (path, name)
    if key in _seen:
        return None
    mod = _module(path)
    if name not in mod.nodes:
        if name in mod.imports:
            helper, inner = mod.imports[name]
            sub = spawn_path(helper, inner, _seen | {key})
            return None if sub is None else [f"{helper.stem}.{inner}", *sub[1:]]
        return None
    node = mod.nodes[name]
    if node.reason:
        return [name, node.reason]
    for ref in sorted(node.refs):
        sub = spawn_path(path, ref, _seen | {key})
        if sub is not None:
            return [name, *sub]
    return None

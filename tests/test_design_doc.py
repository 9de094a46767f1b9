"""Every package symbol DESIGN.md names exists.

DESIGN.md's inline code spans are read with these rules (a span any rule claims is checked; the
rest is prose, values, shapes or torch's own calls on user objects and is not):

- **path**: ``x.py``, ``dir/`` or ``a/b.py``, optionally followed by ``: Symbol``: a file or
  directory of the package (a bare file name anywhere in it), and the symbol defined there.
  Likewise every file and directory in the repository-layout block under ``src/matrix_owner_optim/``.
- **dotted**: ``a.b[.c][()]`` whose first part is a package module (``planning.Role``,
  ``cost.matrix_flops``, ``matrix_owner_optim.optim.report``), a package class
  (``MatrixShard.owner``) or one of the variables the document uses for a package object
  (``opt.``, ``advice.``, ``plan.``; see ``VARIABLES``): each part must exist, as a submodule, a
  module-level name, or a class member (a method, property, field or ``self.x`` attribute).
- **CamelCase name** (``MeshAdvice``, ``OwnerShard(0, ranges)``): a class or name defined in the
  package, or in ``NOT_PACKAGE`` (torch's and transformers' names, each with its reason).
- **call of a package function** (``plan_tensors(split_stacks=True)``): the function exists and
  every keyword is one of its parameters.
- **keyword** (``roles=``, ``split_stacks=False``): a parameter or field of a package function or
  class, or in ``NOT_PACKAGE``.
- **snake_case name** with an underscore (``reduce_grads``): an identifier the package's source
  defines or uses (torch's functions it calls count: the document names them where the package
  relies on them), or in ``NOT_PACKAGE``.

And no code span is broken across lines (Markdown renders the break as a space).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from _package_index import PKG, PackageIndex
from _package_index import package_index as _index

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "DESIGN.md"

# Names DESIGN.md uses on purpose that are not package symbols (torch's and transformers' own:
# what the package builds on, mirrors or is given): name -> why it is named.
NOT_PACKAGE = {
    "DTensor": "torch.distributed.tensor.DTensor, the base class of OwnerDTensor",
    "Partial": "DTensor's placement of a 0-dim result computed on the holder",
    "Replicate": "DTensor's placement of a parameter before the plan",
    "Shard": "DTensor's row-block placement (FSDP2's own form)",
    "_NormPartial": "torch's Partial subclass for norms (torch.distributed.tensor._ops._math_ops)",
    "RegisterPostBackwardFunction": "FSDP2's autograd function whose backward the runtime mirrors",
    "FSDPState": "FSDP2's per-call state object, the model for OwnerShardState",
    "FSDPModule": "FSDP2's module mixin, the model for OwnerShardedModule",
    "FSDPStateContext": "FSDP2's tree-wide state every FSDPState points to, the model for ShardTree",
    "DeviceMesh": "torch's device mesh (torch.distributed.device_mesh)",
    "Placement": "DTensor's placement base class, named to say UpdateLayout is not one",
    "_fully_shard/": "FSDP2's package (torch/distributed/fsdp/_fully_shard/), the model for sharding/",
    "full_state_dict": "a field of torch's StateDictOptions (get/set_model_state_dict)",
    "to_empty": "nn.Module.to_empty, the meta-device init the runtime supports",
    "vector_norm": "torch.linalg.vector_norm, which torch's clip_grad_norm_ calls",
    "gate_up_proj": "transformers' fused expert parameter, the example of a stack",
    "PipelineStage": "torch.distributed.pipelining's stage, which pipeline stages on the layout use",
    "ScheduleGPipe": "torch.distributed.pipelining's GPipe schedule, the one tested with stages",
    "stage_backward": "torch.distributed.pipelining's backward of a stage (plain autograd)",
    "scale_grads": "torch.distributed.pipelining's gradient scaling by the micro-batch count",
}

# The document's variables for package objects, resolved as these classes.
VARIABLES = {"opt": "OwnerRoutedOptimizer", "advice": "MeshAdvice", "plan": "ShardingPlan"}

IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
CAMEL = re.compile(r"_?[A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*")


# -- DESIGN.md, read as spans with their section --------------------------------------------------
def _spans() -> list[tuple[str, str, int]]:
    """(span, section heading, line) for every inline code span outside fenced blocks."""
    lines = DESIGN.read_text().splitlines(keepends=True)
    fenced = False
    for no, line in enumerate(lines):
        if line.startswith("```"):
            fenced = not fenced
            lines[no] = "\n"
        elif fenced:
            lines[no] = "\n"  # blanked: its line numbers stay, its text is not prose
    text = "".join(lines)
    headings = [(m.start(), m.group(1).strip()) for m in re.finditer(r"^#+ (.*)$", text, re.M)]
    out = []
    for m in re.finditer(r"`([^`]+)`", text):  # a span may run across a line break
        section = next((h for start, h in reversed(headings) if start < m.start()), "")
        out.append((m.group(1), section, text.count("\n", 0, m.start()) + 1))
    return out


def _layout_paths() -> list[str]:
    """The files and directories the repository-layout block lists under the package."""
    text = DESIGN.read_text()
    block = re.search(r"```\nsrc/matrix_owner_optim/.*?\n(.*?)```", text, re.S)
    assert block, "DESIGN.md lost its repository layout block"
    return re.findall(r"^  (\S+(?:/|\.py))\s", block.group(1), re.M)


# -- the rules -----------------------------------------------------------------------------------
def _path_exists(path: str) -> bool:
    if path in NOT_PACKAGE:
        return True
    if "/" in path:
        return (PKG / path).exists()
    return any(PKG.rglob(path))


def _module_of_path(path: str) -> list[str]:
    idx = _index()
    rel = path[:-3].replace("/", ".")
    return [m for m in idx.modules if m == f"matrix_owner_optim.{rel}" or m.endswith("." + rel)]


def _check_dotted(parts: list[str]) -> str | None:
    """None if the dotted name resolves; else what is missing. A class's member is checked one
    level deep (``Class.member``); a module's names through the longest module prefix."""
    idx = _index()
    if parts[0] in VARIABLES:
        parts = [VARIABLES[parts[0]], *parts[1:]]
    if parts[0] in idx.classes:
        return None if idx.has_member(parts[0], parts[1]) else f"{parts[0]} has no member {parts[1]!r}"
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if parts[0] == "matrix_owner_optim":
            mods = [m for m in idx.modules if m == prefix]
        else:
            mods = idx.modules_named(prefix)
        if not mods:
            continue
        rest = parts[n:]
        if not rest:
            return None
        for mod in mods:
            if rest[0] in idx.top[mod] and (len(rest) == 1 or idx.has_member(rest[0], rest[1])):
                return None
        return f"{prefix} has no {'.'.join(rest)!r}"
    return "no such package module"


def _claims(span: str) -> bool:
    """Whether any rule claims ``span`` (see the module docstring)."""
    s = span.strip()
    if re.fullmatch(r"[\w/]+(\.py|/)(: \w+)?", s):
        return True
    if re.fullmatch(r"[A-Za-z_]\w*(\.\w+)+(\(.*\))?", s):
        first = s.split(".")[0]
        idx = _index()
        return (
            first in VARIABLES
            or first in idx.classes
            or bool(idx.modules_named(first))
            or first == "matrix_owner_optim"
        )
    if re.fullmatch(r"[a-z_]\w*=.*", s):
        return True
    m = re.fullmatch(r"([A-Za-z_]\w*)(\(.*\))?", s)
    if m:
        name, call = m.group(1), m.group(2)
        if CAMEL.fullmatch(name):
            return True
        if call is not None:
            return name in _index().functions
        return "_" in name.strip("_") or name.startswith("_")
    return False


def _problem(span: str) -> str | None:
    """None if ``span`` names what exists; else what is wrong."""
    idx = _index()
    s = span.strip()
    m = re.fullmatch(r"([\w/]+(?:\.py|/))(?:: (\w+))?", s)
    if m:
        path, symbol = m.groups()
        if not _path_exists(path):
            return f"no file or directory {path} in the package"
        if symbol and not any(symbol in idx.top[mod] for mod in _module_of_path(path)):
            return f"{path} defines no {symbol}"
        return None
    m = re.fullmatch(r"([A-Za-z_]\w*(?:\.\w+)+)(\(.*\))?", s)
    if m:
        return _check_dotted(m.group(1).split("."))
    m = re.fullmatch(r"([a-z_]\w*)=.*", s)
    if m:
        kw = m.group(1)
        return None if kw in idx.params or kw in NOT_PACKAGE else f"no package function or class takes {kw}="
    m = re.fullmatch(r"([A-Za-z_]\w*)(\(.*\))?", s)
    name, call = m.group(1), m.group(2)
    if CAMEL.fullmatch(name):
        if name in NOT_PACKAGE or idx.defined(name):
            return None
        return f"no class or name {name} in the package"
    if call is not None:
        expr = ast.parse(s, mode="eval").body
        assert isinstance(expr, ast.Call)
        fns = idx.functions[name]
        for kw in (k.arg for k in expr.keywords if k.arg):
            ok = any(
                kw in {x.arg for x in f.args.posonlyargs + f.args.args + f.args.kwonlyargs} or f.args.kwarg for f in fns
            )
            if not ok:
                return f"{name}() takes no keyword {kw}"
        return None
    if name in idx.identifiers or name in NOT_PACKAGE:
        return None
    return f"{name} occurs nowhere in the package's source"


def _missing() -> list[tuple[str, str, int, str]]:
    out = []
    for span, section, line in _spans():
        if _claims(span):
            why = _problem(span)
            if why is not None:
                out.append((span, section, line, why))
    return out


# -- the tests -----------------------------------------------------------------------------------
def test_the_rules_claim_the_symbol_spans() -> None:
    """The rules see what they are meant to (a change to the parser that claims nothing would
    pass every other test here vacuously)."""
    claimed = {span for span, _, _ in _spans() if _claims(span)}
    for expected in (
        "planning.Role",
        "owner_dtensor/tensor.py: OwnerDTensor",
        "sharding/collectives.py: SegmentLayout",
        "MatrixShard.row_owners",
        "MeshAdvice",
        "plan_tensors(split_stacks=True)",
        "split_stacks=False",
        "cost.matrix_flops",
        "opt.routing_report()",
        "declare_matrix_view",
        "toolbox/simulate/mesh.py",
    ):
        assert expected in claimed, expected
    for prose in ("matrix", "tail", "[out, in]", "loss = model(x)", "pip install '.[cli]'", '"stack"'):
        assert prose not in claimed, prose
    assert len(claimed) >= 80, len(claimed)


def test_the_rules_reject_what_does_not_exist() -> None:
    for wrong in (
        "planning.NoSuchThing",
        "owner_dtensor.py: NoSuchClass",
        "no_such_module.py",
        "MatrixShard.no_such_field",
        "NoSuchPlacement",
        "plan_tensors(no_such_keyword=True)",
        "no_such_keyword=1",
        "no_such_helper_name",
        "opt.no_such_method()",
    ):
        assert _claims(wrong) and _problem(wrong) is not None, wrong


def test_no_code_span_is_broken_across_lines() -> None:
    broken = [(span, line) for span, _, line in _spans() if "\n" in span]
    assert not broken, f"code spans broken across lines (rendered with a space): {broken}"


def test_every_layout_path_exists() -> None:
    paths = _layout_paths()
    assert len(paths) >= 10, paths
    assert not [p for p in paths if not _path_exists(p)]


def test_every_symbol_design_md_names_exists() -> None:
    missing = _missing()
    assert not missing, "DESIGN.md names what the package does not have:\n" + "\n".join(
        f"  line {line} ({section}): `{span}`: {why}" for span, section, line, why in missing
    )


# -- statements, not only symbols ---------------------------------------------------------------
_MUTATORS = {
    "append",
    "extend",
    "add",
    "update",
    "setdefault",
    "pop",
    "popitem",
    "clear",
    "insert",
    "remove",
    "discard",
}
_CACHES = {"cache", "lru_cache"}


def _module_state(tree: ast.Module) -> set[str]:
    """The names a module binds at module level and changes afterwards (item or attribute
    assignment, a mutating method, ``global``), and its module-level functions that cache
    (``functools.cache`` / ``lru_cache``)."""
    bound: set[str] = set()
    for node in tree.body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        bound |= {t.id for t in targets if isinstance(t, ast.Name)}
    changed: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            changed |= set(node.names)
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            changed |= {
                t.value.id
                for t in targets
                if isinstance(t, (ast.Subscript, ast.Attribute)) and isinstance(t.value, ast.Name)
            }
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _MUTATORS:
            if isinstance(node.func.value, ast.Name):
                changed.add(node.func.value.id)
    caches = {
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef)
        and any(
            (d.func if isinstance(d, ast.Call) else d) is not None and _decorator_name(d) in _CACHES
            for d in node.decorator_list
        )
    }
    return (bound & changed) | caches


def _decorator_name(node: ast.expr) -> str:
    node = node.func if isinstance(node, ast.Call) else node
    return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""


def test_the_module_level_state_design_md_lists_is_what_the_modules_bind() -> None:
    """ "Module-level state that remains" lists every ``path: NAME`` of state the library keeps at
    module level (the toolbox is not the library), and nothing else."""
    text = DESIGN.read_text()
    start = text.index("### Module-level state that remains")
    section = text[start : text.index("\n## ", start)]
    listed = set(re.findall(r"`([a-z_/]+\.py): ([A-Za-z_]+)`", section))
    assert len(listed) >= 5, listed
    index = _index()
    found = {
        (index.files[name].relative_to(PKG).as_posix(), state)
        for name, tree in index.modules.items()
        if not name.startswith("matrix_owner_optim.toolbox")
        for state in _module_state(tree)
    }
    assert listed == found, f"listed, not bound: {sorted(listed - found)}; bound, not listed: {sorted(found - listed)}"


def _imports(index: PackageIndex) -> dict[str, set[str]]:
    """Package module -> the package modules it imports (relative imports resolved; imports under
    ``if TYPE_CHECKING:`` are for the type checker only and left out)."""
    out: dict[str, set[str]] = {}
    for name, tree in index.modules.items():
        package = name if index.files[name].name == "__init__.py" else name.rpartition(".")[0]
        skip = {
            id(n)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)
        }
        targets: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = package.rsplit(".", node.level - 1)[0] if node.level else ""
                mod = ".".join(p for p in (base, node.module or "") if p)
                targets |= {f"{mod}.{a.name}" if f"{mod}.{a.name}" in index.modules else mod for a in node.names}
        out[name] = {t for t in targets if t in index.modules and t != name}
    return out


def test_imports_point_the_way_design_md_says() -> None:
    """ "Imports point downward, with no cycle": ``sharding`` and ``optim`` never import each other,
    ``preconditioners`` never import ``torch.distributed``, nothing in the library imports
    ``toolbox``, and no library module imports itself back through others."""
    index = _index()
    graph = _imports(index)
    pkg = "matrix_owner_optim"
    bad = []
    for name, targets in graph.items():
        if name.startswith(f"{pkg}.toolbox") or name == f"{pkg}.__main__":  # the commands, not the library
            continue
        for a, b in ((f"{pkg}.sharding", f"{pkg}.optim"), (f"{pkg}.optim", f"{pkg}.sharding"), (pkg, f"{pkg}.toolbox")):
            if name.startswith(a) and any(t == b or t.startswith(b + ".") for t in targets):
                bad.append((name, b))
        if name.startswith(f"{pkg}.preconditioners") and any(
            isinstance(n, (ast.Import, ast.ImportFrom)) and "torch.distributed" in ast.unparse(n)
            for n in ast.walk(index.modules[name])
        ):
            bad.append((name, "torch.distributed"))
    assert not bad, bad
    library = {
        n: {t for t in ts if not t.startswith(f"{pkg}.toolbox")}
        for n, ts in graph.items()
        if not n.startswith(f"{pkg}.toolbox")
    }
    # a cycle: a module reachable from one of the modules it imports (package __init__s that
    # import their own submodules are edges like any other)
    cycles = []
    for start in library:
        seen, todo = set(), list(library[start] - {n for n in library[start] if start.startswith(n + ".")})
        while todo:
            n = todo.pop()
            if n == start:
                cycles.append(start)
                break
            if n in seen:
                continue
            seen.add(n)
            todo.extend(t for t in library.get(n, ()) if not n.startswith(t + "."))
    assert not cycles, f"import cycles through: {sorted(cycles)}"

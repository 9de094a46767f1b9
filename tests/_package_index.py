"""The package's source read once, for the tests that check the names documents and messages
quote (test_design_doc.py for DESIGN.md, test_quoted_names.py for the package's own strings):
every module's syntax tree, the classes with their members, the functions with their
parameters, and every identifier the source defines or uses."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import matrix_owner_optim

PKG = Path(matrix_owner_optim.__file__).resolve().parent


class PackageIndex:
    def __init__(self) -> None:
        self.modules: dict[str, ast.Module] = {}  # dotted module name -> its tree
        self.files: dict[str, Path] = {}
        for path in sorted(PKG.rglob("*.py")):
            rel = path.relative_to(PKG.parent).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join(parts)
            self.modules[name] = ast.parse(path.read_text(), filename=str(path))
            self.files[name] = path
        self.top: dict[str, set[str]] = {m: self._bound(t.body) for m, t in self.modules.items()}
        self.classes: dict[str, list[set[str]]] = {}  # class name -> member sets of its definitions
        self.functions: dict[str, list[ast.FunctionDef | ast.AsyncFunctionDef]] = {}
        self.params: set[str] = set()
        self.identifiers: set[str] = set()
        for tree in self.modules.values():
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    self.classes.setdefault(node.name, []).append(self._members(node))
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    self.functions.setdefault(node.name, []).append(node)
                    a = node.args
                    self.params |= {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs}
                if isinstance(node, ast.Name):
                    self.identifiers.add(node.id)
                elif isinstance(node, ast.Attribute):
                    self.identifiers.add(node.attr)
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    self.identifiers.add(node.name)
                elif isinstance(node, ast.arg):
                    self.identifiers.add(node.arg)
                elif isinstance(node, ast.keyword) and node.arg:
                    self.identifiers.add(node.arg)
                elif isinstance(node, ast.alias):
                    self.identifiers.add((node.asname or node.name).split(".")[-1])
        for members in (m for ms in self.classes.values() for m in ms):
            self.params |= members  # dataclass fields are keyword parameters too

    @staticmethod
    def _bound(body: list[ast.stmt]) -> set[str]:
        """The names a module's or class's body binds: defs, classes, assignments, imports."""
        out = set()
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                out |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                out |= {(a.asname or a.name).split(".")[0] for a in node.names}
        return out

    @classmethod
    def _members(cls, node: ast.ClassDef) -> set[str]:
        out = cls._bound(node.body)
        for sub in ast.walk(node):  # self.x = ... in any method
            if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store):
                if isinstance(sub.value, ast.Name) and sub.value.id == "self":
                    out.add(sub.attr)
        return out

    def modules_named(self, short: str) -> list[str]:
        """Package modules called ``short``: ``matrix_owner_optim.short`` or any ``*.short``."""
        return [m for m in self.modules if m == short or m.endswith("." + short)]

    def has_member(self, cls: str, member: str) -> bool:
        if any(member in ms for ms in self.classes.get(cls, [])):
            return True
        # inherited from torch (OwnerRoutedOptimizer.step, ...): ask the class itself
        for mod, names in self.top.items():
            if cls in names and cls in self.classes:
                obj = getattr(__import__(mod, fromlist=[cls]), cls, None)
                if obj is not None and hasattr(obj, member):
                    return True
        return False

    def defined(self, name: str) -> bool:
        return name in self.classes or name in self.functions or any(name in t for t in self.top.values())


@cache
def package_index() -> PackageIndex:
    """The package, parsed once per process."""
    return PackageIndex()

"""MkDocs hooks: the pages that are generated from the code and the results at build time.

A page asks for generated content with a marker line, replaced here before Markdown runs:

- ``<!-- generate: fsdp-api -->``: the FSDP2 parity tables, read from ``sharding/fsdp_api.py``'s
  ``FULLY_SHARD_ARGUMENTS`` and ``FSDP_MODULE_METHODS`` (the same dicts ``tests/test_fsdp2_api.py``
  checks against the installed torch), so the table cannot drift from the code.
- ``<!-- generate: api -->``: one mkdocstrings block per name in ``matrix_owner_optim.__all__``
  (read from the package's ``__init__.py``), then the public submodules users import.
- ``<!-- generate: benchmarks -->``: every JSON under ``benchmarks/results/``: its ``"tables"``
  (a list of ``{"title", "columns", "rows", "note"}``) when it has them, else the renderer of its
  format below; a JSON with neither fails the strict build (add a ``"tables"`` key). The PNGs
  beside them are copied into the site and shown.

The package is read statically (``ast``), as mkdocstrings reads it, except the benchmark table of
``bench.json``, which is the bench command's own renderer (``toolbox.cli.bench.markdown_table``).
"""

from __future__ import annotations

import ast
import json
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "matrix_owner_optim"
RESULTS = ROOT / "benchmarks" / "results"
PLOTS_DIR = "performance"  # where the site serves the benchmark PNGs

# Public submodules (or names in them) users import beyond ``__all__``: each gets its own section.
SUBMODULES = ["matrix_owner_optim.planning.MatrixView", "matrix_owner_optim.checkpoint"]

log = logging.getLogger("mkdocs.plugins.generate")
MARKER = re.compile(r"^<!-- generate: ([a-z-]+) -->$", re.MULTILINE)


# -- reading the package without importing it ------------------------------------------------------
def _module_assignments(path: Path) -> dict[str, Any]:
    """Module-level ``NAME = <literal>`` and ``NAME: T = <literal>`` of a source file."""
    out: dict[str, Any] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            target, value = node.targets[0].id, node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            target, value = node.target.id, node.value
        else:
            continue
        try:
            out[target] = ast.literal_eval(value)
        except ValueError:
            continue
    return out


def public_names() -> list[str]:
    """``matrix_owner_optim.__all__``, as the package's ``__init__.py`` lists it."""
    names = _module_assignments(PACKAGE / "__init__.py")["__all__"]
    return list(names)


def _outside_home(name: str) -> str | None:
    """Where a public name is defined when that is outside the package (a re-export), else None.

    mkdocstrings reads the package statically and cannot follow a re-export into torch."""
    import importlib
    import types

    obj = getattr(importlib.import_module("matrix_owner_optim"), name)
    if isinstance(obj, types.ModuleType) or not hasattr(obj, "__module__"):
        return None
    module = obj.__module__
    return None if module.split(".")[0] == "matrix_owner_optim" else f"{module}.{obj.__qualname__}"


def package_version() -> str:
    return str(_module_assignments(PACKAGE / "__init__.py")["__version__"])


# -- tables -----------------------------------------------------------------------------------------
def _cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(columns: list[str], rows: list[list[Any]], numeric: bool = True) -> str:
    """A Markdown table; columns whose every cell is a number are right-aligned."""
    align = []
    for i in range(len(columns)):
        cells = [r[i] for r in rows if i < len(r)]
        is_num = numeric and bool(cells) and all(isinstance(c, int | float) for c in cells)
        align.append("---:" if is_num else "---")
    lines = ["| " + " | ".join(_cell(c) for c in columns) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def fsdp_api_tables() -> str:
    """The two FSDP2 parity tables, from ``sharding/fsdp_api.py``."""
    values = _module_assignments(PACKAGE / "sharding" / "fsdp_api.py")
    parts = []
    for head, key in (
        ("`fully_shard` argument", "FULLY_SHARD_ARGUMENTS"),
        ("`FSDPModule` method", "FSDP_MODULE_METHODS"),
    ):
        rows = [[f"`{name}`", what] for name, what in values[key].items()]
        parts.append(markdown_table([head, "what the owner layout does"], rows))
    return "\n\n".join(parts)


def api_reference() -> str:
    """One mkdocstrings block per public name, then the public submodules."""
    parts = []
    for name in public_names():
        if name == "__version__":
            parts.append(
                '<a id="matrix_owner_optim.__version__"></a>\n\n## `matrix_owner_optim.__version__`\n\n'
                f"The package's version, `{package_version()}`: the one home of it (`pyproject.toml` reads it)."
            )
        elif (home := _outside_home(name)) is not None:
            parts.append(
                f'<a id="matrix_owner_optim.{name}"></a>\n\n## `matrix_owner_optim.{name}`\n\n'
                f"Re-exported as it is from torch: `{home}` (see PyTorch's documentation of it); "
                "the package's `fully_shard` takes it as `mp_policy=`, as FSDP2's does."
            )
        else:
            parts.append(f"::: matrix_owner_optim.{name}")
    parts.append("# Public submodules")
    parts += [f"::: {path}" for path in SUBMODULES]
    return "\n\n".join(parts)


# -- benchmark results ------------------------------------------------------------------------------
Table = tuple[str, list[str], list[list[Any]], str]  # title, columns, rows, note


def _given_tables(data: dict[str, Any]) -> list[Table]:
    return [(t["title"], list(t["columns"]), [list(r) for r in t["rows"]], t.get("note", "")) for t in data["tables"]]


def _is_bench(data: dict[str, Any]) -> bool:
    return "runs" in data and "config" in data and "layers" in data["config"]


def _bench(data: dict[str, Any]) -> str:
    from matrix_owner_optim.toolbox.cli.bench import markdown_table as bench_table

    return bench_table(data)


def _w1_overhead(data: dict[str, Any]) -> list[Table]:
    ms, ratio = data["median_ms"], data["ratio_owner_vs_plain"]
    rows = [
        [
            phase,
            round(ms["plain"][phase], 1),
            round(ms["owner"][phase], 1),
            round(ratio[phase]["median"], 3),
            f"{ratio[phase]['q1']:.3f}..{ratio[phase]['q3']:.3f}",
        ]
        for phase in ("forward", "backward", "optimizer", "step")
    ]
    cfg = data["config"]
    note = (
        f"GPT {cfg['layers']}x{cfg['width']}, both models in one process, {data['rounds']} rounds alternated; "
        f"parameters bitwise equal: {data['parameters_bitwise_equal']}."
    )
    return [
        (
            "One rank: owner layout vs the plain model",
            ["phase", "plain ms", "owner ms", "ratio (median)", "ratio IQR"],
            rows,
            note,
        )
    ]


def _dispatch_cost(data: dict[str, Any]) -> list[Table]:
    ranks = sorted(data["ranks"], key=int)
    ops = list(data["ranks"][ranks[0]])
    cols = list(data["ranks"][ranks[0]][ops[0]])
    columns = ["operator"] + [f"{c}, rank {r}" for r in ranks for c in cols]
    rows = [[op] + [round(data["ranks"][r][op][c], 1) for r in ranks for c in cols] for op in ops]
    return [("Dispatch cost per call (µs)", columns, rows, data["what"] + f"; torch {data['torch']}.")]


def _opinfo(data: dict[str, Any]) -> list[Table]:
    rows = []
    for W, d in sorted(data["world_sizes"].items(), key=lambda kv: int(kv[0])):
        c = d["counts"]
        rows.append(
            [
                int(W),
                d["operators"],
                d["operators_compared"],
                d["trials"],
                c["exact"],
                c["refused"],
                c["n/a"],
                len(d["violations"]),
                round(d["seconds"] / 60, 1),
            ]
        )
    columns = ["W", "operators", "compared", "trials", "exact", "refused", "n/a", "violations", "minutes"]
    return [(f"Owner-layout DTensors vs OpInfo ({data['mode']} form)", columns, rows, "")]


def _simulate(data: dict[str, Any]) -> list[Table]:
    strategies = list(data["strategies"])
    columns = ["nodes", "GPUs"] + [f"{s} ms" for s in strategies] + ["reconstruction / owner"]
    rows = [
        [p["world_size"] // p["gpus_per_node"], p["world_size"]]
        + [round(p["strategies"][s]["total_ms"], 1) for s in strategies]
        + [round(p["ratios"]["reconstruction_over_owner"], 1)]
        for p in data["sweep"]
    ]
    note = f"{data['preset']['description']}. Findings: " + " ".join(data["comparison"]["findings"])
    return [(f"Projected optimizer step, {data['hardware']['gpu']}", columns, rows, note)]


def _simulate_mesh(data: dict[str, Any]) -> list[Table]:
    layouts = list(data["layouts"])
    columns = ["GPUs", "hw", "advised mesh"] + [f"{name}: step ms / comm ms / GB" for name in layouts]
    rows = []
    for r in data["rows"]:
        cells = [r["world_size"], r["hardware"], str(tuple(r["advice"]["mesh_shape"]))]
        for name in layouts:
            lay = r["layouts"][name]
            cell = f"{lay['optimizer_step_ms']:.0f} / {lay['fwd_bwd_comm']['total_ms']:.0f} / {lay['max_resident_bytes'] / 1e9:.2f}"
            if "optimizer_step_ms_broadcast_deferred" in lay:  # HSDP's step with the broadcast in the next forward
                cell += f" ({lay['optimizer_step_ms_broadcast_deferred']:.0f})"
            cells.append(cell)
        rows.append(cells)
    gpt = data["config"]["model"]["gpt"]
    model = ", ".join(f"{k} {v}" for k, v in gpt.items())
    note = (
        "Optimizer step ms / forward+backward communication ms per step (serial, not overlapped) / resident GB "
        f"per rank, {data['config']['gpus_per_node']} GPUs per node; in parentheses the owner HSDP step with the "
        "replicas' broadcast deferred into the next forward. Layouts: "
        + "; ".join(f"{k}: {v}" for k, v in data["layouts"].items())
    )
    return [(f"Advised meshes ({model})", columns, rows, note)]


RENDERERS: list[tuple[Callable[[dict[str, Any]], bool], Callable[[dict[str, Any]], list[Table]]]] = [
    (lambda d: "median_ms" in d and "ratio_owner_vs_plain" in d, _w1_overhead),
    (lambda d: "ranks" in d and "what" in d, _dispatch_cost),
    (lambda d: "world_sizes" in d and "mode" in d, _opinfo),
    (
        lambda d: d.get("schema", "").startswith("matrix_owner_optim.simulate") and d.get("kind") == "mesh",
        _simulate_mesh,
    ),
    (lambda d: d.get("schema", "").startswith("matrix_owner_optim.simulate") and "sweep" in d, _simulate),
]


def result_files() -> list[Path]:
    return sorted(RESULTS.rglob("*.json"))


def plot_files() -> list[Path]:
    return sorted(RESULTS.rglob("*.png"))


def _render_tables(tables: list[Table]) -> str:
    parts = []
    for title, columns, rows, note in tables:
        parts.append(f"**{title}**\n\n{markdown_table(columns, rows)}" + (f"\n\n{note}" if note else ""))
    return "\n\n".join(parts)


def render_result(path: Path) -> str | None:
    """One results JSON as Markdown, or None when no renderer knows its format."""
    data = json.loads(path.read_text())
    if "tables" in data:
        return _render_tables(_given_tables(data))
    if _is_bench(data):
        return _bench(data)
    for matches, render in RENDERERS:
        if matches(data):
            return _render_tables(render(data))
    return None


def benchmark_section() -> str:
    parts = []
    for path in result_files():
        rel = path.relative_to(ROOT).as_posix()
        body = render_result(path)
        if body is None:
            log.warning(f"{rel}: no 'tables' key and no renderer for its format; add a 'tables' key to it")
            continue
        parts.append(f"### `{rel}`\n\n{body}")
    parts.append("### Plots")
    for png in plot_files():
        rel = png.relative_to(RESULTS).as_posix()
        parts.append(f"![{rel}]({PLOTS_DIR}/{rel})\n\n`benchmarks/results/{rel}`")
    return "\n\n".join(parts)


GENERATORS: dict[str, Callable[[], str]] = {
    "fsdp-api": fsdp_api_tables,
    "api": api_reference,
    "benchmarks": benchmark_section,
}


def expand(markdown: str) -> str:
    """Replace every marker line by its generated Markdown."""

    def one(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in GENERATORS:
            raise ValueError(
                f"unknown generator {name!r} in a '<!-- generate: ... -->' marker; known: {sorted(GENERATORS)}"
            )
        return GENERATORS[name]()

    return MARKER.sub(one, markdown)


# -- MkDocs hook entry points ---------------------------------------------------------------------
def on_files(files: Any, config: Any) -> Any:
    """Serve the benchmark PNGs next to the Performance page."""
    from mkdocs.structure.files import File

    for png in plot_files():
        rel = png.relative_to(RESULTS).as_posix()  # subfolders kept: two plots may share a name
        files.append(File.generated(config, f"{PLOTS_DIR}/{rel}", abs_src_path=str(png)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    return expand(markdown)


SPHINX_ROLE = re.compile(r":(?:class|func|meth|data|attr|mod|obj|exc):<code>~?\.?")


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    """Docstrings use Sphinx roles (``:class:`X```); shown as plain code spans."""
    return SPHINX_ROLE.sub("<code>", html)

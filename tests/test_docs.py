"""The documentation site keeps its word: it builds with warnings as errors, its API reference has
every public name, its generated pages have every row of what they are generated from, every
code block of its pages is included from a file the suite runs (or is a shell command or output),
and the errors its Troubleshooting page quotes are the library's own text.

The build is one ``mkdocs build --strict`` into a temporary directory (about 15-25 s on 2 busy
cores), shared by the tests that read the built site. The README's example is the Quickstart's
snippet, character for character, and ``examples/quickstart.py`` (that snippet) runs under
torchrun as a user runs it.
"""

from __future__ import annotations

import ast
import html
import importlib.util
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

import matrix_owner_optim
from matrix_owner_optim.sharding.fsdp_api import FSDP_MODULE_METHODS, FULLY_SHARD_ARGUMENTS
from test_examples import _run, _torchrun

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
BUILD_TIMEOUT_S = 300
SHELL_OR_OUTPUT = {"bash", "sh", "shell", "console", "text"}
SNIPPET = re.compile(r'^--8<-- "([^":]+)(?::([A-Za-z0-9_-]+))?"$')
FENCE = re.compile(r"^```([A-Za-z0-9_-]*)\s*$")


def _hooks() -> ModuleType:
    """docs/_hooks/generate.py, the pages' generator, as a module."""
    spec = importlib.util.spec_from_file_location("docs_generate", DOCS / "_hooks" / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pages() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.md") if "_hooks" not in p.parts)


def _code_blocks(text: str) -> list[tuple[str, list[str]]]:
    """Every fenced block of a Markdown text: (language, body lines)."""
    blocks: list[tuple[str, list[str]]] = []
    lang: str | None = None
    body: list[str] = []
    for line in text.split("\n"):
        m = FENCE.match(line.strip())
        if lang is None and m is not None:
            lang, body = m.group(1), []
        elif lang is not None and line.strip() == "```":
            blocks.append((lang, body))
            lang = None
        elif lang is not None:
            body.append(line)
    assert lang is None, "a fenced block is not closed"
    return blocks


def _section(path: Path, name: str) -> str:
    """The lines between ``# --8<-- [start:name]`` and ``[end:name]`` of ``path``, dedented."""
    lines = path.read_text().split("\n")
    starts = [i for i, line in enumerate(lines) if line.strip() == f"# --8<-- [start:{name}]"]
    ends = [i for i, line in enumerate(lines) if line.strip() == f"# --8<-- [end:{name}]"]
    assert len(starts) == 1 and len(ends) == 1 and starts[0] < ends[0], f"{path}: section {name!r} markers"
    return textwrap.dedent("\n".join(lines[starts[0] + 1 : ends[0]]))


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site built as the README says, warnings as errors."""
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert not re.search(r"^WARNING\s+-", proc.stderr, re.MULTILINE), proc.stderr[-4000:]  # strict: none
    return out


@pytest.mark.xdist_group("docs_site")  # one build per run: the tests reading the site share a worker
def test_api_reference_has_every_public_name(site: Path) -> None:
    page = (site / "api" / "index.html").read_text()
    ids = set(re.findall(r'id="([^"]+)"', page))
    wanted = [f"matrix_owner_optim.{name}" for name in matrix_owner_optim.__all__]
    wanted += ["matrix_owner_optim.planning.MatrixView", "matrix_owner_optim.checkpoint"]
    wanted += [f"matrix_owner_optim.checkpoint.{name}" for name in ("save", "load", "CheckpointError")]
    missing = [name for name in wanted if name not in ids]
    assert not missing, f"the API reference has no entry for {missing}"
    # the docstrings themselves are rendered, not only the headings: each summary line is on the page
    text = " ".join(html.unescape(re.sub(r"<[^>]+>", "", page)).split())
    for name in ("OwnerRoutedOptimizer", "fully_shard", "plan_mesh", "CommCounter"):
        summary = " ".join((getattr(matrix_owner_optim, name).__doc__ or "").split("\n\n")[0].split())
        summary = summary.replace("``", "")
        assert summary and summary in text, f"{name}'s docstring summary is not on the API page: {summary!r}"


@pytest.mark.xdist_group("docs_site")
def test_generated_pages_have_every_row(site: Path) -> None:
    parity = html.unescape((site / "fsdp2-parity" / "index.html").read_text())
    for name in (*FULLY_SHARD_ARGUMENTS, *FSDP_MODULE_METHODS):
        assert f"<td><code>{name}</code></td>" in parity, f"the parity page has no row for {name}"
    performance = (site / "performance" / "index.html").read_text()
    for path in sorted((ROOT / "benchmarks" / "results").rglob("*.json")):
        rel = path.relative_to(ROOT).as_posix()
        assert f"<code>{rel}</code>" in performance, f"the Performance page renders nothing of {rel}"
    results = ROOT / "benchmarks" / "results"
    for png in sorted(results.rglob("*.png")):
        rel = png.relative_to(results).as_posix()
        assert (site / "performance" / rel).is_file(), f"{rel} not served"
        assert f'src="{rel}"' in performance, f"the Performance page does not show {rel}"
    for page in site.rglob("*.html"):
        assert "--8<--" not in page.read_text(), f"{page}: a snippet include was not expanded"


def test_every_results_json_renders_and_tables_keys_render_as_given(tmp_path: Path) -> None:
    gen = _hooks()
    for path in gen.result_files():
        assert gen.render_result(path) is not None, f"{path}: no renderer and no 'tables' key"
    given = {
        "tables": [
            {
                "title": "A title",
                "columns": ["row", "ms", "ratio"],
                "rows": [["a", 1.5, 0.96], ["b|c", 2, 1]],
                "note": "n.",
            }
        ]
    }
    path = tmp_path / "x.json"
    path.write_text(json.dumps(given))
    text = gen.render_result(path)
    assert text is not None
    assert text.split("\n") == [
        "**A title**",
        "",
        "| row | ms | ratio |",
        "|---|---:|---:|",
        "| a | 1.5 | 0.96 |",
        "| b\\|c | 2 | 1 |",
        "",
        "n.",
    ]


def test_every_code_block_is_an_include_of_a_tested_file_or_shell() -> None:
    tested = " ".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py"))
    for page in _pages():
        for lang, body in _code_blocks(page.read_text()):
            if lang in SHELL_OR_OUTPUT:
                continue
            lines = [line.strip() for line in body if line.strip()]
            assert lines, f"{page}: an empty {lang} block"
            for line in lines:
                m = SNIPPET.match(line)
                assert m is not None, f"{page}: a {lang or 'plain'} block holds code, not a snippet include: {line!r}"
                src, section = m.group(1), m.group(2)
                assert (ROOT / src).is_file(), f"{page}: {src} does not exist"
                if section is not None:
                    assert _section(ROOT / src, section).strip(), f"{page}: {src}:{section} is empty"
                if src.startswith("examples/"):
                    assert Path(src).name in tested, f"{page}: {src} is run by no test"
                elif lang == "python":
                    assert src.startswith("tests/"), f"{page}: {src} is neither an example nor a test"


def test_readme_is_short_and_its_example_is_the_quickstart_snippet() -> None:
    text = README.read_text()
    assert len(text.split("\n")) <= 151, "README.md is over 150 lines"  # 150 lines and a final newline
    blocks = _code_blocks(text)
    assert blocks[0][0] == "bash", "the README opens with its two commands"
    commands = [line for line in blocks[0][1] if line.strip()]
    assert commands == [
        "pip install torch==2.13.0 && pip install -e '.[cli]' && matrix-owner-optim train",
        "pip install torch==2.13.0 && pip install -c .ci/constraints.txt -e '.[test]' && python -m pytest -n 2 -q",
    ]
    quickstart = (DOCS / "quickstart.md").read_text()
    assert all(c in quickstart for c in commands), "the Quickstart shows the README's commands"
    python = [body for lang, body in blocks if lang == "python"]
    assert python, "the README has no example"
    assert "\n".join(python[0]).strip() == _section(ROOT / "examples" / "quickstart.py", "use").strip()
    assert "mkdocs build --strict" in text, "the README names the docs' build command"


@pytest.mark.multirank
def test_quickstart_example_runs_as_written() -> None:
    out = _run(_torchrun("quickstart.py"))  # torchrun, 2 ranks; every rank exits with 0
    m = re.search(r"2 ranks, owner layout, Muon \+ AdamW: loss (\S+) -> (\S+)", out)
    assert m is not None, out
    assert float(m.group(2)) < float(m.group(1)), out  # it learned
    assert "optimizer step bytes: 0" in out, out


def _message_parts() -> list[str]:
    """Every string literal of the library, f-strings with a NUL byte where a value goes."""
    parts: list[str] = []
    for path in (ROOT / "src" / "matrix_owner_optim").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.JoinedStr):
                parts.append("".join(str(v.value) if isinstance(v, ast.Constant) else "\0" for v in node.values))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                parts.append(node.value)
    return parts


def test_troubleshooting_quotes_the_messages_the_library_raises() -> None:
    """Each quoted error on the Troubleshooting page is the library's text: its pieces between
    placeholders (``<name>``, ``...``) all appear in one of the library's string literals."""
    parts = "\1".join(_message_parts())
    quoted = re.findall(r"^\*\*`(.+?)`", (DOCS / "troubleshooting.md").read_text(), re.MULTILINE)
    assert len(quoted) >= 15, quoted
    for message in quoted:
        pieces = [p.strip() for p in re.split(r"'?<[^>]*>'?|\(\.\.\.\)|\.\.\.", message)]
        pieces = [p for p in pieces if len(p) >= 12]
        assert pieces, message
        for piece in pieces:
            assert piece in parts, f"troubleshooting.md quotes {piece!r} ({message!r}), which no message says"

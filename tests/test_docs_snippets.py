"""The documentation's Python snippets run as written: every ```python block of README.md and
docs/*.md, unless the line right before its fence says otherwise:

* ``<!-- not run: REASON -->``: not executed (the reason must be given);
* ``<!-- run: gpu -->``: executed by the ``gpu``-marked test only (needs CUDA);
* ``<!-- run: pytest -->``: the block is a pytest file, run in a fresh directory, and must pass.

Plain blocks run on CPU: each file's blocks in ONE subprocess (cwd: a temporary directory, the repo
on ``PYTHONPATH``, ``TRITON_INTERPRET`` unset so the snippets take the library's default paths),
each block ``exec``'d in a fresh namespace, in order. A failure names the file, the line and the
block's first line, with the traceback (whose line numbers are the Markdown file's). Also checked:
every docs page has content and its relative links to other Markdown files resolve.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
FILES = ([ROOT / "README.md"] if (ROOT / "README.md").exists() else []) + DOCS
TIMEOUT_S = 180  # per file (CPU) or per block (pytest files)

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`\s]*)")
_MARKER = re.compile(r"^<!--\s*(?P<kind>not run|run)\s*:\s*(?P<arg>.*?)\s*-->$")
_KINDS = {"gpu": "gpu", "pytest": "pytest"}  # `<!-- run: X -->` -> block kind


@dataclasses.dataclass
class Block:
    path: pathlib.Path
    line: int  # 1-based line of the block's first code line
    code: str
    kind: str  # "cpu", "gpu", "pytest" or "skip"
    marker: str = ""  # the marker line, as written ("" when none)
    problem: str = ""  # a malformed marker: what is wrong with it

    @property
    def name(self) -> str:
        first = next((s.strip() for s in self.code.splitlines() if s.strip()), "")
        return f"{_rel(self.path)}:{self.line} ({first[:60]})"


def _rel(path: pathlib.Path) -> str:
    try:
        return path.relative_to(ROOT).as_posix()
    except ValueError:
        return str(path)


def collect(path: pathlib.Path) -> list[Block]:
    """The ```python blocks of a Markdown file, with the kind their marker gives them."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = m.group("indent"), m.group("fence"), m.group("info").lower()
        end = i + 1
        while end < len(lines):  # the closing fence: same character, at least as long, nothing after it
            s = lines[end].strip()
            if s and set(s) == {fence[0]} and len(s) >= len(fence):
                break
            end += 1
        if info == "python":
            body = [ln[len(indent):] if ln.startswith(indent) else ln.lstrip() for ln in lines[i + 1:end]]
            marker = lines[i - 1].strip() if i > 0 else ""
            kind, problem = "cpu", ""
            mm = _MARKER.match(marker)
            if mm:
                arg = mm.group("arg")
                if mm.group("kind") == "not run":
                    kind = "skip"
                    if not arg:
                        problem = "a '<!-- not run: REASON -->' marker needs a reason"
                elif arg in _KINDS:
                    kind = _KINDS[arg]
                else:
                    kind, problem = "skip", f"unknown marker {marker!r} (use 'run: gpu' or 'run: pytest')"
            elif marker.startswith("<!--") and re.match(r"<!--\s*(not\s+)?run\b", marker):
                kind, problem = "skip", f"malformed marker {marker!r}"
            blocks.append(Block(path, i + 2, "\n".join(body) + "\n", kind, marker if mm else "", problem))
        i = end + 1
    return blocks


def _blocks(kind: str) -> list[Block]:
    return [b for f in FILES for b in collect(f) if b.kind == kind]


# A subprocess runs the blocks it reads from stdin (JSON), each in a fresh namespace, in order.
_RUNNER = r"""
import json, sys, traceback
blocks = json.load(sys.stdin)
for b in blocks:
    # pad with newlines: a traceback's line numbers are the Markdown file's
    code = compile("\n" * (b["line"] - 1) + b["code"], b["path"], "exec")
    try:
        exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
    except BaseException:
        sys.stdout.flush()
        print("\nFAILED: block at " + b["name"] + "\n" + traceback.format_exc(), file=sys.stderr)
        sys.exit(1)
    sys.stdout.flush()
    print("ok: " + b["name"], file=sys.stderr)
"""


def _env(drop=("TRITON_INTERPRET",)) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def _run_blocks(blocks: list[Block], cwd: pathlib.Path) -> None:
    payload = json.dumps([{"path": str(b.path), "line": b.line, "code": b.code, "name": b.name} for b in blocks])
    try:
        proc = subprocess.run([sys.executable, "-c", _RUNNER], input=payload, cwd=cwd, env=_env(),
                              capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        pytest.fail(f"{_rel(blocks[0].path)}: the snippets ran past {TIMEOUT_S} s\n{err[-3000:]}", pytrace=False)
    if proc.returncode != 0:
        pytest.fail(f"{_rel(blocks[0].path)}: a snippet failed\n--- stdout (tail)\n{proc.stdout[-3000:]}\n"
                    f"--- stderr (tail)\n{proc.stderr[-6000:]}", pytrace=False)


def _by_file(kind: str) -> list:
    return [pytest.param(f, id=_rel(f)) for f in FILES if any(b.kind == kind for b in collect(f))]


@pytest.mark.parametrize("path", [pytest.param(f, id=_rel(f)) for f in FILES])
def test_python_snippets_run_on_cpu(path, tmp_path):
    blocks = [b for b in collect(path) if b.kind == "cpu"]
    if not blocks:
        pytest.skip(f"{_rel(path)} has no plain python block")
    _run_blocks(blocks, tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize("path", _by_file("gpu"))
def test_gpu_snippets_run(path, tmp_path):
    _run_blocks([b for b in collect(path) if b.kind == "gpu"], tmp_path)


@pytest.mark.parametrize("block", [pytest.param(b, id=f"{_rel(b.path)}:{b.line}") for b in _blocks("pytest")])
def test_pytest_snippets_pass(block, tmp_path):
    (tmp_path / "test_snippet.py").write_text(block.code)
    env = _env(drop=("HYPOTHESIS_PROFILE", "FUSIBLE_OPS_MAX_EXAMPLES", "TRITON_INTERPRET", "PYTEST_ADDOPTS"))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
         str(tmp_path / "test_snippet.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0, f"{block.name}\n{proc.stdout[-4000:]}{proc.stderr[-2000:]}"
    assert "passed" in proc.stdout


@pytest.mark.parametrize("path", [pytest.param(f, id=_rel(f)) for f in FILES])
def test_snippet_markers_are_well_formed(path):
    problems = [f"{b.name}: {b.problem}" for b in collect(path) if b.problem]
    assert not problems, "\n".join(problems)


def test_collector_reads_markers(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("\n".join([
        "# t", "```python", "a = 1", "```",
        "<!-- not run: needs a process group -->", "```python", "b = 2", "```",
        "<!-- run: gpu -->", "```python", "c = 3", "```",
        "<!-- run: pytest -->", "```python", "def test_x():", "    pass", "```",
        "- item", "  ```python", "  d = 4", "  ```",
        "<!-- not run: -->", "```python", "e = 5", "```",
        "```bash", "echo no", "```",
    ]) + "\n")
    got = [(b.line, b.kind, b.code, bool(b.problem)) for b in collect(page)]
    assert got == [(3, "cpu", "a = 1\n", False), (7, "skip", "b = 2\n", False), (11, "gpu", "c = 3\n", False),
                   (15, "pytest", "def test_x():\n    pass\n", False), (20, "cpu", "d = 4\n", False),
                   (24, "skip", "e = 5\n", True)]


# --------------------------------------------------------------------------- the pages themselves
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


@pytest.mark.parametrize("path", [pytest.param(f, id=_rel(f)) for f in DOCS])
def test_docs_page_has_content_and_its_links_resolve(path):
    text = path.read_text(encoding="utf-8")
    assert text.strip(), f"{_rel(path)} is empty"
    lines, broken = text.splitlines(), []
    inside, fence = False, ""
    for n, line in enumerate(lines, 1):
        m = _FENCE.match(line)
        stripped = line.strip()
        if not inside and m:
            inside, fence = True, m.group("fence")
            continue
        if inside:
            if stripped and set(stripped) == {fence[0]} and len(stripped) >= len(fence):
                inside = False
            continue
        for target in _LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
                continue  # a URL, mailto:, or an anchor in this page
            file_part = target.split("#", 1)[0]
            if not file_part.endswith(".md"):
                continue
            if not (path.parent / file_part).resolve().exists():
                broken.append(f"line {n}: {target}")
    assert not broken, f"{_rel(path)}: links to missing Markdown files:\n  " + "\n  ".join(broken)

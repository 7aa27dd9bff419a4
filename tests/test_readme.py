"""Every code block of README.md runs here.

- ```python blocks run in order in one namespace, in a temporary working folder; a
  block that starts with ``>>>`` runs as a doctest.
- A block preceded by ``<!-- file: NAME -->`` is written to NAME in that folder instead
  (the C-level API example's .pyx and setup.py), and later blocks build and use it.
- ```bash blocks: each line whose command is ``python`` or ``fastattn`` runs in that
  folder (``python`` is this interpreter); install, release and test-suite commands
  (pip, brew, python -m build, cibuildwheel, tools/check-wheel.sh, pytest) are run by
  CI instead, and any
  other command is an error here, so that none goes untested by accident.
- ``<!-- requires: a, b -->`` skips a block when a module is missing (``build``: Cython,
  a C compiler and an OpenMP build of fastattn), or is PyTorch under the sanitizer
  build; ``<!-- not-tested -->`` skips it.
- ```text blocks are pictures; the causal one is checked against fastattn.scores.

The README also must keep its "Two commands" section (CI runs its test command),
document every name in ``fastattn.__all__`` in the Functions table, and run every
example in that table's last column.
"""

from __future__ import annotations

import doctest
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

import fastattn
from fastattn import _openmp

import extending_build

README = Path(__file__).resolve().parent.parent / "README.md"

pytestmark = pytest.mark.skipif(not README.is_file(), reason="README.md not found")

# install and release commands: not run here (CI and tools/check-wheel.sh run them)
NOT_RUN = ("pip ", "brew ", "export ", "python -m build", "cibuildwheel",
           "tools/check-wheel.sh", ".ci/run", "python -m pytest", "pytest")
RUN = ("python", "fastattn")
# PyTorch's native code does not run with ASan preloaded (tools/sanitize.sh)
NOT_SANITIZED = ("torch", "transformers")
PLACEHOLDERS = ["## Performance", "## Why divide by sqrt(d_k)?", "## Dask"]


@dataclass
class Block:
    lang: str
    code: str
    line: int                       # line number of the opening fence
    markers: dict = field(default_factory=dict)


def table_example(line: str):
    """The code in the last column of a Functions table row, or None."""
    if not (line.startswith("| `") and line.count("|") >= 4):
        return None
    spans = re.findall(r"`([^`]+)`", line.rstrip().rstrip("|").rsplit("|", 1)[1])
    assert len(spans) == 1, f"a Functions table row without exactly one example: {line}"
    return spans[0]


def read_blocks(text: str) -> list:
    """The fenced blocks, and the Functions table's examples as python blocks."""
    blocks, markers = [], {}
    lines = text.splitlines()
    heading = ""
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("## "):
            heading = line
        if heading == "## Functions" and table_example(line):
            blocks.append(Block("python", table_example(line) + "\n", i + 1,
                                {"table": ""}))
        marker = re.fullmatch(r"\s*<!--\s*([\w-]+)(?::\s*(.*?))?\s*-->\s*", line)
        fence = re.fullmatch(r"```(\w*)\s*", line)
        if marker:
            markers[marker.group(1)] = (marker.group(2) or "").strip()
        elif fence:
            start, body = i + 1, []
            i += 1
            while not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            blocks.append(Block(fence.group(1), "\n".join(body) + "\n", start, markers))
            markers = {}
        elif line.strip():
            markers = {}            # a marker applies to the block right below it
        i += 1
    return blocks


def section(text: str, heading: str) -> str:
    start = text.index(heading + "\n")
    end = text.find("\n## ", start + len(heading))
    return text[start:] if end < 0 else text[start:end]


def missing_requirement(block: Block):
    """Why the block cannot run here, or None."""
    if "not-tested" in block.markers:
        return "marked not-tested"
    for name in filter(None, re.split(r"[,\s]+", block.markers.get("requires", ""))):
        if name == "build":
            try:
                extending_build.require_toolchain()
            except pytest.skip.Exception as exc:
                return str(exc)
            if not _openmp.openmp_enabled():
                return "fastattn was built without OpenMP"
        elif importlib.util.find_spec(name) is None:
            return f"needs {name}"
        elif name in NOT_SANITIZED and os.environ.get("FASTATTN_SANITIZED"):
            return f"{name} is not run under the sanitizer build"
    return None


def run_shell_line(line: str, cwd: Path) -> None:
    words = shlex.split(line, comments=True)
    env = extending_build.build_env()
    while words and re.fullmatch(r"[A-Za-z_]\w*=.*", words[0]):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    if words[0] == "python":
        words[0] = sys.executable
    elif words[0] == "fastattn":
        words[:1] = [sys.executable, "-m", "fastattn"]
    res = subprocess.run(words, cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, f"`{line}` failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"


def run_python(block: Block, namespace: dict) -> None:
    name = f"README.md:{block.line}"
    if block.code.lstrip().startswith(">>>"):
        test = doctest.DocTestParser().get_doctest(block.code, namespace, name,
                                                   str(README), block.line)
        runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
        runner.run(test, clear_globs=False)
        assert runner.failures == 0, f"the doctest at {name} failed (see the output)"
    else:
        exec(compile(block.code, name, "exec"), namespace)


def test_every_code_block_runs(tmp_path, monkeypatch, capsys):
    blocks = read_blocks(README.read_text(encoding="utf-8"))
    assert blocks, "README.md has no code blocks"
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    namespace = {"__name__": "__readme__"}
    skipped, ran = [], 0
    try:
        for block in blocks:
            if "file" in block.markers:
                (tmp_path / block.markers["file"]).write_text(block.code)
                continue
            why = missing_requirement(block)
            if why:
                skipped.append(f"line {block.line}: {why}")
                continue
            if block.lang == "python":
                run_python(block, namespace)
                ran += 1
            elif block.lang in ("bash", "sh", "console"):
                for line in block.code.splitlines():
                    command = line.split("#", 1)[0].strip()
                    bare = re.sub(r"^([A-Za-z_]\w*=\S*\s+)*", "", command)
                    if not command or bare.startswith(NOT_RUN):
                        continue
                    assert bare.startswith(RUN), (
                        f"README.md:{block.line}: `{command}` is neither run by this "
                        f"test nor a known install command")
                    run_shell_line(command, tmp_path)
                    ran += 1
            elif block.lang not in ("text", "cython"):
                pytest.fail(f"README.md:{block.line}: a ```{block.lang} block that "
                            "no test runs")
    finally:
        fastattn.set_num_threads(None)
        for name in list(sys.modules):
            if name == "myattn":
                del sys.modules[name]
    assert ran >= 10
    if skipped:
        print("README blocks skipped:", *skipped, sep="\n  ")


def test_the_causal_picture_is_what_the_kernels_do():
    text = section(README.read_text(encoding="utf-8"), "## Masks and causal attention")
    picture = next(b for b in read_blocks(text) if b.lang == "text").code
    rows = [re.findall(r"[x.](?: [x.])+", line) for line in picture.splitlines()]
    rows = [r for r in rows if len(r) == 2]
    assert len(rows) == 3
    for side, causal in enumerate(["top_left", "bottom_right"]):
        s = fastattn.scores(np.zeros((3, 1)), np.zeros((5, 1)), causal=causal)
        drawn = np.array([[c == "x" for c in r[side].split()] for r in rows])
        np.testing.assert_array_equal(drawn, np.isfinite(s))


def test_the_functions_table_covers_every_public_name():
    text = README.read_text(encoding="utf-8")
    table = section(text, "## Functions")
    rows = [line for line in table.splitlines()
            if line.startswith("| `") and line.count("|") >= 4]
    documented = set()
    for row in rows:
        first = row.split("|")[1]
        for span in re.findall(r"`([^`]+)`", first):
            documented.update(re.findall(r"\w+", span.split("(")[0]))
    public = set(fastattn.__all__)
    assert public <= documented, f"not in the Functions table: {sorted(public - documented)}"
    for name in fastattn.reference.__all__:
        assert name in documented, f"reference.{name} is not in the Functions table"

    examples = [b for b in read_blocks(text) if "table" in b.markers]
    assert len(examples) == len(rows)       # each row's example runs in the test above


def test_two_commands_section_is_what_ci_runs():
    text = section(README.read_text(encoding="utf-8"), "## Two commands")
    commands = [b.code.strip() for b in read_blocks(text)]
    assert len(commands) == 2
    assert commands[0].startswith("pip install .")
    assert re.match(r'pip install "\.\[test[^"]*\]" && pytest', commands[1])


def test_placeholder_sections_exist():
    text = README.read_text(encoding="utf-8")
    for heading in PLACEHOLDERS:
        assert f"\n{heading}\n" in text, heading

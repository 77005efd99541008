"""Every fenced Python block in README.md and docs/ runs as written, as a new user would paste it into a file.

A block runs on the CPU, in a fresh process, unless the line before its fence is ``<!-- snippet: gpu -->``: then it
needs a GPU and runs only where torch sees one (``scripts/gpu-check.sh`` runs this file). Longer code comes into the
docs by ``literalinclude`` from ``examples/``, whose files have tests of their own.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest
import torch

from tests.conftest import wait_for
from tests.helpers import PYPATH, ROOT

GPU_MARK = "<!-- snippet: gpu -->"
FENCE = re.compile(r"^```python\s*$")


def snippets() -> list:
    """``pytest.param(code, gpu)`` for each Python block, named ``file:line`` (``file:line-gpu`` if GPU-marked)."""
    pages = [Path(ROOT, "README.md"), *sorted(Path(ROOT, "docs").rglob("*.md"))]
    found = []
    for page in pages:
        if "_build" in page.parts:
            continue
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            if not FENCE.match(line):
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            gpu = i > 0 and lines[i - 1].strip() == GPU_MARK
            name = f"{page.relative_to(ROOT)}:{i + 1}" + ("-gpu" if gpu else "")  # (-k gpu selects those)
            marks = [pytest.mark.skipif(gpu and not torch.cuda.is_available(), reason="a GPU-marked snippet")]
            found.append(pytest.param("\n".join(lines[i + 1:end]) + "\n", gpu, id=name, marks=marks))
    return found


def test_the_docs_have_python_snippets_and_some_are_gpu_marked():
    found = snippets()
    assert len(found) >= 7 and any(p.values[1] for p in found) and not all(p.values[1] for p in found)


def _tagged(tag: str) -> list[int]:
    """The processes whose environment carries ``tag``: the snippet's own and its workers (which inherit it)."""
    pids = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("DPOOL_SNIPPET_TAG") == tag:
                pids.append(p.pid)
        except (psutil.Error, OSError):
            pass
    return pids


@pytest.mark.timeout(240)
@pytest.mark.parametrize("code, gpu", snippets())
def test_snippet_runs_as_written(code, gpu, tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(code)
    tag = uuid.uuid4().hex
    env = dict(os.environ, PYTHONPATH=PYPATH, DPOOL_SNIPPET_TAG=tag, PYTHONFAULTHANDLER="1")
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=200, cwd=tmp_path,
                         env=env)
    assert res.returncode == 0, f"the snippet failed as written:\n{code}\n--- output:\n{res.stdout}{res.stderr[-4000:]}"
    assert wait_for(lambda: not _tagged(tag)), f"the snippet's workers outlived it: {_tagged(tag)}"

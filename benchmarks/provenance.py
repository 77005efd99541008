"""What a results file was measured with: the dpool version and the commit of this checkout."""
from __future__ import annotations

import os
import subprocess
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def provenance() -> dict[str, Any]:
    """``{"dpool": version, "commit": short hash}``; the hash ends in ``+dirty`` when dpool's code or the benchmarks
    had uncommitted changes (results files aside), and is ``unknown`` outside a git checkout."""
    import dpool

    commit = _git("rev-parse", "--short=12", "HEAD") or "unknown"
    if commit != "unknown" and _git("status", "--porcelain", "--untracked-files=no", "--", "dpool", "workers",
                                    "benchmarks", ":(exclude)benchmarks/results"):
        commit += "+dirty"
    return {"dpool": dpool.__version__, "commit": commit}

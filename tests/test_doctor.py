"""`dpool-workers doctor`: passes here, and fails, saying what to do, where /dev/shm is too small or missing."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dpool.devices import parse_devices

from tests.helpers import ROOT, tmpfs

pytestmark = pytest.mark.timeout(180)

CHECKS = ["python", "torch", "cuda", "mps", "cores", "shared memory", "runtime directory", "pools", "training step"]


def _doctor(*args: str, **env: str) -> subprocess.CompletedProcess:
    full = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), **env)
    return subprocess.run([sys.executable, "-m", "dpool_workers.cli", "doctor", *args], capture_output=True,
                          text=True, timeout=150, cwd=ROOT, env=full)


def test_doctor_passes_here_and_runs_a_training_step():
    res = _doctor("--json")
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads(res.stdout)
    assert report["ok"] and [c["check"] for c in report["checks"]] == CHECKS
    assert all(c["status"] in ("OK", "WARN") for c in report["checks"]), report
    step = report["checks"][-1]
    assert step["status"] == "OK" and "the same parameters as one process" in step["detail"], step
    default = parse_devices(None)  # what dpool.wrap() starts here: every GPU on a GPU machine, else a worker per core
    on = "CPU" if default[0] == "cpu" else "GPU"
    assert step["detail"].startswith(f"{len(default)} {on} worker(s) on {','.join(default)}: "), step
    text = _doctor()
    assert text.returncode == 0 and text.stdout.rstrip().endswith("dpool-workers doctor: OK"), text.stdout
    assert "training step" in text.stdout and "shared memory" in text.stdout


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """An 8 MiB tmpfs (root only: elsewhere the test is skipped)."""
    with tmpfs(tmp_path / "shm", "8m") as path:
        yield path


def test_doctor_fails_on_a_shared_memory_directory_too_small(tiny_tmpfs):
    res = _doctor("--json", DPOOL_SHM_DIR=tiny_tmpfs)
    assert res.returncode == 1, res.stdout + res.stderr
    report = json.loads(res.stdout)
    shm = next(c for c in report["checks"] if c["check"] == "shared memory")
    assert not report["ok"] and shm["status"] == "FAIL" and tiny_tmpfs in shm["detail"], shm
    assert "--shm-size" in shm["fix"] and "DPOOL_SHM_DIR" in shm["fix"]
    text = _doctor(DPOOL_SHM_DIR=tiny_tmpfs)
    assert text.returncode == 1 and "FAIL  shared memory" in text.stdout and "→ " in text.stdout, text.stdout


def test_doctor_fails_on_a_shared_memory_directory_that_does_not_exist(tmp_path):
    missing = str(tmp_path / "no-such-dir")
    report = json.loads(_doctor("--json", DPOOL_SHM_DIR=missing).stdout)
    by_name = {c["check"]: c for c in report["checks"]}
    assert by_name["shared memory"]["status"] == "FAIL" and missing in by_name["shared memory"]["detail"]
    assert by_name["training step"]["status"] == "FAIL"  # what wrap() itself would meet there

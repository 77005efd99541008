"""What a release is: the version in one place agreeing with the CHANGELOG, and a wheel that installs and runs."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import dpool
from tests.conftest import wait_for
from tests.helpers import run_script, running

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTIONS = {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}  # Keep a Changelog's


def _changelog() -> str:
    with open(os.path.join(ROOT, "CHANGELOG.md")) as f:
        return f.read()


def test_the_version_is_the_newest_release_in_the_changelog():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        version = tomllib.load(f)["project"]["version"]
    releases = re.findall(r"^## (\S+)", _changelog(), re.M)
    assert releases[0] == "Unreleased", "the CHANGELOG starts with an Unreleased section"
    assert releases[1] == version == dpool.__version__, (
        f"pyproject.toml says {version}, dpool.__version__ {dpool.__version__}, the newest CHANGELOG release "
        f"{releases[1]}: bump them together")
    assert len(set(releases)) == len(releases), "a release appears twice"


def test_the_changelog_uses_keep_a_changelog_sections_only():
    headings = re.findall(r"^### (.+)$", _changelog(), re.M)
    assert headings and set(headings) <= SECTIONS, f"not Keep a Changelog sections: {set(headings) - SECTIONS}"


@pytest.mark.timeout(300)
def test_a_wheel_built_from_the_checkout_installs_in_a_clean_venv_and_trains(tmp_path):
    """A non-editable install: the wheel holds both packages (``dpool`` and the ``workers/`` folder installed as
    ``dpool_workers``) and its console script, and its workers start from the installed copy. The new venv
    takes the dependencies (torch and the rest) from this test's environment through a path file, which adds
    that folder alone: its editable install of this checkout is not loaded, so dpool comes from the wheel or
    not at all (and the suite installs no second torch)."""
    import site
    import sysconfig

    dist, venv, src = tmp_path / "dist", tmp_path / "venv", tmp_path / "src"
    # (built from a copy of what the package is made of: a build in the checkout would leave build/ there)
    for name in ("dpool", "workers"):
        shutil.copytree(os.path.join(ROOT, name), src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "-w", str(dist), str(src)], check=True, timeout=240)
    (wheel,) = dist.glob("dpool-*.whl")
    assert wheel.name.startswith(f"dpool-{dpool.__version__}-")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    py = str(venv / "bin" / "python")
    subprocess.run([sys.executable, "-m", "pip", "--python", py, "install", "--quiet", "--no-deps", str(wheel)],
                   check=True, timeout=240)
    purelib = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    deps = [p for p in {sysconfig.get_path("purelib"), *site.getsitepackages()} if os.path.isdir(p)]
    (Path(purelib) / "zz-test-dependencies.pth").write_text("\n".join(deps) + "\n")
    smoke = (
        "import copy, json, os, torch, dpool, dpool_workers\n"
        f"assert dpool.__file__.startswith({purelib!r}), dpool.__file__\n"
        f"assert dpool_workers.__file__.startswith({purelib!r}), dpool_workers.__file__\n"
        "net, x = torch.nn.Linear(4, 2), torch.randn(6, 4)\n"
        "ref = copy.deepcopy(net)\n"
        "ref(x).square().sum().backward()\n"
        "with dpool.wrap(net, ['cpu', 'cpu']) as model:\n"
        "    model(x).square().sum().backward()\n"
        "    pids = model.pids\n"
        "assert torch.allclose(net.weight.grad, ref.weight.grad) and os.getpid() not in pids\n"
        "print(json.dumps({'version': dpool.__version__, 'pids': pids}))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    res = subprocess.run([py, "-c", smoke], capture_output=True, text=True, timeout=120, cwd=str(tmp_path), env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    out = json.loads(res.stdout)
    assert out["version"] == dpool.__version__ and len(set(out["pids"])) == 2
    assert wait_for(lambda: not any(running(pid) for pid in out["pids"])), f"workers {out['pids']} outlived the script"
    cli = subprocess.run([str(venv / "bin" / "dpool-workers"), "--version"], capture_output=True, text=True,
                         timeout=60, env=env)
    assert cli.stdout.strip() == f"dpool-workers {dpool.__version__}", cli.stdout + cli.stderr


@pytest.mark.parametrize("library", ["transformers", "lightning"])
def test_an_integration_refuses_its_library_older_than_the_extras_floor(library):
    """The floor the integration enforces is pyproject.toml's, the oldest version its tests pass with
    (scripts/test-floors.sh); an older one is an ImportError naming the fix, not a run that may be wrong."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    floor = next(r.split(">=")[1] for r in extras[library] if r.startswith(f"{library}>="))
    older = f"{int(floor.split('.')[0]) - 1}.99.0" if floor.split(".")[1] == "0" else \
        f"{floor.split('.')[0]}.{int(floor.split('.')[1]) - 1}.0"
    res = run_script(f"import {library}\n{library}.__version__ = {older!r}\nimport dpool.integrations.{library}\n",
                     timeout=120)
    assert res.returncode != 0, res.stdout
    assert (f"ImportError: dpool's {library} integration needs {library}>={floor}, the oldest version its tests "
            f"pass with; this environment has {library} {older}") in res.stderr, res.stderr[-3000:]

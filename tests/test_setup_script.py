"""scripts/setup.sh: a virtual environment inside the checkout, reused when up to date.

Run against stand-ins for python3, the venv's python and `id` (no network, a second each):
what the script would run is logged instead of installed.
"""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.spawn

ROOT = Path(__file__).resolve().parents[1]

FAKE_PYTHON3 = """#!/bin/bash
echo "python3 $*" >> "$SETUP_LOG"
case "$*" in
  *"import venv, ensurepip"*) exit "${NO_VENV:-0}";;
  "-m venv "*) mkdir -p "$3/bin"; cp "$FAKE_VENV_PYTHON" "$3/bin/python"; touch "$3/pyvenv.cfg";;
  "--version") echo "Python 3.11.0";;
esac
exit 0
"""

FAKE_VENV_PYTHON = """#!/bin/bash
echo "venv-python $*" >> "$SETUP_LOG"
if [ "$1" = "-c" ]; then
  case "$2" in *find_spec*) [ -f "$INSTALLED" ] && echo "$CHECKOUT/src/pipeblocks/__init__.py";; esac
fi
case "$*" in *"pip install"*"-e .[test,hf,datasets]"*) touch "$INSTALLED";; esac
exit 0
"""

FAKE_ID = """#!/bin/bash
echo 1000
"""


def _executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def checkout(tmp_path):
    root = tmp_path / "checkout"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "setup.sh", root / "scripts" / "setup.sh")
    (root / "pyproject.toml").write_text('[project]\nname = "pipeblocks"\n')
    tools = tmp_path / "bin"
    tools.mkdir()
    _executable(tools / "python3", FAKE_PYTHON3)
    _executable(tools / "id", FAKE_ID)  # not root: the script must not try apt-get
    fake_venv = _executable(tmp_path / "venv-python", FAKE_VENV_PYTHON)
    log = tmp_path / "log"
    env = {**os.environ, "PATH": f"{tools}:{os.environ['PATH']}", "SETUP_LOG": str(log), "PYTHON": "python3",
           "FAKE_VENV_PYTHON": str(fake_venv), "INSTALLED": str(tmp_path / "installed"), "CHECKOUT": str(root)}
    env.pop("PIPEBLOCKS_TORCH_INDEX_URL", None)

    def run(**extra: str) -> tuple[subprocess.CompletedProcess, list[str]]:
        log.write_text("")
        proc = subprocess.run(["bash", str(root / "scripts" / "setup.sh")], env={**env, **extra},
                              capture_output=True, text=True, timeout=60)
        return proc, log.read_text().splitlines()

    return root, run


def _pip_installs(log: list[str]) -> list[str]:
    return [line.split("install", 1)[1].split()[-1] for line in log if "-m pip install" in line]


def test_a_fresh_checkout_gets_its_own_venv_torch_first(checkout):
    root, run = checkout
    proc, log = run()
    assert proc.returncode == 0, proc.stderr
    assert "python3 -m venv .venv" in log  # created inside the checkout, by the system python
    assert _pip_installs(log) == ["torch==2.13.0", ".[test,hf,datasets]"]
    assert all(line.startswith(("python3 -c", "python3 -m venv", "python3 --version")) or
               line.startswith("venv-python") for line in log)  # pip never runs on the system python
    assert (root / ".venv" / ".pipeblocks-setup").is_file()


def test_an_up_to_date_venv_is_reused_without_pip(checkout):
    root, run = checkout
    assert run()[0].returncode == 0
    proc, log = run()
    assert proc.returncode == 0 and "reusing .venv" in proc.stderr
    assert _pip_installs(log) == [] and not any(line.startswith("python3") for line in log)


def test_a_changed_pyproject_reinstalls_into_the_same_venv(checkout):
    root, run = checkout
    assert run()[0].returncode == 0
    (root / "pyproject.toml").write_text('[project]\nname = "pipeblocks"\ndependencies = ["numpy"]\n')
    proc, log = run()
    assert proc.returncode == 0
    assert "python3 -m venv .venv" not in log and _pip_installs(log) == ["torch==2.13.0", ".[test,hf,datasets]"]


def test_the_cpu_index_is_used_for_torch_only_when_asked(checkout):
    _, run = checkout
    proc, log = run(PIPEBLOCKS_TORCH_INDEX_URL="https://download.pytorch.org/whl/cpu")
    assert proc.returncode == 0
    torch_line = next(line for line in log if "torch==2.13.0" in line)
    assert "--index-url https://download.pytorch.org/whl/cpu" in torch_line
    assert "--index-url" not in next(line for line in log if ".[test,hf,datasets]" in line)


def test_without_venv_support_and_not_root_it_says_what_to_install(checkout):
    root, run = checkout
    proc, log = run(NO_VENV="1")
    assert proc.returncode == 1
    assert "apt-get install python3-venv" in proc.stderr
    assert not (root / ".venv").exists() and _pip_installs(log) == []

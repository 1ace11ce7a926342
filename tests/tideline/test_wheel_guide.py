"""docs/your-app.md run as a user would: Tideline built as packages (its wheel, and the native core's wheel built
by maturin with docker/build-native.sh), installed into a fresh venv, and the guide's session run in an empty
directory with that venv's ``tideline`` and ``python`` first on PATH, no PYTHONPATH, and no checkout of
Tideline in sight: the examples are not in the wheel, so the reservations example is absent.

What the fresh venv does not get from the wheels: their third-party dependencies (pyspark, pyarrow, psycopg …).
Downloading ~400 MB into every run would test PyPI, not Tideline, so the venv reads them from this checkout's
venv through a path entry (``deps.pth``): its site-packages directory only, whose own ``.pth`` files (the editable
install of this checkout) are not run. The test checks that Tideline's packages and the native core are imported
from the fresh venv, and that ``examples`` is not importable there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "your-app.md"
BUILD_TIMEOUT_S = 1200  # a cold release build of the native core on two CPUs takes a few minutes
PACKAGES = ("capture", "eventstore", "commands", "projections", "schemas", "migrations", "tideline", "tideline_native")


def sources(into: Path) -> Path:
    """This checkout's files (tracked, and new ones not ignored) copied into ``into``: the wheel is built from a
    tree without build leftovers, and the checkout gets no build/ or egg-info from it."""
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-co", "--exclude-standard", "-z"], check=True,
                            capture_output=True).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file() and not name.startswith(("native/target/", "tests/")):
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, into / name)
    return into


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("wheel")
    dist = base / "dist"
    src = sources(base / "src")
    bin_dir = Path(sys.executable).parent
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist),
                    str(src)], check=True, timeout=600)  # fmt: skip
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "CARGO_TARGET_DIR": str(ROOT / "native" / "target")}  # fmt: skip
    subprocess.run(["sh", str(ROOT / "docker" / "build-native.sh"), str(dist)], check=True, env=env,
                   timeout=BUILD_TIMEOUT_S, capture_output=True)  # fmt: skip
    wheels = sorted(p.name for p in dist.glob("*.whl"))
    assert [w.split("-")[0] for w in wheels] == ["tideline", "tideline_native"], wheels
    venv = base / "venv"
    base_python = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base_python, "-m", "venv", str(venv)], check=True, timeout=300)
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the suite's own path is not the user's
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    *map(str, dist.glob("*.whl"))], check=True, timeout=600, env=clean)  # fmt: skip
    # After the install: with the dependencies' path first, pip would take this checkout's editable install of
    # tideline for the wheel's ("already satisfied").
    site = next((venv / "lib").glob("python3*/site-packages"))
    assert (site / "tideline" / "cli.py").is_file() and (site / "tideline_native").is_dir()
    dev_site = next(p for p in map(Path, sys.path) if p.name == "site-packages" and p.is_relative_to(bin_dir.parent))
    (site / "deps.pth").write_text(f"{dev_site}\n")
    return venv


def user_env(venv: Path, home: Path) -> dict[str, str]:
    """A user's shell: the venv first on PATH, nothing of this checkout on any path."""
    keep = {k: v for k, v in os.environ.items() if k in ("LANG", "LC_ALL", "JAVA_HOME", "TMPDIR", "USER")}
    system = "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin"
    return {**keep, "PATH": f"{venv / 'bin'}{os.pathsep}{system}", "HOME": str(home)}


def test_the_wheels_install_tideline_without_the_examples(wheel_venv: Path, tmp_path: Path) -> None:
    code = (
        "import importlib, importlib.util\n"
        f"for name in {PACKAGES!r}:\n"
        "    print(importlib.import_module(name).__file__)\n"
        "print(importlib.util.find_spec('examples'))\n"
    )
    out = subprocess.run([str(wheel_venv / "bin" / "python"), "-c", code], cwd=tmp_path, check=True,
                         capture_output=True, text=True, env=user_env(wheel_venv, tmp_path)).stdout  # fmt: skip
    *files, examples = out.splitlines()
    assert all(Path(f).is_relative_to(wheel_venv) for f in files), files
    assert examples == "None", "the wheel ships no example"
    assert (wheel_venv / "bin" / "tideline").exists()


def test_the_guide_runs_from_the_wheel(wheel_venv: Path, tmp_path: Path) -> None:
    from test_docs import session  # the doc tests' reading of a one-session doc

    script = session(GUIDE.read_text()).replace("/tmp/", f"{tmp_path}/")
    env = user_env(wheel_venv, tmp_path)
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=900)  # fmt: skip
    assert result.returncode == 0, (
        f"docs/your-app.md exited {result.returncode}\n--- stdout\n{result.stdout[-4000:]}\n"
        f"--- stderr\n{result.stderr[-4000:]}"
    )
    assert "refused: account 'a2' holds 0.00, cannot withdraw 1.00" in result.stdout, result.stdout
    assert "is already claimed by 'account-a1'" in result.stdout, result.stdout

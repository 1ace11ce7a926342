"""The image builds the native capture core and installs it (no Docker engine here: its steps are run instead).

docker/Dockerfile has a ``native`` stage that runs docker/build-native.sh into a directory, and a final stage
that mounts that directory, pip-installs the wheel with Tideline and runs a check that capture imports it.
Checked: the Dockerfile says exactly that (the script's output directory is what the final stage installs
from; both stages on one base image, so the wheel's glibc and Python tags fit; the maturin it installs is the
project's requirement); then the script itself runs into a temporary directory (cargo reusing native/target),
the wheel goes into a fresh venv (no system site-packages), ``import tideline_native`` works there from the
wheel, and the Dockerfile's own check passes with that module. docker-compose's capture service (both
compositions) runs that image and asks for ``--core native``, so a missing extension stops it in one line.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from capture.native import extension

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
SCRIPT = "docker/build-native.sh"
BUILD_TIMEOUT_S = 1200  # a cold release build (lto) of the core on two CPUs takes a few minutes


def stages() -> list[dict[str, Any]]:
    """The Dockerfile's stages: ``base``, ``name`` and their instructions (continuation lines joined)."""
    out: list[dict[str, Any]] = []
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        if word == "FROM":
            parts = rest.split()
            out.append({"base": parts[0], "name": parts[2] if len(parts) == 3 and parts[1] == "AS" else None,
                        "instructions": []})  # fmt: skip
        else:
            out[-1]["instructions"].append((word, rest.strip()))
    return out


def runs(stage: dict[str, Any]) -> list[str]:
    return [rest for word, rest in stage["instructions"] if word == "RUN"]


def build_plan() -> tuple[str, str, str, str]:
    """(the script's output directory in the ``native`` stage, the final stage's mount target, its pip install
    line, its check), read from the Dockerfile."""
    all_stages = stages()
    assert len(all_stages) == 2, "a builder stage and the image"
    builder, image = all_stages
    assert builder["name"] == "native" and image["name"] is None
    assert builder["base"] == image["base"], "the wheel is built on the image's own base (glibc, Python)"
    (script_run,) = [r for r in runs(builder) if r.startswith(SCRIPT)]
    out_dir = shlex.split(script_run)[1]
    (install,) = [r for r in runs(image) if "--mount=" in r]
    mount = dict(kv.split("=", 1) for kv in re.search(r"--mount=(\S+)", install).group(1).split(","))  # type: ignore[union-attr]
    assert mount["type"] == "bind" and mount["from"] == builder["name"] and mount["source"] == out_dir
    assert f"pip install --no-cache-dir {mount['target']}/tideline_native-*.whl ." in install
    check = re.search(r'python -c "([^"]+)"', install)
    assert check is not None, "the image checks that capture imports the extension"
    return out_dir, mount["target"], install, check.group(1)


def test_the_dockerfile_builds_the_wheel_and_installs_what_it_built() -> None:
    out_dir, target, _, check = build_plan()
    assert out_dir == target == "/wheels"
    assert "capture.native.extension" in check and "BUILT" in check
    builder = stages()[0]
    (tools,) = [r for r in runs(builder) if "maturin" in r and SCRIPT not in r]
    (dockerfile_maturin,) = re.findall(r'"(maturin[^"]*)"', tools)
    dev = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    assert dockerfile_maturin in dev, "the image's maturin is the project's requirement"
    copied = {rest.split()[0] for word, rest in builder["instructions"] if word == "COPY"}
    assert {"native", SCRIPT} <= copied
    ignored = (ROOT / "docker" / "Dockerfile.dockerignore").read_text().split()
    assert "native/target" in ignored and ".venv" in ignored, "no local build or venv in the build context"


@pytest.mark.parametrize("compose_file", ["docker-compose.yml", "docker-compose.kafka.yml"])
def test_compose_capture_runs_the_image_with_the_native_core(compose_file: str) -> None:
    base = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    capture_service = base["services"]["capture"]
    assert capture_service["build"]["dockerfile"] == "docker/Dockerfile"
    command = yaml.safe_load((ROOT / compose_file).read_text())["services"]["capture"]["command"]
    at = command.index("--core")
    assert command[at + 1] == "native", "a missing extension stops capture instead of slowing it down"


def test_the_script_builds_a_wheel_that_imports_in_a_fresh_venv(tmp_path: Path) -> None:
    cargo = shutil.which("cargo") or str(Path.home() / ".cargo" / "bin" / "cargo")
    if not Path(cargo).exists():
        pytest.skip("cargo is not installed (https://rustup.rs)")
    out_dir, _, _, check = build_plan()
    wheels = tmp_path / out_dir.strip("/")
    bin_dirs = [str(Path(sys.executable).parent), str(Path(cargo).parent)]
    env = {**os.environ, "PATH": os.pathsep.join([*bin_dirs, os.environ.get("PATH", "")]),
           "CARGO_TARGET_DIR": str(ROOT / "native" / "target")}  # fmt: skip
    built = subprocess.run([str(ROOT / SCRIPT), str(wheels)], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=BUILD_TIMEOUT_S)  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = wheels.glob("tideline_native-*.whl")
    assert "-abi3-" in wheel.name

    venv = tmp_path / "venv"
    base_python = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base_python, "-m", "venv", str(venv)], check=True, timeout=300)
    assert "include-system-site-packages = false" in (venv / "pyvenv.cfg").read_text()
    python = str(venv / "bin" / "python")
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", str(wheel)], check=True,
                   env=clean, timeout=300)  # fmt: skip
    probe = (
        "import sys, tideline_native\n"
        "missing = [n for n in sys.argv[1:] if not __import__('functools').reduce(\n"
        "    lambda o, a: getattr(o, a, None), n.split('.'), tideline_native)]\n"
        "print(tideline_native.__file__)\n"
        "sys.exit(f'missing: {missing}' if missing else 0)\n"
    )
    imported = subprocess.run([python, "-c", probe, *extension.REQUIRED], cwd=tmp_path, env=clean,
                              capture_output=True, text=True, timeout=60)  # fmt: skip
    assert imported.returncode == 0, imported.stderr
    assert Path(imported.stdout.strip()).is_relative_to(venv), "imported from the fresh venv"

    # The Dockerfile's own check, with tideline_native from that venv and Tideline's code and dependencies
    # from this checkout's (the venv's site-packages first on the path).
    site = next((venv / "lib").glob("python3*/site-packages"))
    deps = next((Path(sys.executable).parent.parent / "lib").glob("python3*/site-packages"))
    path = os.pathsep.join([str(site), str(ROOT), str(deps)])
    checked = subprocess.run([python, "-c", f"import tideline_native; print(tideline_native.__file__); {check}"],
                             cwd=tmp_path, env={**clean, "PYTHONPATH": path}, capture_output=True, text=True,
                             timeout=120)  # fmt: skip
    assert checked.returncode == 0, checked.stderr[-3000:]
    assert Path(checked.stdout.splitlines()[0]).is_relative_to(venv)
    assert checked.stdout.splitlines()[-1] == "tideline_native: built"

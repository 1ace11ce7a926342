"""The zip Tideline ships to Spark's executors for a views module (projections.shipping)."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import uuid
import zipfile
from pathlib import Path

import pytest

from eventstore.errors import ConfigError
from projections.shipping import TIDELINE_PACKAGES, package_zip


def test_the_shipped_zip_is_deterministic(tmp_path: Path) -> None:
    """The same package zips to the same bytes (so to the same name), whatever its files' times and
    bytecode; a changed file gives another name."""
    package = f"ua_zip_{uuid.uuid4().hex[:8]}"
    source = Path(__file__).with_name("userapp")
    first, second = tmp_path / "a", tmp_path / "b"
    shutil.copytree(source, first / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(source, second / package, ignore=shutil.ignore_patterns("__pycache__"))
    (second / package / "__pycache__").mkdir()
    (second / package / "__pycache__" / "views.cpython-311.pyc").write_bytes(b"bytecode")
    os.utime(second / package / "views.py", (0, 0))
    zips = []
    for root in (first, second):
        sys.path.insert(0, str(root))
        try:
            zips.append(package_zip(package))
        finally:
            sys.path.remove(str(root))
            sys.modules.pop(package, None)
    assert zips[0] == zips[1] and zips[0][1].startswith(f"{package}-") and zips[0][1].endswith(".zip")
    names = zipfile.ZipFile(io.BytesIO(zips[0][0])).namelist()
    assert names[0] == f"{package}/" and f"{package}/views.py" in names and f"{package}/__init__.py" in names
    files = [n for n in names if not n.endswith("/")]
    assert files == sorted(files)
    assert not any("__pycache__" in n or n.endswith(".pyc") for n in names)
    (first / package / "views.py").write_text((first / package / "views.py").read_text() + "\n# changed\n")
    sys.path.insert(0, str(first))
    try:
        assert package_zip(package)[1] != zips[0][1]
    finally:
        sys.path.remove(str(first))


def test_a_single_module_is_shipped_as_its_file_and_tidelines_own_packages_not_at_all(tmp_path: Path) -> None:
    module = f"ua_single_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text("VIEWS = None\n")
    sys.path.insert(0, str(tmp_path))
    try:
        data, _ = package_zip(module)
    finally:
        sys.path.remove(str(tmp_path))
    assert zipfile.ZipFile(io.BytesIO(data)).namelist() == [f"{module}.py"]
    with pytest.raises(ConfigError, match="cannot find the views package"):
        package_zip(f"ua_missing_{uuid.uuid4().hex[:8]}")
    assert {"projections", "eventstore", "commands"} <= TIDELINE_PACKAGES and "examples" not in TIDELINE_PACKAGES


def test_the_zip_imports_with_subpackages_without_init(tmp_path: Path) -> None:
    """What an executor does with the zip: import the package from it, also a subpackage that has no
    ``__init__.py`` (a namespace package: found in a zip only through its directory entry)."""
    package = f"ua_ns_{uuid.uuid4().hex[:8]}"
    (tmp_path / "src" / package / "sub" / "deeper").mkdir(parents=True)
    (tmp_path / "src" / package / "__init__.py").write_text("")
    (tmp_path / "src" / package / "sub" / "deeper" / "views.py").write_text("VIEWS = 'from the zip'\n")
    sys.path.insert(0, str(tmp_path / "src"))
    try:
        data, name = package_zip(package)
    finally:
        sys.path.remove(str(tmp_path / "src"))
    (tmp_path / name).write_bytes(data)
    probe = f"import sys; sys.path.insert(1, {str(tmp_path / name)!r}); import {package}.sub.deeper.views as v; "
    probe += "print(v.VIEWS, v.__file__)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("from the zip " + str(tmp_path / name)), done.stdout

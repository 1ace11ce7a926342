"""Shipping the application's views module to Spark's executors.

Spark's Python workers import the views catalog module by name (``--views myapp.views``): the
fold, ``rows`` and count functions a task runs are found there. Tideline ships that module's
top-level package itself — a zip of ``myapp/`` (or of the single file ``myapp.py``),
:meth:`SparkContext.addPyFile`, which every executor, local or on a cluster, puts on its Python
workers' ``sys.path`` — whenever a Spark job is given a catalog
(:func:`projections.rebuild.rebuild`, :class:`projections.follow.Follower`). The driver must be able to
import the module (installed, or on its ``sys.path``); the executors need nothing of it.

The zip is deterministic: directory entries (a subpackage without ``__init__.py`` is imported
from a zip only through its directory's entry), then files, in name order, fixed timestamps and
permissions, ``__pycache__`` and compiled files left out; its name carries a hash of its content
(``myapp-<sha256:12>.zip``), so an unchanged package is shipped once per SparkContext, and a
changed one (the same driver process, a new catalog module version) under a new name. A package with compiled extensions
(``.so``) cannot be imported from a zip: it is still shipped (its Python modules work) and a
warning names the extensions, which the executors' Python must have installed.

Tideline's own library packages (``projections``, ``eventstore``, ``commands``, …) are not
shipped (its examples are, like any application's views): they, and Tideline's dependencies
(pyarrow, pandas, psycopg, orjson, …), come with the executors' Python interpreter
(``spark.pyspark.python``; :func:`projections.engine.make_session` sets it to this interpreter),
which must have Tideline installed — a wheel or an editable install; a source tree that is not
installed is put on the executors' ``PYTHONPATH`` (:func:`projections.engine.executor_pythonpath`),
which works only where the tree is at the same path on every node.
"""

from __future__ import annotations

import atexit
import hashlib
import importlib.machinery
import importlib.util
import io
import logging
import os
import shutil
import sys
import tempfile
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from eventstore.errors import ConfigError

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

# Tideline's own library packages (pyproject.toml): they reach executors with Tideline's installation. Its
# ``examples`` are an application like any other: shipped.
TIDELINE_PACKAGES = frozenset({"capture", "commands", "eventstore", "migrations", "projections", "schemas", "tideline"})
EXCLUDED_DIRS = frozenset({"__pycache__"})
EXCLUDED_SUFFIXES = (".pyc", ".pyo")
EXTENSION_SUFFIXES = tuple(importlib.machinery.EXTENSION_SUFFIXES)
ZIP_DATE = (1980, 1, 1, 0, 0, 0)

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_shipped: dict[str, set[str]] = {}  # SparkContext application id → zip names added to it
_workdir: Path | None = None


def ship_views(spark: SparkSession, module: str) -> Path | None:
    """Ship the top-level package of the views module ``module`` to ``spark``'s executors
    (:meth:`SparkContext.addPyFile` of :func:`package_zip`), once per SparkContext and content;
    the zip, or None when the package is one of Tideline's own (see the module docstring)."""
    top = module.split(".")[0]
    if top in TIDELINE_PACKAGES:
        return None
    data, name = package_zip(top)
    context = spark.sparkContext
    app = str(context.applicationId)
    with _lock:
        added = _shipped.setdefault(app, set())
        path = _directory() / name
        if name in added:
            return path
        if not path.exists():
            path.write_bytes(data)
        before = list(sys.path)
        context.addPyFile(str(path))
        # PySpark also puts the zip on this process's sys.path (first after the script's directory): the driver
        # keeps importing the package from where it found it (a module imported later from the zip would see
        # its __file__ inside it, and any data file next to it missing)
        sys.path[:] = [entry for entry in sys.path if entry in before]
        added.add(name)
    logger.info("shipped %s (%d bytes) to the executors of %s for views module %s", name, len(data), app, module)
    return path


def package_zip(top: str) -> tuple[bytes, str]:
    """A deterministic zip of the top-level package (or module) ``top`` as the driver imports it,
    and its file name ``<top>-<sha256 of the zip, 12 hex digits>.zip``."""
    files = sorted(_package_files(top))
    extensions = [arcname for arcname, _ in files if arcname.endswith(EXTENSION_SUFFIXES)]
    if extensions:
        logger.warning(
            "views package %s has compiled extensions (%s): they cannot be imported from the zip shipped to the "
            "executors; install the package in the executors' Python",
            top,
            ", ".join(extensions),
        )
    directories = sorted({"/".join(a.split("/")[:i]) + "/" for a, _ in files for i in range(1, a.count("/") + 1)})
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for directory in directories:  # zipimport finds a namespace package (no __init__.py) by its entry
            info = zipfile.ZipInfo(directory, date_time=ZIP_DATE)
            info.external_attr = (0o40755 << 16) | 0x10  # a directory (Unix mode, and MS-DOS's flag)
            archive.writestr(info, b"")
        for arcname, path in files:
            info = zipfile.ZipInfo(arcname, date_time=ZIP_DATE)
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, path.read_bytes())
    data = buffer.getvalue()
    return data, f"{top}-{hashlib.sha256(data).hexdigest()[:12]}.zip"


def _package_files(top: str) -> Iterator[tuple[str, Path]]:
    """``(name in the zip, file)`` of every file of package ``top`` (every location of a namespace
    package), or of the module file ``top.py``."""
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError) as e:
        raise ConfigError(f"cannot find the views package {top!r} to ship to Spark's executors: {e}") from None
    if spec is None:
        raise ConfigError(f"cannot find the views package {top!r} to ship to Spark's executors (not importable)")
    locations = list(spec.submodule_search_locations or [])
    if not locations:  # a single module
        if spec.origin is None or not os.path.isfile(spec.origin) or not spec.origin.endswith(".py"):
            raise ConfigError(
                f"views module {top!r} ({spec.origin}) is not a Python source file: Spark's executors cannot be "
                "sent it; install it in the executors' Python"
            )
        yield f"{top}.py", Path(spec.origin)
        return
    seen: set[str] = set()
    for location in locations:
        root = Path(location)
        if not root.is_dir():
            raise ConfigError(
                f"views package {top!r} is not a directory on disk ({location}): Spark's executors cannot be sent "
                "it; install it in the executors' Python"
            )
        for directory, dirs, names in os.walk(root, followlinks=True):
            dirs[:] = sorted(d for d in dirs if d not in EXCLUDED_DIRS)
            for name in sorted(names):
                if name.endswith(EXCLUDED_SUFFIXES):
                    continue
                path = Path(directory) / name
                arcname = "/".join((top, *path.relative_to(root).parts))
                if arcname not in seen:  # a namespace package's first location wins, as for imports
                    seen.add(arcname)
                    yield arcname, path


def _directory() -> Path:
    """Where this process keeps the zips it ships (the driver serves them to executors from there
    while its SparkContext lives): a private temporary directory, removed when the process exits."""
    global _workdir
    if _workdir is None:
        _workdir = Path(tempfile.mkdtemp(prefix="tideline-pyfiles-"))
        atexit.register(shutil.rmtree, _workdir, True)
    return _workdir

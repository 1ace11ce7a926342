"""The project file: an application's Tideline settings in one place, read by every ``tideline`` command.

Found from the working directory upwards: the first ``tideline.toml``, or ``pyproject.toml`` with a
``[tool.tideline]`` table; ``--project FILE`` or ``$TIDELINE_PROJECT`` names one instead. ::

    [tool.tideline]                      # in tideline.toml the same keys sit at the top level
    dsn = "postgresql://app@127.0.0.1:5432/app"
    views = "bank.views"                 # the ViewCatalog module of `tideline project …`
    migrations = ["bank/migrations"]     # your alembic branch(es) beside Tideline's: directories or packages
    backend = "embedded"                 # or "kafka"
    data_dir = "tideline-data"           # the embedded log's directory
    # kafka = "broker-1:9092,broker-2:9092"   # bootstrap servers, with backend = "kafka"

    [tool.tideline.capture]              # any option of `tideline capture run`, by its name
    tables = ["public.branches", "public.events"]
    outbox_table = "public.events"
    topic_prefix = "bank"

    [tool.tideline.project]              # any option of `tideline project rebuild|follow|status`
    engine = "auto"

Precedence, highest first: a command-line flag, its ``TIDELINE_*`` variable, the project file, the built-in
default. Relative paths (``data_dir``, ``migrations``, ``capture.state_dir``) are relative to the file's
directory, and that directory is put first on ``sys.path``: the views module and the migrations packages of the
project import without ``PYTHONPATH`` (as alembic's ``prepend_sys_path = .``).

A key the file does not know, or a value of the wrong type, is an error naming the file and the key: a typo
never silently falls back to a default.
"""

from __future__ import annotations

import os
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROJECT_ENV = "TIDELINE_PROJECT"
FILE_NAMES = ("tideline.toml", "pyproject.toml")
BACKENDS = ("embedded", "kafka")

# Top-level keys and the long option each supplies wherever a command has it.
TOP_LEVEL_OPTIONS = {"dsn": "--dsn", "views": "--views", "migrations": "--migrations"}
TOP_LEVEL_KEYS = (*TOP_LEVEL_OPTIONS, "backend", "data_dir", "kafka")
PATH_OPTIONS = frozenset({"state_dir"})  # section options holding a path: relative to the project file


class ProjectError(Exception):
    """The project file is unreadable or holds something Tideline does not understand."""


@dataclass(frozen=True)
class Project:
    """A parsed project file (every value as written, paths resolved against ``root``)."""

    path: Path
    root: Path
    dsn: str | None = None
    views: str | None = None
    migrations: tuple[str, ...] = ()
    backend: str | None = None
    data_dir: Path | None = None
    kafka: str | None = None
    sections: dict[str, dict[str, Any]] = field(default_factory=dict)  # CLI group -> option name -> value

    def kafka_bootstrap(self) -> str | None:
        """The bootstrap servers when the project's backend is Kafka, else None."""
        return self.kafka if self.backend == "kafka" else None


def find(start: Path | None = None, explicit: str | Path | None = None) -> Path | None:
    """The project file: ``explicit`` (or ``$TIDELINE_PROJECT``), else the nearest one from ``start`` up."""
    named = explicit if explicit is not None else os.environ.get(PROJECT_ENV) or None
    if named is not None:
        path = Path(named).expanduser()
        if path.is_dir():
            for name in FILE_NAMES:
                if _holds_settings(path / name):
                    return (path / name).resolve()
            raise ProjectError(f"{path}: no tideline.toml, nor a pyproject.toml with [tool.tideline]")
        if not path.is_file():
            raise ProjectError(f"project file {path} does not exist")
        return path.resolve()
    here = (start or Path.cwd()).resolve()
    for directory in (here, *here.parents):
        for name in FILE_NAMES:
            if _holds_settings(directory / name):
                return directory / name
    return None


def _holds_settings(path: Path) -> bool:
    if not path.is_file():
        return False
    if path.name != "pyproject.toml":
        return True
    try:
        return "tideline" in _read(path).get("tool", {})
    except ProjectError:
        return False  # someone else's broken pyproject.toml is not ours to judge


def _read(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ProjectError(f"cannot read the project file {path}: {e}") from None


def load(path: Path, sections: dict[str, set[str]]) -> Project:
    """Parse ``path``; ``sections`` says which option names each CLI group accepts (unknown keys are errors)."""
    data = _read(path)
    if path.name == "pyproject.toml":
        table = data.get("tool", {}).get("tideline")
        if not isinstance(table, dict):
            raise ProjectError(f"{path}: no [tool.tideline] table")
        where = "[tool.tideline]"
    else:
        table, where = data, "the top level"
    root = path.parent

    def fail(key: str, problem: str) -> ProjectError:
        return ProjectError(f"{path}: {key}: {problem}")

    def text(key: str) -> str | None:
        value = table.get(key)
        if value is None:
            return None
        if not isinstance(value, str) or not value.strip():
            raise fail(key, f"expected a non-empty string, got {value!r}")
        return value.strip()

    values: dict[str, Any] = {}
    group_tables: dict[str, dict[str, Any]] = {}
    for key, value in table.items():
        if isinstance(value, dict):
            if key not in sections:
                raise fail(key, f"unknown section (known: {', '.join(sorted(sections))})")
            group_tables[key] = value
        elif key not in TOP_LEVEL_KEYS:
            raise fail(key, f"unknown key in {where} (known: {', '.join(TOP_LEVEL_KEYS)}, and sections "
                            f"{', '.join(f'[{s}]' for s in sorted(sections))})")  # fmt: skip
    values["dsn"] = text("dsn")
    values["views"] = text("views")
    migrations = table.get("migrations", [])
    if isinstance(migrations, str):
        migrations = [migrations]
    if not isinstance(migrations, list) or not all(isinstance(m, str) and m.strip() for m in migrations):
        raise fail("migrations", f"expected a list of directories or package names, got {migrations!r}")
    values["migrations"] = tuple(_relative(m, root) for m in migrations)
    backend = text("backend")
    kafka = text("kafka")
    if backend is not None and backend not in BACKENDS:
        raise fail("backend", f"expected one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "kafka" and kafka is None:
        raise fail("backend", 'is "kafka" but no kafka = "HOST:PORT[,…]" names the bootstrap servers')
    if backend == "embedded" and kafka is not None:
        raise fail("kafka", 'is set but backend = "embedded": drop one of them')
    values["backend"] = backend or ("kafka" if kafka else None)
    values["kafka"] = kafka
    data_dir = text("data_dir")
    if data_dir is not None and values["backend"] == "kafka":
        raise fail("data_dir", 'is the embedded log\'s directory, but backend = "kafka"')
    values["data_dir"] = (root / Path(data_dir).expanduser()) if data_dir is not None else None
    parsed: dict[str, dict[str, Any]] = {}
    for group, options in group_tables.items():
        accepted = sections[group]
        parsed[group] = {}
        for name, value in options.items():
            option = name.replace("-", "_")
            if option not in accepted:
                raise fail(f"{group}.{name}", f"no `tideline {group}` command has this option "
                                              f"(known: {', '.join(sorted(accepted))})")  # fmt: skip
            if option in PATH_OPTIONS and isinstance(value, str):
                value = str(root / Path(value).expanduser())
            parsed[group][option] = value
    return Project(path, root, sections=parsed, **values)


def _relative(location: str, root: Path) -> str:
    """A migrations location: a path relative to the project root when it names a directory there, else as
    written (a package's dotted name)."""
    candidate = root / Path(location).expanduser()
    return str(candidate) if candidate.is_dir() else location


def activate(project: Project) -> None:
    """Make the project's own packages importable (its directory first on ``sys.path``) for this process and
    the Python processes it starts (``PYTHONPATH``; Spark's workers get the views package shipped)."""
    root = str(project.root)
    if root not in sys.path:
        sys.path.insert(0, root)
    current = os.environ.get("PYTHONPATH", "")
    if root not in current.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, current) if p)


def _is_group(command: Any) -> bool:
    return isinstance(getattr(command, "commands", None), dict)


def _options(command: Any) -> list[Any]:
    """A command's options (not its arguments). Duck-typed: typer ships its own copy of click."""
    return [p for p in command.params if getattr(p, "param_type_name", "") == "option" and p.name]


def options_by_group(root: Any) -> dict[str, set[str]]:
    """Per CLI group (``capture``, ``project``, …) the option names of its commands (what a section accepts)."""

    def names(command: Any) -> set[str]:
        if _is_group(command):
            return set().union(*(names(c) for c in command.commands.values())) if command.commands else set()
        return {p.name for p in _options(command)}

    return {name: names(c) for name, c in root.commands.items() if _is_group(c)}


def default_map(project: Project, root: Any) -> dict[str, Any]:
    """Click's ``default_map`` for ``root``'s sub-commands: the values the project supplies, per command and
    option (click ranks them below a flag and its environment variable, above the built-in default)."""
    top = {
        option: (list(value) if isinstance(value, tuple) else value)
        for key, option in TOP_LEVEL_OPTIONS.items()
        if (value := getattr(project, key))
    }

    def defaults(command: Any, section: dict[str, Any]) -> dict[str, Any]:
        if _is_group(command):
            return {n: d for n, c in command.commands.items() if (d := defaults(c, section))}
        out: dict[str, Any] = {}
        for param in _options(command):
            for option, value in top.items():
                if option in param.opts:
                    out[param.name] = value if param.multiple or not isinstance(value, list) else ",".join(value)
            if param.name in section:
                out[param.name] = section[param.name]
        return out

    return {n: d for n, c in root.commands.items() if (d := defaults(c, project.sections.get(n, {})))}

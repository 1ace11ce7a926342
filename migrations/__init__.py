"""Alembic migrations: Tideline's own tables, and beside them the tables of the application using it.

One alembic environment, one ``alembic_version`` table, several independent branches (alembic's
"multiple bases"):

- the ``tideline`` branch (``versions/`` here) holds only Tideline's tables: the write model
  (``events`` with its append-only trigger, ``commands``, ``claims``, ``snapshots``), the CDC mirror view
  ``cdc_mirror`` and the projections' bookkeeping (``projection_state``, ``projection_checkpoints``,
  ``projection_runs``);
- each application adds a directory of its own revisions (its view tables, its indexes), declared as a
  *migrations location*: a directory path, or the dotted name of a package whose directory holds the revision
  files (``bank.migrations``). Its first revision starts its own base and names its branch::

      revision = "bank_0001"
      down_revision = None
      branch_labels = ("bank",)
      depends_on = None          # or ("tideline_0002",) when a revision needs Tideline's tables first

  A revision that continues Tideline's chain (``down_revision`` one of Tideline's) is refused: Tideline's next
  migration would then fork its branch. ``new_revision`` (``tideline db revision``) writes such files.

Revision ids are namespaced (``tideline_0001``) so an application's own ``0001`` cannot collide with them.
Before Tideline 0.2 they were ``0001`` and ``0002`` and ``0002`` also created the reservations example's
tables; :func:`upgrade` renames those ids in ``alembic_version`` (when no loaded revision has that id), and the
example's first revision adopts its tables where they already exist.

The revision files spell their DDL out (a migration must keep meaning what it meant when it ran); ``env.py``
points alembic's ``target_metadata`` at the current table definitions in :mod:`commands.schema` and
:mod:`projections.models`, so ``alembic check`` and the tests can tell when they disagree. ``migrations``
imports ``commands`` and ``projections``, never the reverse.

From Python::

    import migrations
    apps = migrations.locations(["bank.migrations"])
    migrations.upgrade(dsn, apps=apps)            # every branch to its head; idempotent
    migrations.status(dsn, apps=apps)             # [BranchState(branch='tideline', current='tideline_0002', …), …]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from alembic.config import Config
    from alembic.script import Script, ScriptDirectory
    from sqlalchemy.engine import Connection

SCRIPT_LOCATION = Path(__file__).resolve().parent
VERSIONS = SCRIPT_LOCATION / "versions"
TIDELINE_BRANCH = "tideline"
HEADS = "heads"  # every branch to its head
LEGACY_REVISIONS = {"0001": "tideline_0001", "0002": "tideline_0002"}  # ids before Tideline 0.2


class MigrationsError(Exception):
    """The migration locations or their revisions are not usable (the message names what and where)."""


@dataclass(frozen=True)
class Branch:
    """One lineage of revisions: Tideline's, or an application's (named by its first revision's label)."""

    label: str
    head: str
    location: Path  # the directory of its revision files


@dataclass(frozen=True)
class BranchState:
    """Where the database is on one branch."""

    branch: Branch
    current: str | None  # None: none of the branch's revisions is applied

    @property
    def up_to_date(self) -> bool:
        return self.current == self.branch.head


def locations(sources: Iterable[str | Path], base: Path | None = None) -> tuple[Path, ...]:
    """The directories of an application's migrations: each source a directory (relative to ``base``, default
    the working directory) or the dotted name of an importable package (``bank.migrations``)."""
    found: list[Path] = []
    for source in sources:
        path = _locate(source, base)
        if path == VERSIONS:
            continue  # Tideline's own, always loaded
        if path not in found:
            found.append(path)
    return tuple(found)


def _locate(source: str | Path, base: Path | None) -> Path:
    text = str(source).strip()
    if not text:
        raise MigrationsError("an empty migrations location")
    candidate = Path(text).expanduser()
    if not candidate.is_absolute() and base is not None:
        candidate = base / candidate
    if candidate.is_dir():
        return candidate.resolve()
    if isinstance(source, str) and all(part.isidentifier() for part in text.split(".")):
        try:
            spec = importlib.util.find_spec(text)
        except (ImportError, ValueError) as e:
            raise MigrationsError(f"migrations location {text!r}: {e}") from None
        if spec is not None and spec.submodule_search_locations:
            return Path(next(iter(spec.submodule_search_locations))).resolve()
        if spec is not None:
            raise MigrationsError(f"migrations location {text!r} is a module, not a package directory")
    raise MigrationsError(f"migrations location {text!r}: no such directory or importable package")


def alembic_config(dsn: str, apps: Sequence[Path] = ()) -> Config:
    """An alembic Config for ``dsn`` without an ini file (env.py reads ``attributes['dsn']``): Tideline's
    revisions and those in ``apps`` (directories, see :func:`locations`)."""
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(SCRIPT_LOCATION))
    config.set_main_option("path_separator", "os")
    config.set_main_option("version_locations", os.pathsep.join(str(p) for p in (VERSIONS, *apps)))
    config.attributes["dsn"] = dsn
    return config


def script(apps: Sequence[Path] = ()) -> ScriptDirectory:
    """The revisions of Tideline and ``apps``, checked (see :func:`branches`)."""
    from alembic.script import ScriptDirectory
    from alembic.util import CommandError

    for path in apps:
        if not path.is_dir():
            raise MigrationsError(f"migrations location {path} is not a directory")
    directory = ScriptDirectory.from_config(alembic_config("", apps))
    try:
        revisions = list(directory.walk_revisions())
    except CommandError as e:
        raise MigrationsError(f"cannot read the migrations: {e}") from None
    ours = {r.revision for r in revisions if Path(r.path).parent == VERSIONS}
    for r in revisions:
        if Path(r.path).parent == VERSIONS:
            continue
        downs = _as_tuple(r.down_revision)
        if set(downs) & ours:
            raise MigrationsError(
                f"revision {r.revision} ({r.path}) continues Tideline's chain (down_revision {', '.join(downs)}): "
                "an application's migrations start their own base (down_revision = None, branch_labels = "
                "('yourapp',)) and name a Tideline revision they need in depends_on"
            )
    return directory


def branches(apps: Sequence[Path] = (), directory: ScriptDirectory | None = None) -> list[Branch]:
    """Tideline's branch first, then the applications' in label order; one head per branch (``directory``: the
    :func:`script` of ``apps`` when the caller has read it already)."""
    directory = directory or script(apps)
    found: dict[str, Branch] = {}
    for head in directory.get_heads():
        rev = directory.get_revision(head)
        assert rev is not None
        label = _label(directory, rev)
        if label in found:
            raise MigrationsError(
                f"branch {label!r} has two heads ({found[label].head}, {head}): "
                f"merge them (tideline db merge) or give the new lineage its own branch label"
            )
        found[label] = Branch(label, head, Path(rev.path).parent)
    if TIDELINE_BRANCH not in found:
        raise MigrationsError(f"Tideline's own migrations ({VERSIONS}) are missing")
    return [found[TIDELINE_BRANCH], *(found[k] for k in sorted(found) if k != TIDELINE_BRANCH)]


def _label(directory: ScriptDirectory, rev: Script) -> str:
    """The branch label of ``rev``'s lineage: the labels its base carries, else the base's revision id."""
    base = rev
    while base.down_revision is not None:
        downs = _as_tuple(base.down_revision)
        parent = directory.get_revision(downs[0])
        assert parent is not None
        base = parent
    labels = sorted(base.branch_labels)
    return labels[0] if labels else base.revision


def _lineage(directory: ScriptDirectory, branch: Branch) -> list[Script]:
    """The branch's revisions, head first (without the other branches' revisions it depends on)."""
    return [r for r in directory.walk_revisions("base", branch.head) if _label(directory, r) == branch.label]


def _as_tuple(value: str | Sequence[str] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def upgrade(dsn: str, revision: str = HEADS, apps: Sequence[Path] = ()) -> None:
    """Migrate the database at ``dsn`` up to ``revision`` (default: every branch to its head)."""
    from alembic import command

    directory = script(apps)
    _adopt_legacy_ids(dsn, directory)
    command.upgrade(alembic_config(dsn, apps), revision)


def downgrade(dsn: str, revision: str, apps: Sequence[Path] = ()) -> None:
    """Migrate down to ``revision`` (``base`` drops every table every branch created; ``tideline@base``
    Tideline's alone, an application's ``bank@base`` its own)."""
    from alembic import command

    directory = script(apps)
    _adopt_legacy_ids(dsn, directory)
    command.downgrade(alembic_config(dsn, apps), revision)


def _db_heads(conn: Connection, directory: ScriptDirectory) -> tuple[str, ...]:
    from alembic.runtime.migration import MigrationContext

    heads = MigrationContext.configure(conn).get_current_heads()
    known = {r.revision for r in directory.walk_revisions()}
    return tuple(LEGACY_REVISIONS[h] if h in LEGACY_REVISIONS and h not in known else h for h in heads)


def _adopt_legacy_ids(dsn: str, directory: ScriptDirectory) -> None:
    """Rename the revision ids of Tideline before 0.2 in ``alembic_version`` (in one transaction)."""
    from sqlalchemy import text

    from commands.db import make_engine

    known = {r.revision for r in directory.walk_revisions()}
    engine = make_engine(dsn)
    try:
        with engine.begin() as conn:
            if conn.execute(text("SELECT to_regclass('alembic_version')")).scalar() is None:
                return
            for old, new in LEGACY_REVISIONS.items():
                if old not in known:
                    conn.execute(
                        text("UPDATE alembic_version SET version_num = :new WHERE version_num = :old"),
                        {"old": old, "new": new},
                    )
    finally:
        engine.dispose()


def status(dsn: str, apps: Sequence[Path] = ()) -> list[BranchState]:
    """Per branch (Tideline's first), the revision the database is at and the branch's head."""
    from commands.db import make_engine

    directory = script(apps)
    found = branches(apps, directory)
    engine = make_engine(dsn)
    try:
        with engine.connect() as conn:
            heads = _db_heads(conn, directory)
    finally:
        engine.dispose()
    known = {r.revision for r in directory.walk_revisions()}
    applied: set[str] = set()
    for head in heads:
        if head not in known:
            raise MigrationsError(
                f"the database is at revision {head}, which none of the loaded migrations has: "
                "declare the application's migrations location (--migrations, TIDELINE_MIGRATIONS or the project file)"
            )
        applied.update(_ancestors(directory, head))
    states = []
    for branch in found:
        current = next((r.revision for r in _lineage(directory, branch) if r.revision in applied), None)
        states.append(BranchState(branch, current))
    return states


def _ancestors(directory: ScriptDirectory, head: str) -> set[str]:
    """``head`` and every revision it implies: its ancestors, and through ``depends_on`` the revisions of other
    branches with theirs (alembic keeps only the dependent revision in ``alembic_version``)."""
    seen: set[str] = set()
    pending = [head]
    while pending:
        rev = directory.get_revision(pending.pop())
        if rev is None or rev.revision in seen:
            continue
        seen.add(rev.revision)
        pending.extend(rev._all_down_revisions)  # down_revision and the resolved depends_on
    return seen


def current(dsn: str, branch: str = TIDELINE_BRANCH, apps: Sequence[Path] = ()) -> str | None:
    """The revision the database is at on ``branch``; None before its first upgrade."""
    for state in status(dsn, apps):
        if state.branch.label == branch:
            return state.current
    raise MigrationsError(f"no migrations branch {branch!r}")


def head(branch: str = TIDELINE_BRANCH, apps: Sequence[Path] = ()) -> str:
    """The latest revision of ``branch``."""
    for b in branches(apps):
        if b.label == branch:
            return b.head
    raise MigrationsError(f"no migrations branch {branch!r}")


def history(apps: Sequence[Path] = ()) -> list[tuple[str, str, str]]:
    """(branch, revision, message), branch by branch (Tideline's first), each from first to latest."""
    directory = script(apps)
    out: list[tuple[str, str, str]] = []
    for branch in branches(apps, directory):
        revs = reversed(_lineage(directory, branch))
        out.extend((branch.label, r.revision, (r.doc or "").strip()) for r in revs)
    return out


def new_revision(message: str, branch: str, location: Path, apps: Sequence[Path] = (),
                 depends_on: str | None = None, rev_id: str | None = None) -> Path:  # fmt: skip
    """Write a new, empty revision file into ``location`` (an application's migrations directory): the next of
    ``branch``, or its first (a new base labelled ``branch``) when the location has none yet."""
    from alembic import command

    location = location.resolve()
    if location == VERSIONS:
        raise MigrationsError("Tideline's own migrations are not for application revisions")
    location.mkdir(parents=True, exist_ok=True)
    loaded = tuple(dict.fromkeys((*apps, location)))
    labels = {b.label: b for b in branches(loaded)}
    if branch == TIDELINE_BRANCH:
        raise MigrationsError("the branch 'tideline' is Tideline's: name the application's own branch")
    config = alembic_config("", loaded)
    config.cmd_opts = argparse.Namespace(quiet=True)  # no "Generating …": the caller says what it wrote
    if branch in labels:
        if labels[branch].location != location:
            raise MigrationsError(f"branch {branch!r} lives in {labels[branch].location}, not {location}")
        script_ = command.revision(
            config, message, head=f"{branch}@head", depends_on=depends_on, rev_id=rev_id, version_path=str(location)
        )
    else:
        script_ = command.revision(
            config, message, head="base", branch_label=branch, depends_on=depends_on, rev_id=rev_id,
            version_path=str(location),
        )  # fmt: skip
    assert script_ is not None and not isinstance(script_, list)
    return Path(script_.path)

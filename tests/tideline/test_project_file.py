"""The project file (``[tool.tideline]`` in pyproject.toml, or tideline.toml): every command reads it, flags and
``TIDELINE_*`` variables override it, and what it does not understand is an error naming the file and the key."""

from __future__ import annotations

import textwrap
import uuid
from pathlib import Path

import psycopg
import pytest
from typer.testing import CliRunner

from tideline.cli import app
from tideline.pgharness import LocalPostgres

ROOT = Path(__file__).resolve().parents[2]
CLEAN_ENV = {"TIDELINE_DSN": None, "TIDELINE_DATA_DIR": None, "TIDELINE_KAFKA_BOOTSTRAP": None,
             "TIDELINE_MIGRATIONS": None, "TIDELINE_PROJECT": None, "TIDELINE_VIEWS": None}  # fmt: skip


def run(*args: str, env: dict[str, str | None] | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args), env={**CLEAN_ENV, **(env or {})})
    return result.exit_code, result.output


def ok(*args: str, env: dict[str, str | None] | None = None) -> str:
    code, out = run(*args, env=env)
    assert code == 0, out
    return out


def error(*args: str, env: dict[str, str | None] | None = None) -> str:
    code, out = run(*args, env=env)
    assert code == 1 and out.startswith("error: "), out
    return out


def write(directory: Path, name: str, text: str) -> Path:
    path = directory / name
    path.write_text(textwrap.dedent(text))
    return path


def tables(dsn: str) -> set[str]:
    with psycopg.connect(dsn) as conn:
        return {t for (t,) in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An application directory (the working directory) with its own migrations package."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ledger" / "migrations").mkdir(parents=True)
    write(tmp_path / "ledger", "__init__.py", "")
    write(tmp_path / "ledger" / "migrations", "__init__.py", "")
    write(
        tmp_path / "ledger" / "migrations",
        "ledger_0001.py",
        """
        import sqlalchemy as sa
        from alembic import op

        revision = "ledger_0001"
        down_revision = None
        branch_labels = ("ledger",)
        depends_on = None


        def upgrade():
            op.create_table("entries", sa.Column("id", sa.Text, primary_key=True))


        def downgrade():
            op.drop_table("entries")
        """,
    )
    return tmp_path


def test_commands_take_the_dsn_migrations_and_log_from_the_project_file(
    project: Path, postgres: LocalPostgres
) -> None:
    dsn = postgres.create_database(f"proj_{uuid.uuid4().hex[:8]}")
    write(project, "pyproject.toml", f"""
        [project]
        name = "ledger"

        [tool.tideline]
        dsn = "{dsn}"
        migrations = ["ledger/migrations"]
        data_dir = "log"

        [tool.tideline.capture]
        tables = ["public.entries"]
        topic_prefix = "ledger"
        slot = "ledger_slot"
        """)  # fmt: skip
    out = ok("db", "upgrade")
    assert "ledger: database at revision ledger_0001 (was empty)" in out, out
    assert "entries" in tables(dsn) and "events" in tables(dsn)
    assert "ledger: ledger_0001 (up to date)" in ok("db", "current")
    with psycopg.connect(dsn) as conn:
        conn.execute("INSERT INTO entries VALUES ('e1'), ('e2')")
    ok("capture", "run", "--exit-when-caught-up")  # dsn, tables, prefix, slot: all from the file
    assert (project / "log").is_dir()  # data_dir, relative to the file
    topics = ok("log", "topics")
    assert "ledger.public.entries" in topics, topics
    tail = ok("log", "tail", "ledger.public.entries", "--from-beginning")
    assert tail.count("\n") == 2 and '"e2"' in tail, tail
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT slot_name FROM pg_replication_slots").fetchall() == [("ledger_slot",)]


def test_flags_and_environment_override_the_file(project: Path, postgres: LocalPostgres, tmp_path: Path) -> None:
    real = postgres.create_database(f"proj_{uuid.uuid4().hex[:8]}")
    write(project, "tideline.toml", """
        dsn = "postgresql://nobody@127.0.0.1:1/from_the_file"
        migrations = ["ledger/migrations"]
        """)  # fmt: skip
    assert "port 1 fail" in error("db", "upgrade")  # the file's DSN (port 1) is the one used…
    ok("db", "upgrade", env={"TIDELINE_DSN": real})  # …below the environment…
    assert "ledger: ledger_0001 (up to date)" in ok("db", "current", "--dsn", real)  # …and below a flag
    # The data directory: flag over environment over file over default.
    write(project, "tideline.toml", 'data_dir = "from_file"\n')
    ok("log", "create", "t1")
    ok("log", "create", "t2", env={"TIDELINE_DATA_DIR": str(tmp_path / "from_env")})
    ok("--data-dir", str(tmp_path / "from_flag"), "log", "create", "t3", env={"TIDELINE_DATA_DIR": "unused"})
    assert "t1" in ok("--data-dir", str(project / "from_file"), "log", "topics")
    assert "t2" in ok("--data-dir", str(tmp_path / "from_env"), "log", "topics")
    assert "t3" in ok("--data-dir", str(tmp_path / "from_flag"), "log", "topics")


def test_an_explicit_project_file_and_a_directory_are_found(project: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    write(elsewhere, "tideline.toml", 'data_dir = "explicit-log"\n')
    ok("--project", str(elsewhere / "tideline.toml"), "log", "create", "a")
    assert (elsewhere / "explicit-log").is_dir()
    ok("log", "create", "b", env={"TIDELINE_PROJECT": str(elsewhere)})  # a directory holding one
    assert "b" in ok("--data-dir", str(elsewhere / "explicit-log"), "log", "topics")
    (project / "sub" / "dir").mkdir(parents=True)
    write(project, "pyproject.toml", '[tool.tideline]\ndata_dir = "upward"\n')
    import os

    os.chdir(project / "sub" / "dir")  # found from a subdirectory, paths relative to the file
    ok("log", "create", "c")
    assert (project / "upward").is_dir()
    assert "does not exist" in error("--project", str(tmp_path / "missing.toml"), "log", "topics")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('dsnn = "x"\n', "tideline.toml: dsnn: unknown key in the top level (known: dsn, views, migrations"),
        ("[capture]\ntopic_prefx = 'x'\n", "capture.topic_prefx: no `tideline capture` command has this option"),
        ("[captur]\nx = 1\n", "captur: unknown section (known: capture,"),
        ('backend = "kafka"\n', 'backend: is "kafka" but no kafka = "HOST:PORT[,…]"'),
        ('backend = "rabbit"\n', "backend: expected one of embedded, kafka, got 'rabbit'"),
        ('backend = "embedded"\nkafka = "b:9092"\n', 'kafka: is set but backend = "embedded"'),
        ("migrations = 3\n", "migrations: expected a list of directories or package names, got 3"),
        ("dsn = \n", "cannot read the project file"),
    ],
    ids=["key", "option", "section", "kafka-without-servers", "backend", "both", "migrations", "toml"],
)
def test_what_the_file_gets_wrong_is_named(project: Path, text: str, message: str) -> None:
    write(project, "tideline.toml", text)
    out = error("log", "topics")
    assert message in out, out
    assert f"{project / 'tideline.toml'}: " in out, out  # the file is named


def test_a_kafka_backend_in_the_file_is_the_log(project: Path) -> None:
    """backend = "kafka" sends the log commands to the bootstrap servers named (none listens here: the error
    names them, proof they were used)."""
    write(project, "tideline.toml", 'backend = "kafka"\nkafka = "127.0.0.1:1"\n')
    code, out = run("log", "topics")
    assert code != 0 and "127.0.0.1:1" in out, out


def test_the_project_directory_is_importable(project: Path, postgres: LocalPostgres) -> None:
    """The project's views module imports without PYTHONPATH (the file's directory is put first on sys.path):
    the catalog is read (the error lists its views) rather than "cannot import"."""
    write(project / "ledger", "views.py", """
        from projections.views import MirrorView, ViewCatalog
        VIEWS = ViewCatalog(module=__name__, views={"entries": MirrorView("entries", "ledger.public.entries")})
        """)  # fmt: skip
    dsn = postgres.create_database(f"proj_{uuid.uuid4().hex[:8]}")
    write(project, "tideline.toml", f'dsn = "{dsn}"\nviews = "ledger.views"\n')
    ok("db", "upgrade")
    out = error("project", "rebuild", "nothing")
    assert "unknown projection 'nothing' (known: entries)" in out, out
    out = error("project", "rebuild", "entries", "--views", "ledger.nothing")  # a flag overrides the file
    assert "cannot import the views module 'ledger.nothing'" in out, out


def test_nothing_defaults_to_an_example(project: Path) -> None:
    """Without --views, TIDELINE_VIEWS or the file's views, a projection command says what to give."""
    write(project, "tideline.toml", 'data_dir = "log"\n')
    out = error("project", "rebuild", "users", "--dsn", "postgresql://nobody@127.0.0.1:1/x")
    assert "no views module: pass --views MODULE, set TIDELINE_VIEWS, or name views in the project file" in out, out

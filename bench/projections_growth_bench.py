"""Projections growth benchmark: the ``seats`` rebuild at 20,000,000 events against the same
rebuild at 2,000,000, same run — how a fold rebuild's cost grows with the log (issue 17).

Its own section (``--only projections_growth``), apart from the 2M comparisons with Parquet
(:mod:`bench.projections_bench`): it takes about ten minutes and writes ≈ 8 GB of log, and
its figure is a ratio within one run, so either section can be measured again alone.

Method: the reservations log of :func:`bench.projections_bench.make_reservations_log` (the
same generator, 4 partitions) at 2M events, rebuilt twice (the first warms Spark and its
Python workers and is not counted; the second is the baseline), then at 20M events, rebuilt
once, right after the baseline (one pair: the ratio is that pair's; no best-of):
``projections.rebuild.rebuild`` end to end (offsets, fold, COPY into staging, swap), each into
a fresh database so both swaps start from an empty view. Spark ``local[2]`` as in the
projections section. ``--quick``: 100,000 against 20,000 events.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from bench.projections_bench import EVENTS_TOPIC, FULL_EVENTS, VIEW, make_reservations_log, start_spark
from bench.report import Section, measured
from projections import rebuild
from tideline.pgharness import LocalPostgres

if TYPE_CHECKING:
    from bench.__main__ import Context

KEY = "projections_growth"
TITLE = "Projections: how a fold rebuild grows from 2M to 20M events"

LARGE_EVENTS = 20_000_000
QUICK = (20_000, 100_000)


def run(ctx: Context, section: Section) -> None:
    from examples.reservations import models as example
    from examples.reservations.views import VIEWS

    small_n, large_n = QUICK if ctx.quick else (FULL_EVENTS, LARGE_EVENTS)
    load_before = os.getloadavg()[0]
    spark = start_spark()
    pg = LocalPostgres(ctx.workdir / "pg", fast=True)
    pg.start()
    try:

        def rebuilt(n: int, database: str) -> tuple[float, int, int]:
            log_dir = ctx.workdir / f"reservations-{n}"
            if not log_dir.exists():
                t0 = time.perf_counter()
                streams = make_reservations_log(log_dir, n)
                ctx.say(
                    f"{n:,} reservation events ({streams:,} streams) into the log in {time.perf_counter() - t0:.1f} s"
                )
            dsn = pg.create_database(database)
            example.upgrade(dsn)  # Tideline's branch and the example's view tables
            result = rebuild.rebuild(spark, VIEWS, VIEW, log_dir=log_dir, dsn=dsn)
            if result.events != n:
                raise AssertionError(f"the rebuild read {result.events:,} of {n:,} events of {EVENTS_TOPIC}")
            ctx.say(f"rebuild of {n:,} events: {result.seconds:.1f} s, {n / result.seconds:,.0f} events/s")
            return result.seconds, result.rows, n

        warm_s, _, _ = rebuilt(small_n, "growth_warmup")  # warms Spark and its Python workers: not counted
        small_s, _, _ = rebuilt(small_n, "growth_small")
        large_s, large_rows, _ = rebuilt(large_n, "growth_large")  # back to back with the baseline: one pair
    finally:
        spark.stop()
        pg.stop()
    section.results.append(
        measured(
            f"rebuild of the `{VIEW}` view at {large_n:,} events",
            large_n / large_s,
            "events/s",
            baseline_name=f"same rebuild at {small_n:,} events, same run",
            baseline_value=small_n / small_s,
            note=f"{large_rows:,} seat rows; {large_s:.0f} s end to end, one run, right after the {small_n:,}-event "
            f"rebuild it is compared with ({small_s:.1f} s; a warm-up rebuild before it, not counted, took "
            f"{warm_s:.1f} s); informational (how the cost grows; the 20M-event goal is in docs/targets.md)",
        )
    )
    section.results.append(
        measured(
            f"rebuild of the `{VIEW}` view at {large_n:,} events, end to end",
            large_s,
            "s",
            note="informational: the goal (docs/targets.md) is ≤ 60 s on 2 vCPUs for 20,000,000 events, and ≥ 2× "
            "the events/s of the same fold from Parquet; not enforced yet",
        )
    )
    section.notes.append(
        "The reservations log of the projections section's generator (4 partitions, ~215k streams per 2M "
        "events); each rebuild into a fresh database (an empty view to swap into). Spark local[2], driver "
        "memory 1.5 GiB; Postgres: a private cluster (fast settings: fsync off)."
    )
    section.notes.append(
        f"Load average (1 min) at the start and the end of this section: {load_before:.1f} and "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs."
    )

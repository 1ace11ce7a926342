"""Configuration: where the log lives and how commands find it.

Resolution order for the log directory: the ``--data-dir`` option, then the
``TIDELINE_DATA_DIR`` environment variable, then ``./tideline-data``.

Kafka instead of the embedded log: the ``--kafka HOST:PORT[,…]`` option, else the
``TIDELINE_KAFKA_BOOTSTRAP`` environment variable; neither set = the embedded log.
"""

from __future__ import annotations

import os
from pathlib import Path

DATA_DIR_ENV = "TIDELINE_DATA_DIR"
KAFKA_BOOTSTRAP_ENV = "TIDELINE_KAFKA_BOOTSTRAP"
DEFAULT_DATA_DIR = Path("tideline-data")


def resolve_data_dir(option: Path | None) -> Path:
    """Return the log directory chosen by option, environment or default."""
    if option is not None:
        return option
    env = os.environ.get(DATA_DIR_ENV)
    if env:
        return Path(env)
    return DEFAULT_DATA_DIR


def resolve_kafka_bootstrap(option: str | None) -> str | None:
    """Kafka bootstrap servers chosen by option or environment; None means the embedded log."""
    value = option if option is not None else os.environ.get(KAFKA_BOOTSTRAP_ENV)
    return value.strip() or None if value is not None else None

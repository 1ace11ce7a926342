"""Configuration: where the log lives and how commands find it.

Resolution order for the log directory: the ``--data-dir`` option, then the
``TIDELINE_DATA_DIR`` environment variable, then ``./tideline-data``.
"""

from __future__ import annotations

import os
from pathlib import Path

DATA_DIR_ENV = "TIDELINE_DATA_DIR"
DEFAULT_DATA_DIR = Path("tideline-data")


def resolve_data_dir(option: Path | None) -> Path:
    """Return the log directory chosen by option, environment or default."""
    if option is not None:
        return option
    env = os.environ.get(DATA_DIR_ENV)
    if env:
        return Path(env)
    return DEFAULT_DATA_DIR

"""${message}

Revision ID: ${up_revision}
Revises: ${down_revision | comma,n}
Create Date: ${create_date}
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
${imports if imports else ""}

revision: str = ${repr(up_revision)}
down_revision: str | None = ${repr(down_revision)}
branch_labels: tuple[str, ...] | None = ${repr(((branch_labels,) if isinstance(branch_labels, str) else tuple(branch_labels)) if branch_labels else None)}
depends_on: tuple[str, ...] | None = ${repr(((depends_on,) if isinstance(depends_on, str) else tuple(depends_on)) if depends_on else None)}


def upgrade() -> None:
    ${upgrades if upgrades else "raise NotImplementedError('write the upgrade')"}


def downgrade() -> None:
    ${downgrades if downgrades else "raise NotImplementedError('write the downgrade')"}

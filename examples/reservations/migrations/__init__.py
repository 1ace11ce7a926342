"""The reservations example's migrations: the ``reservations`` branch beside Tideline's own.

A migrations location as any application declares one (``--migrations examples.reservations.migrations``,
``TIDELINE_MIGRATIONS`` or the project file); alembic reads the revision files, never this ``__init__``.
"""

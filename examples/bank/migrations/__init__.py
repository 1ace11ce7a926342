"""The bank's migrations: alembic revision files of the ``bank`` branch, applied beside Tideline's own by
``tideline db upgrade --migrations examples.bank.migrations`` (alembic reads the revisions, never this file)."""

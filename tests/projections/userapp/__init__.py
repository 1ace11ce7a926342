"""A small application of the projections tests' own, as a user writes one on Tideline: an
``account`` aggregate (opened, deposits, withdrawals), a fold view and a count view on tables of
its own (created by the tests from :data:`views.DDL`, with an alembic-style naming convention),
and any mirror. Imports inside it are relative, so that a test can copy it under another name into
a directory outside the repository (Spark's executors then get it only by Tideline's shipping)."""

"""Bank accounts on Tideline: an application built only on Tideline's public API (docs/your-app.md).

Everything here is the application's own: its domain (:mod:`.domain`, money as ``Decimal``), its view tables and
their migrations branch (:mod:`.models`, ``migrations/``, branch ``bank``), its projections (:mod:`.views`), its
service (:mod:`.app`) and command line (``python -m examples.bank``). Tideline never imports it.
"""

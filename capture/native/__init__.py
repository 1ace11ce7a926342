"""The native capture core: the Rust extension ``tideline_native`` and everything that drives it.

The package is Tideline's one boundary with the extension (tests/capture/test_import_graph.py holds it
to that): nothing outside it imports ``tideline_native``, and inside it only :mod:`.extension` does.

* :mod:`capture.native.extension` — the import itself: whether the extension can be used and why not,
  and its classes and functions (None without it). Imports nothing of capture.
* :mod:`capture.native.handle` — one connector's ``tideline_native.Core``: made with capture's
  ``Plugin`` and ``ValueFormat`` mapped to the extension's enums (the one place they meet), and
  every registration the core holds (tables, Avro layouts, pgoutput relations) owned together with
  the Python side's record of it; the core's output buffers as Arrow arrays.
* :mod:`capture.native.core` — :class:`~capture.native.core.NativeCore`, which the streaming source
  hands runs of XLogData messages, and the choice of core per connector and per table, reported.
* :mod:`capture.native.avro` — the Avro layout a table's registration carries (``--value-format avro``).
* :mod:`capture.native.verify` — the run-by-run check against the Python reference path
  (``TIDELINE_NATIVE_VERIFY=1``; the test suite turns it on for every test).

Import the module that holds a name: this file imports nothing, so that the light users of the
extension (capture.replication, capture.snapshot_readers, whose reader processes start lean, and
capture.config's ``--core native`` check) load :mod:`.extension` without the core's modules, and no
module of capture imports the core through a package that the core itself imports.
"""

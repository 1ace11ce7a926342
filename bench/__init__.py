"""Tideline benchmarks: ``python -m bench`` (``make bench``) runs them and rewrites BENCHMARKS.md.

Every figure is measured next to a peer or ceiling taken in the same run on the same
machine (a raw ``os.write``/``os.read`` loop, another library, …) and reported as a
ratio against the project's targets (docs/targets.md). See :mod:`bench.__main__` for the module list
and :mod:`bench.report` for the result format.
"""

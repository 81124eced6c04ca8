"""The engine: one check step, fuzz targets, sessions, replay.

Owns ``check`` (a case against the oracle on some paths, used by every
front), ``target`` (Hypothesis rounds per group of paths), ``session`` (the
budget, saving findings as they happen), ``database``, ``parallel`` (the
xdist controller), ``result`` and ``runner`` (the public entry points). May
import everything below it: artifacts, paths, compare, oracles, workers, materialize,
generate, case.
"""

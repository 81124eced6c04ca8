"""Observations in, Divergences out.

Owns value comparison with term-scaled tolerances (``values``) and the
per-use-site explanations of a wrong grad (``sites``). Sees observations
only: it may import the case, materialize (for magnitude bounds) and
``harness.observation``, never a path, a worker or an oracle.
"""

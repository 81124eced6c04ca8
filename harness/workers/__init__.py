"""Processes the harness starts and owns: the worker pool and its registry
of process groups (``pool``), the rank host every rank runs (``host``) and
crash isolation for one path in a child (``isolation``). Knows no path
family: a family's rank code is named by ``MODULE`` in each message.
"""

"""The ``gradfuzz`` command and its fronts: argument parsing, the fuzz
session front (``fuzz``), progress displays (``progress``), the terminal
summary (``report``) and ``bench``. The top layer: it may import anything,
nothing imports it but ``harness.__main__`` and the entry point.
"""

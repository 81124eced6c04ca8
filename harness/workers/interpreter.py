"""How the harness starts a Python child: with the parent's import path, set
explicitly, and nothing from the directory it was started in.

A plain ``python -m module`` puts the working directory first on its path,
and the workers used to add it to ``PYTHONPATH`` too, so a ``sitecustomize.py``
(run by every interpreter at startup) or a ``torch.py`` in the directory a
user runs gradfuzz from, such as a checkout of a pull request, ran inside
the worker. A child is therefore started isolated (``-I``: no working
directory, no ``PYTHONPATH``, no user site at startup) and then given the
parent's own path, which already holds whatever the user installed or named
on ``PYTHONPATH``; only absolute entries are passed, never ``""`` (the
working directory, wherever that is).
"""

from __future__ import annotations

import json
import os
import sys

# Run in the child by ``python -I -c``: argv is [path as JSON, module, its args].
_BOOT = ("import faulthandler, json, runpy, sys; faulthandler.enable(); sys.path[:] = json.loads(sys.argv[1]); "
         "module = sys.argv[2]; sys.argv[:] = [module, *sys.argv[3:]]; "
         "runpy.run_module(module, run_name='__main__', alter_sys=True)")


def import_path() -> list[str]:
    """This process's import path without its relative entries (``""`` is the working directory)."""
    return [p for p in sys.path if p and os.path.isabs(p)]


def python(module: str, *args: str) -> list[str]:
    """argv that runs ``module`` as ``__main__`` in a child with this process's import path."""
    return [sys.executable, "-I", "-c", _BOOT, json.dumps(import_path()), module, *args]


def one_thread() -> bool:
    """Whether gradfuzz's processes run one intra-op thread: yes unless
    ``GRADFUZZ_KEEP_THREADS`` keeps torch's default. Cases are tiny: with a
    thread per core, each compile child of a 16-worker gate on 16 cores ran
    16 OpenMP threads around its ops (load 26 on 16 cores), and the numbers
    of a reduction would follow the host's core count."""
    return not os.environ.get("GRADFUZZ_KEEP_THREADS")


def one_thread_env() -> dict[str, str]:
    """A child's environment for ``one_thread``."""
    return {"OMP_NUM_THREADS": "1"} if one_thread() else {}

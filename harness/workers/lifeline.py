"""Processes that end when the process that started them ends.

``gradfuzz fuzz -n N`` starts pytest in its own session (so a terminal's
Ctrl-C reaches only the controller), and pytest-xdist starts the workers
under it. Killed outright (SIGKILL, an OOM kill, a CI runner cancelling a
job), the controller runs no cleanup: without this, pytest and its workers
(and their pools' ranks) went on fuzzing, orphaned. Two mechanisms, since
neither covers every case alone:

* ``PR_SET_PDEATHSIG`` (Linux): the kernel SIGKILLs the process when the
  thread that forked it exits. Immediate, but tied to the direct parent.
* a watchdog thread that polls a named ancestor (the controller) and exits
  when it is gone: covers a grandchild (an xdist worker, whose parent is
  pytest) and systems without prctl.

Light on purpose (no torch import): pytest workers load it at configure.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

ENV = "GRADFUZZ_LIFELINE_PID"  # the pid whose death ends a controller's pytest and its workers
POLL_S = 0.5


def set_parent_death_signal(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send ``sig`` when our parent dies (Linux; a no-op elsewhere).
    Safe as a ``preexec_fn``: no allocation beyond the ctypes call."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(sig), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def alive(pid: int) -> bool:
    """Does ``pid`` exist (a zombie counts as gone: it is dead, only unreaped)?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True  # no /proc: kill(0) said it exists


def watch(pid: int, poll_s: float = POLL_S) -> threading.Thread | None:
    """Exit this process (status 1, no cleanup: our owner is gone) once ``pid`` is."""
    if pid <= 1 or pid == os.getpid():
        return None
    if not alive(pid):
        os._exit(1)

    def run() -> None:
        while True:
            time.sleep(poll_s)
            if not alive(pid):
                os._exit(1)

    t = threading.Thread(target=run, name="gradfuzz-lifeline", daemon=True)
    t.start()
    return t


def from_environment() -> threading.Thread | None:
    """In a process started for a controller (``ENV`` set): die with it."""
    try:
        pid = int(os.environ.get(ENV, ""))
    except ValueError:
        return None
    set_parent_death_signal()
    return watch(pid)

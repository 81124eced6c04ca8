"""When every rank still running a case is blocked for good.

Once one rank has raised, its peers usually sit in a collective or a recv
that only the group's hour-long timeout would end. The pool used to give
them a fixed grace (5 s) to answer before it replaced the group; a shrink of
a raising case on a 4-rank mesh path paid that on every step (28 times, 145
of 164 s of a 20-example fuzz of ``mesh.pp_dp``). Ranks that can still
answer are computing; ranks that cannot are asleep. So the pool samples the
kernel's view of the waiting ranks: when none of their threads is runnable
and none has used CPU time over ``WINDOW`` seconds, nothing in the group can
move (the only ranks that could wake them have already answered), and the
wait ends there. A rank that is merely starved of CPU on a loaded machine
shows a runnable thread, so load lengthens the wait but never cuts short a
rank that would still have answered.

Linux only (``/proc``); elsewhere ``blocked`` says no and the grace applies.
The pool uses it for gloo groups only: a GPU rank may sleep in a stream
sync while its kernels still run, and would look blocked.
"""

from __future__ import annotations

import os
import time

WINDOW = 0.5  # seconds without CPU progress or a runnable thread
POLL = 0.1  # seconds between samples


def _sample(pid: int) -> tuple[int, bool] | None:
    """(CPU ticks of the whole process, whether any thread may be moving); None if unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        ticks = int(fields[11]) + int(fields[12])  # utime + stime (fields 14 and 15 of proc(5))
        runnable = False
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] in ("R", "D"):  # running, or in the kernel on I/O
                    runnable = True
                    break
    except (OSError, IndexError, ValueError):
        return None
    return ticks, runnable


class Stillness:
    """Samples of the waiting ranks; ``blocked`` once they have all been still for ``WINDOW``."""

    def __init__(self) -> None:
        self._since: float | None = None
        self._last: dict[int, int] = {}

    def blocked(self, pids: list[int]) -> bool:
        now = time.monotonic()
        samples = {pid: _sample(pid) for pid in pids}
        moving = any(s is None or s[1] or self._last.get(pid, -1) != s[0] for pid, s in samples.items())
        self._last = {pid: s[0] for pid, s in samples.items() if s is not None}
        if moving or not pids:
            self._since = None
            return False
        if self._since is None:
            self._since = now
        return now - self._since >= WINDOW

"""Child processes, N at a time: the gate's canaries and replay groups.

Each job is one ``python -m MODULE ARGS`` command (``[MODULE, *ARGS]``;
forked from the zygote where it can be, ``harness.workers.zygote``) whose
output goes to a log file;
the caller reads what the child wrote and is told how each one ended, with
the tail of its log when it failed. Children run single-threaded: N of them
share the cores. Each knows its slot (``SLOT_ENV``: 0 to N-1, reused as
children end), so the process groups it starts spread over the GPUs
(``placement.first_gpu``) as the fuzz phase's xdist workers' do.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from typing import Any, Callable

from harness.workers import zygote
from harness.workers.interpreter import one_thread_env

SLOT_ENV = "GRADFUZZ_SLOT"


@dataclass
class Ended:
    key: str
    returncode: int
    seconds: float
    log: str  # the log file's path

    def tail(self, chars: int = 1500) -> str:
        with open(self.log, errors="replace") as fh:
            return fh.read()[-chars:]


def run_jobs(jobs: list[tuple[str, list[str]]], workers: int, folder: str, on_end: Callable[[Ended], None],
             on_tick: Callable[[list[str], list[str]], None] | None = None, tick: float = 10.0) -> None:
    """Run ``(key, [module, *args])`` jobs, ``workers`` at a time; ``on_end`` as each
    ends, ``on_tick(pending, running)`` every ``tick`` seconds and at the end."""
    pending = list(jobs)
    running: dict[str, tuple[Any, float, str, int]] = {}
    env = {**os.environ, **one_thread_env()}
    shown = 0.0
    while pending or running:
        while pending and len(running) < max(1, workers):
            key, argv = pending.pop(0)
            log = os.path.join(folder, f"{key}.log")
            slot = min(set(range(len(running) + 1)) - {r[3] for r in running.values()})
            with open(log, "w") as fh:
                proc = zygote.start(argv[0], argv[1:], stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env={**env, SLOT_ENV: str(slot)})
            running[key] = (proc, time.monotonic(), log, slot)
        time.sleep(0.2)
        for key, (proc, t0, log, _) in list(running.items()):
            if proc.poll() is not None:
                del running[key]
                on_end(Ended(key, proc.returncode, time.monotonic() - t0, log))
        now = time.monotonic()
        if on_tick is not None and (now - shown >= tick or not (pending or running)):
            shown = now
            on_tick([k for k, _ in pending], list(running))

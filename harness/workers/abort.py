"""Freeing the peers of a failed rank on NCCL by aborting their communicators.

When one rank of a case raises, its peers are left in a collective or a
point-to-point op that the failed rank never joins. On gloo the pool sees
them asleep in ``/proc`` and lets them go (``stillness``). On NCCL that
test cannot tell: a rank waiting in ``cudaDeviceSynchronize`` behind a NCCL
kernel that spins for a peer that will never come looks like one whose
kernels still run, so the pool used to wait out its whole grace (5 s), and a
shrink of a raising case paid it on every step. Aborting the communicator
is what NCCL offers for exactly this: the spinning kernels see the abort
flag and exit, the rank's blocking CUDA call returns and the rank answers.

The pool asks for it with a signal (``request``). A signal handler in
Python would run only once the main thread is back from C, which is where
it is stuck, so each rank blocks the signal in every thread (``arm``, before
any thread exists, so NCCL's threads inherit the mask) and one thread of
its own waits for it with ``sigwait``. The pool keeps it to the ranks that
have not answered after a peer failed: an abort ends the process group, and
the group is replaced after the case as before.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Callable

SIGNAL = signal.SIGUSR2  # SIGUSR1 is faulthandler's stack dump (harness.workers.host)

# Set once this rank's communicators were aborted; the host clears it per message and tells the pool.
fired = threading.Event()


def abort_nccl() -> str:
    """Abort every NCCL communicator of this process; what was done, in words.

    Not ``distributed_c10d._abort_process_group``: that also aborts the gloo
    groups (the pipeline ranks' control group), which not every release
    supports, and clears the registry a still-running case thread reads."""
    import torch
    from torch.distributed import distributed_c10d as c10d

    nccl = getattr(c10d, "ProcessGroupNCCL", None)
    backends = []
    for pg in list(getattr(c10d._world, "pg_names", {})):
        try:
            b = pg._get_backend(torch.device("cuda"))
        except Exception:  # a gloo-only group
            continue
        if nccl is not None and isinstance(b, nccl):
            backends.append(b)
    if not backends:
        return "no NCCL communicator to abort"
    # One group around every abort, as torch's own _abort_process_group does
    # (pytorch#119797: aborts of several communicators can deadlock each other).
    grouped = hasattr(backends[0], "_group_start")
    if grouped:
        backends[0]._group_start()
    failed = []
    for b in backends:
        try:
            b.abort()
        except Exception as e:
            failed.append(f"{type(e).__name__}: {e}")
    if grouped:
        backends[0]._group_end()
    return f"aborted {len(backends) - len(failed)} NCCL communicator(s)" + (f"; {failed[0]}" if failed else "")


def arm(action: Callable[[], str] = abort_nccl) -> None:
    """In a rank, before it starts any thread: run ``action`` whenever the pool asks."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {SIGNAL})

    def listen() -> None:
        while True:
            signal.sigwait({SIGNAL})
            try:
                what = action()
            except Exception as e:  # the pool's grace still ends the case if this did not free the rank
                what = f"abort failed: {type(e).__name__}: {e}"
            print(f"gradfuzz: a peer failed; {what}", flush=True)
            fired.set()

    threading.Thread(target=listen, name="gradfuzz-abort", daemon=True).start()


def request(pids: list[int]) -> None:
    """In the pool: ask these ranks to abort their communicators."""
    for pid in pids:
        try:
            os.kill(pid, SIGNAL)
        except ProcessLookupError:
            pass

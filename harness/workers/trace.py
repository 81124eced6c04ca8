"""An opt-in record of what a process's worker pools spent their time on.

Where a gate on NCCL loses its minutes is in the pools, not in the paths:
group starts (a fresh NCCL communicator per rank), requests whose peers had
to be freed after one rank raised, and the restarts that follow; beside
them, the cases of the isolated children (compile, graphed), which bound
the other phases. With ``GRADFUZZ_POOL_TRACE`` set to a folder, every pool
and isolated path of every harness process appends one tab-separated line
per start, request and case to a file of its own there
(``pool-<xdist worker or gate slot>-<pid>.tsv``): time, event, backend,
what was asked, the outcome, seconds, and notes (which ranks failed,
whether peers were aborted). Off by default (no file is opened), so it
costs nothing where nobody reads it.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

from harness.workers.jobs import SLOT_ENV

ENV = "GRADFUZZ_POOL_TRACE"


def record(event: str, backend: str, what: str = "", status: str = "", seconds: float = 0.0, note: str = "") -> None:
    """Append one line for this process's pools, when a trace folder is set."""
    folder = os.environ.get(ENV)
    if not folder:
        return
    fields = (f"{time.time():.3f}", event, backend, what, status, f"{seconds:.3f}", note.replace("\n", " ")[:200])
    try:
        os.makedirs(folder, exist_ok=True)
        who = os.environ.get("PYTEST_XDIST_WORKER") or "slot" + os.environ.get(SLOT_ENV, "")
        with open(os.path.join(folder, f"pool-{who}-{os.getpid()}.tsv"), "a") as fh:
            fh.write("\t".join(fields) + "\n")
    except OSError:  # a trace that cannot be written must not fail a case
        pass


def request(backend: str, msg: dict[str, Any], outcome: Any, failed: Callable[[Any], bool], aborted: bool,
            lost: bool) -> None:
    """One request's line: which ranks failed, whether its peers were aborted
    or freed their own point-to-point group, and why it did not end "ok"."""
    if not os.environ.get(ENV):
        return
    replies = outcome.replies
    failing = [r for r in sorted(replies) if failed(replies[r])]
    notes = [f"failed {failing}"] if failing else []
    freed = [r for r in sorted(replies) if isinstance(replies[r], dict) and "p2p_freed" in replies[r]]
    if freed:
        notes.append("p2p_freed " + "".join("1" if replies[r]["p2p_freed"] else "0" for r in freed))
        notes.append("in " + ",".join(str(replies[r].get("p2p_seconds", "?")) for r in freed) + " s")
    notes += ["aborted"] * aborted + ["lost"] * lost + [outcome.detail[:120]] * bool(outcome.status != "ok")
    record("request", backend, describe(msg), outcome.status, outcome.seconds, " ".join(notes))


def describe(msg: dict[str, Any]) -> str:
    """A request in a few words: the family module's last part, and the pipeline's schedule and stage class."""
    module = str(msg.get("module") or msg.get("op") or "").rsplit(".", 2)
    parts = [".".join(module[-2:])] if module != [""] else []
    for key in ("what", "schedule", "impl"):
        if msg.get(key):
            parts.append(str(msg[key]).rsplit(":", 1)[-1])
    return " ".join(parts)

"""Sends written while in flight: a race made visible without waiting for it to happen.

``torch.distributed.isend`` says that modifying the tensor before the
request completes is undefined. The schedules wait for their send requests
late ("mostly these operations should have finished long ago", at the end
of ``step()``), and a zero-bubble W pass can adopt a grad that is also the
buffer a send is still reading (``weight.grad = dw``, then the next
microbatch's ``+=`` writes it). Whether the peer then receives the old or the
new values depends on when gloo's or NCCL's thread copied the buffer, so
the value divergence comes and goes between runs of one case (seen: 1 run
in 10), and the verdict with it.

The write itself is not racy: every in-place write bumps the tensor's
version counter, in the order the rank's one thread runs the schedule. So
each send's version is noted when it is posted and compared when its
request is waited: a change is the bug, on every run. Only the calling
thread's sends are watched (a stale case thread of a replaced group may
still be blocked in torch). Where the installed torch has no such helpers
the watch is off and nothing is reported.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Iterator


def _hooks() -> Any:
    try:
        from torch.distributed.pipelining import schedules
    except Exception:  # a build without pipelining: the schedules cannot run either
        return None
    if not (callable(getattr(schedules, "_batch_p2p", None)) and callable(getattr(schedules, "_wait_batch_p2p", None))):
        return None
    return schedules


def _label_sends(stages: list[Any], labels: dict[int, str]) -> list[tuple[Any, str, Any]]:
    """Wrap each stage's send-op builders so a send says what it carries."""
    saved = []
    for stage in stages:
        for attr, what in (("get_fwd_send_ops", "output"), ("get_bwd_send_ops", "input grad")):
            orig = getattr(stage, attr, None)
            if not callable(orig):
                continue

            def labelled(chunk: int, *a: Any, _orig: Any = orig, _what: str = what, _i: Any = stage.stage_index,
                         **kw: Any) -> Any:
                ops = _orig(chunk, *a, **kw)
                for op in ops:
                    labels[id(op)] = f"stage {_i}'s {_what} for microbatch {chunk}"
                return ops

            saved.append((stage, attr, vars(stage).get(attr)))
            setattr(stage, attr, labelled)
    return saved


@contextmanager
def watched(stages: list[Any]) -> Iterator[list[str]]:
    """Within: every send these stages post is checked when waited (or, if
    never waited, when the block ends without raising). Yields the list that collects what was
    written in flight, one sentence each."""
    import torch.distributed as dist

    found: list[str] = []
    schedules = _hooks()
    if schedules is None:
        yield found
        return
    me = threading.current_thread()
    labels: dict[int, str] = {}
    pending: dict[int, tuple[list[Any], list[tuple[Any, int, str]]]] = {}
    post, wait = schedules._batch_p2p, schedules._wait_batch_p2p

    def check(sends: list[tuple[Any, int, str]]) -> None:
        for t, version, what in sends:
            if t._version != version:
                found.append(f"{what} (shape {tuple(t.shape)}) was written in place while its send was in flight "
                             f"(version {version} -> {t._version} before the request was waited)")

    def posting(p2p_ops: list[Any], *a: Any, **kw: Any) -> Any:
        works = post(p2p_ops, *a, **kw)
        if threading.current_thread() is me:
            sends = [(op.tensor, op.tensor._version, labels.get(id(op), f"a tensor sent to rank {op.peer}"))
                     for op in p2p_ops if op.op is dist.isend]
            if sends:
                pending[id(works)] = (works, sends)
        return works

    def waiting(work: Any, *a: Any, **kw: Any) -> Any:
        entry = pending.pop(id(work), None) if threading.current_thread() is me else None
        if entry is not None:
            check(entry[1])
        return wait(work, *a, **kw)

    saved = _label_sends(stages, labels)
    schedules._batch_p2p, schedules._wait_batch_p2p = posting, waiting
    try:
        yield found
        for _, sends in pending.values():  # posted and never waited: compared as the step returns
            check(sends)
    finally:
        schedules._batch_p2p, schedules._wait_batch_p2p = post, wait
        for stage, attr, own in saved:
            # Back to the class's method: an instance attribute holding a bound method of the
            # stage is a reference cycle, and every stage, its buffers and its graph then waited
            # for the cyclic collector (4x the system time on a two-rank schedule).
            if own is None:
                delattr(stage, attr)
            else:
                setattr(stage, attr, own)

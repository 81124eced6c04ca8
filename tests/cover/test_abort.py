"""A failed rank frees its peers at once where /proc cannot show them
blocked (NCCL): the pool aborts the waiting ranks' communicators instead of
waiting out its grace. No GPU here: a gloo pool with the abort switched on,
whose waiting rank stands for one stuck behind a NCCL kernel (it ends only
when its communicators are aborted, as a CUDA sync behind a spinning NCCL
kernel does)."""

from __future__ import annotations

import time


def test_a_failed_rank_frees_its_waiting_peer_by_abort() -> None:
    from harness.workers.pool import ABORT_AFTER, FAILED_PEER_GRACE, WorkerPool

    pool = WorkerPool(2, "gloo")
    pool.abort_peers = True
    try:
        t0 = time.monotonic()
        out = pool.request({"op": "call", "module": "tests.rank_faults", "raise_on": 1, "until_aborted": 60},
                           timeout=120)
        took = time.monotonic() - out.seconds - t0  # the pool's start, not the case
        print(f"\nfailing rank: {out.status} after {out.seconds:.2f}s (grace {FAILED_PEER_GRACE:g}s, start {took:.1f}s)")
        # The answer the abort caused is dropped, as a peer that did not answer in the grace was.
        assert out.status == "timeout" and sorted(out.replies) == [1], (out.status, out.detail)
        assert "injected rank failure" in out.replies[1]["error"]
        assert "freed by aborting their NCCL communicators" in out.detail, out.detail
        assert ABORT_AFTER <= out.seconds < FAILED_PEER_GRACE - 1 and pool.aborts == 1
        assert not pool.procs  # an aborted group is replaced
        # A peer that finishes on its own within ABORT_AFTER keeps its answer, and no abort is sent.
        busy = pool.request({"op": "call", "module": "tests.rank_faults", "raise_on": 1, "busy_s": 0.1}, timeout=120)
        assert busy.status == "ok" and busy.replies[0]["busy"] and "aborted" not in busy.replies[0], busy.detail
        assert pool.aborts == 1 and pool.procs
        ok = pool.request({"op": "call", "module": "tests.rank_faults", "raise_on": None}, timeout=120)
        assert ok.status == "ok" and ok.replies[0]["sum"] == 2.0 and pool.aborts == 1
    finally:
        pool.close()


def test_pipeline_ranks_free_their_p2p_group_after_a_failed_case(monkeypatch) -> None:
    """On NCCL a pipeline rank whose peer failed aborts the case's p2p group,
    which ends its case thread blocked behind an unmatched send or receive:
    the ranks then go on without a restart. No GPU here: the group's abort
    releases a thread that stands for the blocked case thread."""
    import threading
    from types import SimpleNamespace

    import torch

    from harness.paths.pipeline.paths import _freed
    from harness.paths.pipeline.rank import free_p2p
    from harness.workers.pool import Outcome

    released = threading.Event()
    backend = SimpleNamespace(abort=released.set)
    group = SimpleNamespace(_get_backend=lambda device: backend)
    blocked = threading.Thread(target=lambda: released.wait(30), daemon=True)
    blocked.start()
    gpu = SimpleNamespace(device=torch.device("cuda", 0))
    assert free_p2p(gpu, group, blocked) and not blocked.is_alive()
    # gloo needs none of it (its group's timeout ends the thread); nor does GRADFUZZ_NCCL_ABORT=0.
    assert not free_p2p(SimpleNamespace(device=torch.device("cpu")), group, blocked)
    monkeypatch.setenv("GRADFUZZ_NCCL_ABORT", "0")
    assert not free_p2p(gpu, group, blocked)
    # A thread the abort does not free: the ranks are replaced, as before.
    stuck = threading.Thread(target=lambda: threading.Event().wait(5), daemon=True)
    stuck.start()
    monkeypatch.delenv("GRADFUZZ_NCCL_ABORT")
    monkeypatch.setattr("harness.paths.pipeline.rank.ABORT_JOIN_S", 0.2)
    assert not free_p2p(gpu, group, stuck)
    both = {0: {"failure": {"type": "RuntimeError"}, "p2p_freed": True}, 1: {"failure": None, "p2p_freed": True}}
    assert _freed(Outcome("ok", both), 2)
    assert not _freed(Outcome("ok", {0: both[0]}), 2)  # one rank did not answer
    assert not _freed(Outcome("ok", {0: both[0], 1: {"failure": None, "p2p_freed": False}}), 2)
    assert not _freed(Outcome("timeout", both), 2)

"""Where a pool's time goes (``harness.workers.trace``), and the pipeline
probes a process shares with its children on NCCL. No GPU here: a gloo
pool for the trace, a stand-in pool for the probe."""

from __future__ import annotations

import os


def _lines(folder: str) -> list[list[str]]:
    return [line.rstrip("\n").split("\t") for f in sorted(os.listdir(folder))
            for line in open(os.path.join(folder, f))]


def test_the_trace_records_starts_requests_and_failures(tmp_path, monkeypatch) -> None:
    from harness.workers.pool import WorkerPool

    monkeypatch.setenv("GRADFUZZ_POOL_TRACE", str(tmp_path))
    pool = WorkerPool(2, "gloo")
    try:
        assert pool.request({"op": "ping"}, timeout=120).status == "ok"
        pool.request({"op": "call", "module": "tests.rank_faults", "raise_on": 1}, timeout=120)
    finally:
        pool.close()
    events = [(ln[1], ln[3]) for ln in _lines(str(tmp_path))]
    assert events[:3] == [("starting", ""), ("start", ""), ("request", "ping")], events
    failed = [ln for ln in _lines(str(tmp_path)) if ln[1] == "request" and ln[3] == "tests.rank_faults"]
    assert failed and "failed [1]" in failed[0][6], failed
    assert events[-1] == ("close", "")


def test_no_trace_without_its_folder(tmp_path, monkeypatch) -> None:
    from harness.workers import trace

    monkeypatch.delenv("GRADFUZZ_POOL_TRACE", raising=False)
    monkeypatch.chdir(tmp_path)
    trace.record("start", "gloo", seconds=1.0)
    assert not os.listdir(tmp_path)


def test_nccl_probes_reach_child_processes_and_gloo_ones_do_not(monkeypatch) -> None:
    """A probe found on NCCL is written for the children (which would each
    start NCCL groups to find it again); the process that probed keeps its
    own cache, and a child takes the file's result without asking a pool.
    On gloo nothing is written: CPU runs probe as before."""
    import pickle

    from harness.paths.pipeline import paths as pp

    asked: list[dict] = []
    found = {"layouts": {"GPipe": [(2, 2)]}, "placement": {"GPipe": {2: [0, 1]}}, "reasons": {}}

    def ask(world_size, msg, what, timeout, backend=None):
        asked.append(msg)
        return found if msg["what"] == "probe" else {"works": ["X"], "self_send": {}}

    monkeypatch.setattr(pp, "_ask", ask)
    monkeypatch.setattr(pp, "_probed", {})
    monkeypatch.setattr(pp, "_same_rank", {})
    monkeypatch.delenv(pp.SHARED_ENV, raising=False)
    monkeypatch.setattr(pp, "pool_backend", lambda ws: "gloo")
    pp.probe(2)
    assert pp.SHARED_ENV not in os.environ and len(asked) == 1

    monkeypatch.setattr(pp, "_probed", {})
    monkeypatch.setattr(pp, "pool_backend", lambda ws: "nccl")
    assert pp.probe(2, backend="nccl") == found and pp.same_rank_self_send("GPipe", "stock", 2, backend="nccl") is None
    file = os.environ[pp.SHARED_ENV]
    with open(file, "rb") as fh:
        shared = pickle.load(fh)
    assert shared["probe"][(2, "nccl")] == found and shared["same_rank"][(2, "stock", "nccl")]["works"] == ["X"]
    assert pp._inherited("probe", (2, "nccl")) is None  # the process that probed: its own dicts, as before

    # A child: another pid, the same file through its environment, no pool asked.
    monkeypatch.setattr(pp, "_probed", {})
    monkeypatch.setattr(pp, "_same_rank", {})
    monkeypatch.setattr(os, "getpid", lambda: shared["pid"] + 1)
    asked.clear()
    assert pp.probe(2, backend="nccl") == found
    assert pp.same_rank_self_send("GPipe", "stock", 2, backend="nccl") is None and asked == []
    assert pp._inherited("probe", (1, "nccl")) is None  # never probed: the child asks for itself
    pp._remove(file)

"""Processes and files: an erroring rank ends its case in
seconds, findings files follow the umask, and killing or terminating a fuzz
run leaves no process behind (timings printed; run with -s to see them)."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time

import pytest

from harness.artifacts.corpus import atomic_write
from harness.workers.lifeline import alive

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("mask,mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_atomic_write_follows_umask(tmp_path, mask: int, mode: int) -> None:
    old = os.umask(mask)
    try:
        atomic_write(tmp_path / "f.json", "{}\n")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "f.json").st_mode) == mode


def test_failing_rank_ends_the_case_in_seconds() -> None:
    """Rank 1 raises, rank 0 waits in an all_reduce: the pool gives up after
    the grace, not the case timeout, and the next case gets a fresh group."""
    from harness.workers.pool import FAILED_PEER_GRACE, WorkerPool

    pool = WorkerPool(2, "gloo")
    try:
        pool.start()
        t0 = time.monotonic()
        out = pool.request({"op": "call", "module": "tests.rank_faults", "raise_on": 1}, timeout=120)
        took = time.monotonic() - t0
        print(f"\nfailing rank: {out.status} after {took:.1f}s (case timeout 120s)")
        assert out.status == "timeout" and "injected rank failure" in out.replies[1]["error"]
        assert "rank 1 failed" in out.detail
        assert took < FAILED_PEER_GRACE + 10
        if sys.platform.startswith("linux"):  # seen blocked in /proc, well before the grace
            assert "were blocked for good" in out.detail, out.detail
        assert not pool.procs  # closed: the blocked rank is gone
        ok = pool.request({"op": "call", "module": "tests.rank_faults", "raise_on": None}, timeout=120)
        assert ok.status == "ok" and ok.replies[0]["sum"] == 2.0
    finally:
        pool.close()


def test_a_rank_that_leaves_early_ends_the_case_in_seconds() -> None:
    """A rank that stops on its own and says so (``left_early``: DeepSpeed's
    misuse loop reports a raise as the user being told) leaves its peer in a
    collective: the pool lets the peer go as for a raise, not after the case
    timeout (60 s and a restart per such case on deepspeed.zero2.misuse)."""
    from harness.workers.pool import FAILED_PEER_GRACE, WorkerPool

    pool = WorkerPool(2, "gloo")
    try:
        pool.start()
        t0 = time.monotonic()
        out = pool.request({"op": "call", "module": "tests.rank_faults", "leave_on": 1}, timeout=120)
        assert out.status == "timeout" and out.replies[1]["left_early"], (out.status, out.detail)
        assert time.monotonic() - t0 < FAILED_PEER_GRACE + 10
    finally:
        pool.close()


def test_a_peer_that_is_still_computing_is_not_taken_for_blocked() -> None:
    """Rank 1 raises while rank 0 computes for 2 s before answering: the pool
    must not cut rank 0 off as blocked (it answers within the grace)."""
    from harness.workers.pool import WorkerPool

    pool = WorkerPool(2, "gloo")
    try:
        out = pool.request({"op": "call", "module": "tests.rank_faults", "raise_on": 1, "busy_s": 2.0}, timeout=120)
        assert out.replies.get(0) == {"busy": True, "id": out.replies[0]["id"]}, (out.status, out.detail)
    finally:
        pool.close()


def test_a_case_that_breaks_the_gpu_is_blamed_and_the_ranks_replaced(tmp_path, monkeypatch) -> None:
    """A sticky device error after a case (what an illegal memory access
    leaves): that case is a crash naming the error, and the next case runs on
    new ranks instead of failing with the same error. No GPU here, so the
    device check is replaced before the ranks fork: it reports the error while
    a flag file exists."""
    from harness.workers import gpu
    from harness.workers.pool import Outcome, WorkerPool, lost_device

    flag = tmp_path / "lost"
    error = "AcceleratorError: CUDA error: an illegal memory access was encountered"
    monkeypatch.setattr(gpu, "device_error", lambda device: error if flag.exists() else None)
    pool = WorkerPool(2, "gloo", start_method="fork")
    try:
        pool.start()
        before = set(pool.pids)
        flag.touch()
        broke = pool.request({"op": "call", "module": "tests.rank_faults", "raise_on": None}, timeout=60)
        flag.unlink()
        assert broke.status == "crash" and "the GPU is unusable after the case" in broke.detail and error in broke.detail
        assert not pool.procs
        after = pool.request({"op": "call", "module": "tests.rank_faults", "raise_on": None}, timeout=60)
        assert after.status == "ok" and after.replies[0]["sum"] == 2.0 and not before & set(pool.pids)
    finally:
        pool.close()
    # A rank that raised in the case: its raise stays the finding, the ranks are still replaced.
    raised = Outcome("ok", {0: {"failure": {"type": "AcceleratorError"}, "device_lost": error}, 1: {"sum": 2.0}})
    assert lost_device(raised) == (raised, True)
    assert lost_device(Outcome("ok", {0: {"sum": 2.0}, 1: {"sum": 2.0}})) == (Outcome("ok", {0: {"sum": 2.0}, 1: {"sum": 2.0}}), False)


def _children(pid: int) -> list[int]:
    found = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(d))
            except OSError:
                pass
    return found


def _tree(pid: int) -> list[int]:
    todo, seen = [pid], []
    while todo:
        for k in _children(todo.pop()):
            seen.append(k)
            todo.append(k)
    return seen


def _fuzz(tmp_path, paths: str, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "harness", "fuzz", *extra, "--paths", paths, "--minutes", "5", "--db", "none",
           "--progress", "plain", "--save", str(tmp_path / "found"), "--timeout", "60"]
    return subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=dict(os.environ, PYTHONPATH=ROOT))


def _wait_tree(proc: subprocess.Popen, at_least: int, limit: float = 240.0) -> list[int]:
    """The process tree once it has ``at_least`` descendants (pytest, workers, ranks)."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        tree = _tree(proc.pid)
        if len(tree) >= at_least:
            time.sleep(2.0)  # into the fuzzing, not the start-up
            return _tree(proc.pid)
        time.sleep(0.5)
    pytest.fail(f"the run never had {at_least} processes under it")


def _gone_within(pids: list[int], limit: float) -> tuple[float, list[int]]:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        left = [p for p in pids if alive(p)]
        if not left:
            return time.monotonic() - t0, []
        time.sleep(0.1)
    return time.monotonic() - t0, [p for p in pids if alive(p)]


@pytest.mark.slow
def test_sigkill_of_fuzz_n2_leaves_no_workers(tmp_path) -> None:
    """pytest (own session) and its two xdist workers, each with a 2-rank ddp pool: 7 processes."""
    proc = _fuzz(tmp_path, "ddp.fixed", "-n", "2")
    before = _wait_tree(proc, 7)
    proc.kill()
    proc.wait()
    took, left = _gone_within(before, 10.0)
    print(f"\nfuzz -n 2 SIGKILL: {len(before)} processes before, {len(left)} alive after {took:.1f}s")
    assert not left


FAMILIES = [("ddp.fixed", 2), ("fsdp2.fixed", 2), ("dtensor.fixed", 2), ("pipeline.GPipe.ranks2.fixed", 2),
            ("mesh.fsdp_tp.fixed", 4), ("mesh.pp_dp.fixed", 4)]


@pytest.mark.slow
@pytest.mark.parametrize("paths,ranks", FAMILIES)
def test_sigterm_exits_in_seconds(tmp_path, paths: str, ranks: int) -> None:
    proc = _fuzz(tmp_path, paths)
    before = _wait_tree(proc, ranks)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=60)
    took = time.monotonic() - t0
    _, left = _gone_within(before, 5.0)
    print(f"\n{paths} SIGTERM: rc {rc}, {len(before)} ranks before, exit after {took:.1f}s, {len(left)} alive after")
    assert rc == 143 and not left and took < 10


@pytest.mark.slow
@pytest.mark.parametrize("paths,ranks", FAMILIES)
def test_sigkill_leaves_no_ranks(tmp_path, paths: str, ranks: int) -> None:
    proc = _fuzz(tmp_path, paths)
    before = _wait_tree(proc, ranks)
    proc.kill()
    proc.wait()
    took, left = _gone_within(before, 10.0)
    print(f"\n{paths} SIGKILL: {len(before)} ranks before, {len(left)} alive after {took:.1f}s")
    assert not left


def test_repro_scripts_keep_to_loopback(monkeypatch) -> None:
    """The torchrun scripts' preamble: gloo/NCCL on the loopback interface, a
    remote MASTER_ADDR refused, both left alone when the user opts out."""
    from harness.paths import loopback

    space: dict = {"os": os, "sys": sys}
    exec(loopback.SOURCE, space)
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "GRADFUZZ_REPRO_ANY_INTERFACE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    space["_gradfuzz_loopback"]()
    assert os.environ["GLOO_SOCKET_IFNAME"].startswith("lo")
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    with pytest.raises(SystemExit, match="not loopback"):
        space["_gradfuzz_loopback"]()
    monkeypatch.setenv("GRADFUZZ_REPRO_ANY_INTERFACE", "1")
    space["_gradfuzz_loopback"]()
    assert "127.0.0.1" in loopback.RUN


@pytest.mark.parametrize("gpus,world,worker,first", [
    (0, 2, "gw3", 0), (2, 2, "gw3", 0), (4, 2, "gw0", 0), (4, 2, "gw1", 2), (4, 2, "gw2", 0), (4, 4, "gw1", 0),
    (8, 2, "gw7", 6), (4, 2, "", 0), (4, 2, "gw\u0663", 0), (3, 2, "gw1", 0)])
def test_groups_of_xdist_workers_spread_over_the_gpus(monkeypatch, gpus, world, worker, first) -> None:
    """Rank 0 of a harness-started NCCL group sits on a block of ``world``
    GPUs chosen by the xdist worker, so -n N does not stack every group on
    GPUs 0 and 1; each rank of one group still gets its own GPU."""
    import torch

    from harness.workers.placement import first_gpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    got = first_gpu(world)
    assert got == first and got + world <= max(gpus, world)


@pytest.mark.parametrize("slot,first", [("0", 0), ("1", 2), ("3", 2), ("", 0), ("x1", 0), ("\u0661", 0)])
def test_groups_of_gate_children_spread_over_the_gpus(monkeypatch, slot, first) -> None:
    """The gate's replay and canary children are not xdist workers: their
    slot (``jobs.SLOT_ENV``) picks the block of GPUs instead."""
    import torch

    from harness.workers.placement import first_gpu
    from harness.workers.jobs import SLOT_ENV

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.setenv(SLOT_ENV, slot)
    assert first_gpu(2) == first


def test_each_running_child_has_its_own_slot(tmp_path) -> None:
    """Slots are 0 to N-1 among the children running at once, reused as they end."""
    import json

    from harness.workers.jobs import run_jobs

    jobs = [(f"j{i}", ["tests.child_probe", "0.3"]) for i in range(5)]
    ended = []
    run_jobs(jobs, 2, str(tmp_path), ended.append)
    slots = {e.key: json.loads(open(e.log).readline())["slot"] for e in ended}
    assert sorted(set(slots.values())) == ["0", "1"], slots
    assert slots["j0"] != slots["j1"]


@pytest.mark.parametrize("visible,slot,want", [(None, "1", "1"), (None, "6", "2"), ("4,5,6,7", "3", "7"),
                                               ("GPU-a,GPU-b,GPU-c,GPU-d", "0", "GPU-a")])
def test_one_process_workers_see_only_their_blocks_gpu(monkeypatch, visible, slot, want) -> None:
    """A compile or graphed flavour's child sees one GPU, its process's
    block's: their CUDA contexts all sat on GPU 0 (62.3 GB)."""
    import torch

    from harness.workers.jobs import SLOT_ENV
    from harness.workers.placement import one_gpu_env

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.setenv(SLOT_ENV, slot)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert one_gpu_env() == {"CUDA_VISIBLE_DEVICES": want}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert one_gpu_env() == {}


def test_the_worker_pipe_sends_tensors_as_torch_pickles_them():
    """``isolation.dumps`` sends a storage as its bytes: every tensor comes back
    with the same dtype, shape, strides, offset, class, requires_grad and bits."""
    import pickle

    import torch

    from harness.observation import Observation, Step
    from harness.workers.wire import dumps

    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    tensors = [base, base.t(), base[1:, 2:5], torch.tensor([float("nan"), -0.0, float("inf")]),
               torch.zeros(0, 3), torch.tensor([True, False]), torch.arange(5, dtype=torch.int64)[::2],
               torch.randn(3, 2, dtype=torch.bfloat16), torch.randn(2, dtype=torch.complex64),
               torch.randn(2, 3, dtype=torch.float64).requires_grad_(), torch.nn.Parameter(torch.randn(3)),
               torch.tensor(2.5)]
    obs = Observation(path="p", steps=[Step(0, {f"t{i}": t for i, t in enumerate(tensors)}, {}, tensors[:3])])
    assert b"_load_from_bytes" in pickle.dumps(obs) and b"_load_from_bytes" not in dumps(obs)  # torch.save per storage: not here

    def bits(t):
        return t.detach().reshape(-1).contiguous().view(torch.uint8)

    ours, theirs = pickle.loads(dumps(("obs", obs, True))), pickle.loads(pickle.dumps(("obs", obs, True)))
    for got, want in ((ours[1].steps[0].grads, obs.steps[0].grads), (ours[1].steps[0].grads, theirs[1].steps[0].grads)):
        for name, t in want.items():
            g = got[name]
            assert (type(g), g.dtype, g.shape, g.stride(), g.storage_offset(), g.requires_grad) == \
                   (type(t), t.dtype, t.shape, t.stride(), t.storage_offset(), t.requires_grad), name
            assert torch.equal(bits(g), bits(t)), name

"""Data-parallel paths, long runs: the fixed references over many examples at
world sizes 2 and 3, both canaries from a cold start on five seeds, and no
rank process outliving a SIGKILLed harness."""

import os
import signal
import subprocess
import sys
import time

import pytest

from harness.canaries import all_canaries
from harness.engine.result import Result
from harness.engine.runner import fuzz_path
from harness.gate.selfcheck import run_canary
from harness.paths import Options, close_paths, resolve

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("name", ["ddp_reduces_tied_twice", "fsdp2_drops_last_shard_padding"])
@pytest.mark.parametrize("seed", range(5))
def test_canary_is_caught_from_cold_start(name, seed, capsys):
    canary = next(c for c in all_canaries() if c.name == name)
    r = run_canary(canary, seed=seed)
    with capsys.disabled():
        print(f"\n{name} seed {seed}: caught={r.caught} after {r.examples} examples ({r.seconds:.1f}s)")
    assert r.caught, r.detail


@pytest.mark.parametrize("world, examples", [(2, 1000), (3, 300)])
@pytest.mark.parametrize("name", ["ddp.fixed", "fsdp2.fixed"])
def test_fixed_is_clean(name, world, examples, capsys):
    path = resolve(name, Options(world_size=world))[0]
    result = Result()
    try:
        fuzz_path(path, examples=examples, deadline=None, seed=21, result=result, save_dir=None)
    finally:
        close_paths([path])
    stats = result.paths.get(name)
    with capsys.disabled():
        print(f"\n{name} world size {world}: {stats}")
    assert not result.divergences, result.divergences[0].detail
    assert not result.errors, result.errors
    assert stats is not None and stats.run >= examples // 2, "most examples must run, not fall outside the contract"


def _children(pid: int) -> set[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return {int(p) for p in out.split()}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def test_no_rank_outlives_a_sigkilled_harness():
    proc = subprocess.Popen([sys.executable, "-m", "harness", "fuzz", "--paths", "ddp.fixed,fsdp2.fixed",
                             "--minutes", "2", "--db", "none", "--world-size", "3"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while time.time() < deadline and len(_children(proc.pid)) < 3:
        time.sleep(0.5)
    ranks = _children(proc.pid)
    assert len(ranks) >= 3, "the pool never started its three ranks"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 10
    while time.time() < deadline and any(_alive(p) for p in ranks):
        time.sleep(0.2)
    assert not any(_alive(p) for p in ranks), f"rank processes {sorted(p for p in ranks if _alive(p))} outlived the harness"

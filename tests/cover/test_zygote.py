"""Warm starts (``harness.workers.zygote``): a child forked from the zygote
is the fresh interpreter it replaces in everything the harness reads of it:
argv, working directory, environment, streams, exit status, a signal's
death, and an import path without the working directory. Where it cannot
be one (an import-time variable differs, warm starts are off) the child is
a fresh interpreter."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from harness.workers import zygote
from harness.workers.lifeline import alive

pytestmark = pytest.mark.skipif(not zygote.enabled(), reason="warm starts need Linux (fork and SCM_RIGHTS)")


def _probe(*args: str, env: dict[str, str] | None = None, stdin: bytes = b"") -> tuple[object, dict, bytes, int]:
    p = zygote.start("tests.child_probe", list(args), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE, env=env)
    p.stdin.write(stdin)
    p.stdin.close()
    line = p.stdout.readline()
    rc = p.wait(timeout=60)
    err = p.stderr.read() if p.stderr is not None else b""
    return p, json.loads(line), err, rc


def test_a_warm_child_sees_its_own_argv_directory_environment_and_streams(tmp_path, monkeypatch) -> None:
    (tmp_path / "torch.py").write_text("raise SystemExit('the working directory was imported from')\n")
    (tmp_path / "sitecustomize.py").write_text("raise SystemExit('the working directory was imported from')\n")
    monkeypatch.chdir(tmp_path)
    p, seen, err, rc = _probe("0", "3", env={**os.environ, "GRADFUZZ_PROBE": "one"}, stdin=b"hello")
    assert isinstance(p, zygote.Child), "not forked from the zygote"
    assert rc == 3 and seen["argv"] == ["0", "3"] and seen["cwd"] == str(tmp_path)
    assert seen["probe"] == "one" and seen["stdin"] == "hello" and b"probe stderr" in err
    assert "" not in seen["path"] and str(tmp_path) not in seen["path"]
    assert seen["path"] == [p for p in sys.path if p and os.path.isabs(p)]
    assert seen["modules"], "torch was not preloaded in the warm child"
    _, again, _, _ = _probe(env={**os.environ, "GRADFUZZ_PROBE": "two"})
    assert again["probe"] == "two" and again["pid"] != seen["pid"]


def test_a_signal_reads_as_for_a_fresh_interpreter() -> None:
    p, _, _, rc = _probe("0", "segv")
    assert isinstance(p, zygote.Child) and rc == -signal.SIGSEGV


def test_kill_and_poll() -> None:
    p = zygote.start("tests.child_probe", ["30"], stdout=subprocess.DEVNULL)
    assert isinstance(p, zygote.Child) and p.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(timeout=0.2)
    p.kill()
    assert p.wait(timeout=10) == -signal.SIGKILL and not alive(p.pid)


def test_an_import_time_variable_or_the_switch_gives_a_fresh_interpreter(monkeypatch) -> None:
    p, seen, _, rc = _probe(env={**os.environ, "TORCH_LOGS": "-dynamo"})
    assert isinstance(p, subprocess.Popen) and rc == 0 and not seen["modules"]
    monkeypatch.setenv(zygote.ENV, "0")
    p, _, _, rc = _probe()
    assert isinstance(p, subprocess.Popen) and rc == 0


def test_the_children_end_with_the_zygote_and_the_next_start_makes_a_new_one() -> None:
    z = zygote.shared()
    p = zygote.start("tests.child_probe", ["60"], stdout=subprocess.DEVNULL)
    assert isinstance(p, zygote.Child)
    z.proc.kill()
    assert p.wait(timeout=20) == -signal.SIGKILL
    end = time.monotonic() + 10
    while alive(p.pid) and time.monotonic() < end:
        time.sleep(0.05)
    assert not alive(p.pid)
    q, _, _, rc = _probe()
    assert isinstance(q, zygote.Child) and rc == 0 and zygote.shared() is not z


def test_a_killed_parent_leaves_no_zygote_and_no_child(tmp_path) -> None:
    code = ("import subprocess, sys, time; from harness.workers import zygote; "
            "p = zygote.start('tests.child_probe', ['120'], stdout=subprocess.DEVNULL); "
            "print(zygote.shared().proc.pid, p.pid, flush=True); time.sleep(120)")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, cwd=os.getcwd(),
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)})
    pids = [int(x) for x in parent.stdout.readline().split()]
    assert len(pids) == 2 and all(alive(p) for p in pids)
    parent.kill()
    parent.wait()
    end = time.monotonic() + 20
    while any(alive(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids)


def test_a_zygote_that_refused_is_not_started_again(monkeypatch) -> None:
    """A zygote that said it cannot fork safely (a CUDA build that poisoned
    forks, a thread) is not replaced by another that would pay the same
    imports to refuse again: every child is then a fresh interpreter."""
    monkeypatch.setattr(zygote, "_shared", None)
    z = zygote.shared()
    assert z.usable(dict(os.environ))
    z.close()  # what a refusal leaves: gone, its answer "not ready"
    z.ready = False
    assert zygote.shared() is z
    p, _, _, rc = _probe()
    assert isinstance(p, subprocess.Popen) and rc == 0


def test_a_compile_child_runs_one_intra_op_thread(monkeypatch) -> None:
    """An isolated path's child gets one intra-op thread, as the fuzz workers
    have: with torch's default (one per core) 48 compile children of a
    16-worker gate each spun 16 OpenMP threads on a 16-core host."""
    from harness.workers import isolation
    from harness.workers.interpreter import one_thread_env

    monkeypatch.delenv("GRADFUZZ_KEEP_THREADS", raising=False)
    _, seen, _, _ = _probe(env={**os.environ, **one_thread_env()})
    assert seen["threads"] == 1
    if (os.cpu_count() or 1) > 1 and "OMP_NUM_THREADS" not in os.environ:
        _, default, _, _ = _probe(env=dict(os.environ))
        assert default["threads"] > 1  # the probe sees what the child was given, not a constant
    envs = []
    start = isolation.zygote.start
    monkeypatch.setattr(isolation.zygote, "start", lambda *a, **kw: envs.append(kw["env"]) or start(*a, **kw))
    from tests.standins import isolated

    worker = isolated("standin.fixed", "tests.standins:fixed")
    try:
        worker.start_soon()
    finally:
        worker.close()
    assert envs and envs[0].get("OMP_NUM_THREADS") == "1"

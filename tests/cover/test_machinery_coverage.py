"""``gradfuzz fuzz --coverage``: the restricted tracer, the summary, guidance.

The tracer must see a known line of a machinery file and nothing outside
the family's files; the summary must show the coverage; ``guide`` must hand
every drawn example's new lines to Hypothesis, and two fresh processes on the
same seed and budget must give the same verdict, counts and coverage.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.utils.checkpoint as tc

from harness import machinery_coverage as mc
from harness.engine import coverage as engine_coverage

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _line_of(fn, text: str) -> int:
    """The line number of the first line of ``fn``'s source that starts with ``text``."""
    src, first = inspect.getsourcelines(fn)
    return first + next(i for i, ln in enumerate(src) if ln.strip().startswith(text))


def _run_checkpoint() -> None:
    w = torch.randn(3, 3, requires_grad=True)
    y = tc.checkpoint(lambda a: (a @ w).relu(), torch.randn(2, 3), use_reentrant=False)
    y.sum().backward()


def test_the_tracer_counts_a_known_line_of_checkpoint_and_no_line_outside_the_family():
    m = mc.Machinery.of("checkpoint")
    assert tc.__file__ in m.files and m.total > 100
    known = _line_of(tc.checkpoint, "if use_reentrant is None")
    assert known in m.files[tc.__file__]  # a reachable line, so it counts towards "of M"
    tracer = mc.Tracer(m.files)
    before = sys.gettrace()
    with tracer:
        _run_checkpoint()
    assert sys.gettrace() is before  # whatever traced before (a debugger, coverage.py) is put back
    lines, arcs = tracer.take()
    assert (tc.__file__, known) in lines
    assert {f for f, _ in lines} <= set(m.files)  # torch.nn.functional, the harness, this test: not traced
    assert all(ln in m.files[f] for f, ln in lines)
    assert any(a[0] == tc.__file__ and a[2] == known for a in arcs)
    assert tracer.take() == (set(), set())


def test_a_meter_counts_new_lines_once_and_takes_a_worker_processes_lines_out_of_the_observation():
    meter = mc.Meter()
    meter.measure("checkpoint", _run_checkpoint)
    new, reached = meter.example_done()
    assert new == reached > 0
    meter.measure("checkpoint", _run_checkpoint)
    assert meter.example_done() == (0, reached)  # the same case again: nothing new

    class Obs:  # what a worker process sends back (harness.workers.isolation): lines in ``extra``
        extra: dict = {}

    obs = Obs()
    far = _line_of(tc.checkpoint_sequential, "if use_reentrant is None")
    obs.extra = {mc.EXTRA_KEY: ([(tc.__file__, far), ("/elsewhere.py", 1)], [(tc.__file__, -1, far)])}
    assert meter.measure("checkpoint", lambda: obs) is obs
    assert mc.EXTRA_KEY not in obs.extra  # nothing downstream sees it
    assert meter.example_done()[0] == 1  # the family's own file only
    fc = meter.families["checkpoint"]
    assert (tc.__file__, far) in fc.lines and ("/elsewhere.py", 1) not in fc.lines
    again = mc.combine([meter.to_json(), meter.to_json()])["checkpoint"]
    assert again.lines == fc.lines and again.arcs == fc.arcs
    assert re.fullmatch(r"machinery coverage \[checkpoint\]: \d+ lines of \d+ in 2 files \(\d+\.\d%\), \d+ arcs, "
                        r"6 traced run\(s\)", again.line())


def test_every_built_in_family_maps_to_machinery_and_paths_to_their_family():
    assert engine_coverage.machinery_family("ddp.stock") == "parallel"
    assert engine_coverage.machinery_family("fsdp2.fixed") == "parallel"
    assert engine_coverage.machinery_family("compile.aot_eager") == "compile"
    assert engine_coverage.machinery_family("pipeline.1F1B.ranks2.stock") == "pipeline"
    for family in ("eager", "split", "checkpoint", "compile", "pipeline", "dtensor", "parallel", "mesh"):
        assert engine_coverage.machinery_of(family).files, family


def _fuzz(tmp_path, *extra: str, name: str = "r.json") -> tuple[subprocess.CompletedProcess, dict]:
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop(mc.ENV, None)
    r = subprocess.run([sys.executable, "-m", "harness", "fuzz", "--paths", "checkpoint.nonreentrant.stock",
                        "--examples", "20", "--seed", "5", "--db", "none", "--save", str(tmp_path / "found"),
                        "--progress", "none", "--json", str(tmp_path / name), *extra],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode in (0, 1), r.stdout + r.stderr
    return r, json.loads((tmp_path / name).read_text())


def test_the_summary_and_the_json_show_machinery_coverage_only_when_asked(tmp_path):
    r, data = _fuzz(tmp_path, "--coverage")
    m = re.search(r"machinery coverage \[checkpoint\]: (\d+) lines of (\d+) in 2 files", r.stdout)
    assert m, r.stdout
    assert 0 < int(m.group(1)) < int(m.group(2))
    assert data["coverage"]["checkpoint"]["lines"] == int(m.group(1))
    assert data["coverage"]["checkpoint"]["traced_runs"] == 20
    reached = data["coverage"]["checkpoint"]["reached"]
    assert sum(len(v) for v in reached.values()) == int(m.group(1)) and tc.__file__ in reached
    plain, plain_data = _fuzz(tmp_path, name="plain.json")
    assert "machinery coverage" not in plain.stdout and plain_data["coverage"] is None
    # tracing changes no draw: the same examples and findings
    assert {k: (v["examples"], v["run"]) for k, v in plain_data["paths"].items()} == \
        {k: (v["examples"], v["run"]) for k, v in data["paths"].items()}
    assert plain_data["counts"] == data["counts"]


def test_guided_fuzzing_gives_the_same_verdict_counts_and_coverage_in_two_fresh_processes(tmp_path):
    (r1, a), (r2, b) = _fuzz(tmp_path, "--coverage", "guide", name="a.json"), _fuzz(tmp_path, "--coverage", "guide",
                                                                                 name="b.json")
    assert r1.returncode == r2.returncode
    for key in ("counts", "coverage", "paths"):
        if key == "paths":
            a[key] = {k: {x: y for x, y in v.items() if "seconds" not in x} for k, v in a[key].items()}
            b[key] = {k: {x: y for x, y in v.items() if "seconds" not in x} for k, v in b[key].items()}
        assert a[key] == b[key], key


def test_guide_hands_every_drawn_example_to_hypothesis_target_and_measure_none(monkeypatch):
    from harness.engine import target as target_mod
    from harness.engine.session import Session, fuzz
    from harness.paths import resolve

    calls: list[tuple[float, str]] = []
    monkeypatch.setattr(target_mod, "target", lambda score, label: calls.append((score, label)))
    monkeypatch.delenv(mc.ENV, raising=False)
    paths = resolve("checkpoint.nonreentrant.stock")
    for mode, expect in (("measure", 0), ("guide", 12)):
        calls.clear()
        s = fuzz(paths, examples=12, seed=2, session=Session(save_dir=None, coverage=mode))
        assert len(calls) == expect, mode
        assert s.meter is not None and s.meter.families["checkpoint"].examples == 12
    assert {label for _, label in calls} == {engine_coverage.GUIDE_LABEL}
    assert calls[0][0] > 0  # the first example reaches lines no earlier one did
    monkeypatch.delenv(mc.ENV, raising=False)  # the session asked worker processes to trace


def test_a_bad_coverage_mode_is_refused():
    from harness.engine.session import Session

    with pytest.raises(ValueError):
        Session(save_dir=None, coverage="lines")


def test_a_ranks_lines_come_back_with_its_reply_and_count_for_the_run_that_sent_the_request():
    meter = mc.Meter()
    stale = {mc.EXTRA_KEY: ([(tc.__file__, 1)], [])}
    mc.deposit(stale)  # a request outside any measured run (a probe): not the next run's
    known = _line_of(tc.checkpoint, "if use_reentrant is None")

    def run():
        reply = {"grads": 1, mc.EXTRA_KEY: ([(tc.__file__, known)], [(tc.__file__, -1, known)])}
        mc.deposit(reply)  # what WorkerPool.request does with every rank's reply
        assert reply == {"grads": 1}  # the family's code never sees the lines
        return reply

    meter.measure("checkpoint", run)
    assert meter.families["checkpoint"].lines == {(tc.__file__, known)}


def test_pipeline_ranks_trace_in_their_own_process(monkeypatch):
    from harness.engine.session import Session, fuzz
    from harness.paths import close_paths, resolve
    from harness.workers import pool

    monkeypatch.delenv(mc.ENV, raising=False)
    s = Session(save_dir=None, coverage="measure")  # before the pool starts: its ranks inherit the request
    for g in list(pool.groups.values()):
        g.close()  # a pool an earlier test started does not trace; the next request starts a fresh one
    paths = resolve("pipeline.GPipe.stock")
    try:
        fuzz(paths, examples=3, seed=1, session=s)
    finally:
        close_paths(paths)
        for g in list(pool.groups.values()):
            g.close()  # nor should the next test get this tracing pool
    fc = s.meter.families["pipeline"]
    assert fc.examples == 3
    assert any(f.endswith(os.path.join("pipelining", "schedules.py")) for f, _ in fc.lines), sorted(fc.lines)[:5]

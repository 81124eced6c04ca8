"""The live display and the plain lines, from a view (no fuzzing needed)."""

import io
import os
import re
import time

import pytest

from rich.console import Console

from harness.cli.progress import Display, plain_line, render

NOW = time.time()
VIEW = {
    "now": NOW, "started": NOW - 30, "deadline": NOW + 90, "examples_budget": None, "workers": 2,
    "paths": {"split.stock": {"examples": 3000, "run": 1800, "skipped": {"no stage input requires grad": 1200},
                              "seconds": 30.0},
              "split.fixed": {"examples": 3000, "run": 3000, "skipped": {}, "seconds": 30.0}},
    "unavailable": {"graphed.stock": "needs CUDA"},
    "counts": {"split.stock-value-9a39c5b0a8": 3},
    "details": {"split.stock-value-9a39c5b0a8": {"path": "split.stock", "kind": "value", "examples": 87,
                                                 "detail": "w0 after backward 0: ratio actual/expected 2"}},
    "saved": ["cases/found/split.stock-value-9a39c5b0a8.json"], "errors": [],
}


def test_live_display_shows_rates_signatures_and_time_left():
    console = Console(file=io.StringIO(), width=150, record=True)
    console.print(render(dict(VIEW)))
    text = console.export_text()
    assert "01:30 left" in text
    assert "split.stock-value-9a39c5b0a8" in text and "87 ex" in text and "ratio actual/expected 2" in text
    assert "unavailable: needs CUDA" in text and "2 worker(s)" in text
    assert "100" in text  # 3000 examples in 30 s


def test_plain_lines_when_stdout_is_not_a_terminal():
    line = plain_line(dict(VIEW), width=200)
    assert line.startswith("gradfuzz [fuzz 00:30, 01:30 left, 2 workers] 6000 examples (200/s); 3 finds, 1 distinct")
    assert "slowest: split.fixed 3000 (100/s), split.stock 3000 (100/s)" in line
    out = io.StringIO()
    d = Display(lambda: dict(VIEW, from_status=True, now=None), mode="auto", every=0.2, stream=out)
    assert d.mode == "plain"  # a StringIO is not a terminal
    d.start()
    time.sleep(0.6)
    d.close()
    text = out.getvalue()
    assert "gradfuzz: [split.stock] divergence split.stock-value-9a39c5b0a8" in text
    assert text.count("gradfuzz [") >= 2


def test_an_eta_is_shown_only_once_the_total_is_fixed_and_a_fifth_of_it_is_done():
    from harness.cli.progress import ETA_AFTER, eta

    assert eta(1, 21, 0.4) is None  # the first canary: its 0.4 s says nothing of a 4.6 s compile to come
    assert eta(5, 20, 10.0) == 30.0
    assert eta(5, 20, 10.0, fixed=False) is None  # a total still growing as workers reach targets
    assert eta(20, 20, 10.0) is None and eta(0, 20, 10.0) is None  # nothing left, or nothing to go on
    assert ETA_AFTER * 20 <= 5


def test_the_fuzz_eta_waits_for_the_slowest_target_not_the_pooled_rate():
    """Four fast targets done at 1 s an example, one compile flavour at 20 s
    and 2 of its 10 done: the pooled rate (42 done in 60 s) says 11 s left;
    the flavour alone has 160 s of its own to run."""
    from harness.cli.progress import eta, fuzz_left

    paths = {f"fast{i}": {"examples": 10, "seconds": 10.0, "per_example": 1} for i in range(4)}
    paths["compile"] = {"examples": 2, "seconds": 40.0, "per_example": 1}
    view = {"examples_budget": 10, "paths": paths, "workers": 4}
    assert round(eta(42, 50, 60.0)) == 11
    assert fuzz_left(view, 42, 50, 60.0) == 160.0
    view["paths"] = {n: t for n, t in paths.items() if n != "compile"}  # the flavour not started yet
    # Its 10 examples at the others' median rate on 4 workers would say 2.5 s: never less than the pooled rate's.
    assert fuzz_left(view, 40, 50, 60.0) == eta(40, 50, 60.0) == 15.0
    assert fuzz_left(view, 2, 50, 60.0) is None  # eta's gates hold: too little done to say


def test_with_the_last_run_s_seconds_the_eta_counts_work_in_them():
    """The last run of the plan: fast targets 10 s each, the compile flavour
    200 s (it shrank a finding). Now the fast ones ended in 12 s each (this
    machine is 1.2x slower) and the flavour is 40 s in: 80 of 240 history
    seconds done in 60 s of wall time, and the flavour's own 160 s remainder
    at 1.2x is the longer wait."""
    from harness.cli.progress import fuzz_left

    history = {**{f"fast{i}": 10.0 for i in range(4)}, "compile": 200.0}
    paths = {f"fast{i}": {"examples": 10, "seconds": 12.0, "finished": 1} for i in range(4)}
    paths["compile"] = {"examples": 2, "seconds": 40.0, "finished": 0}
    view = {"examples_budget": 10, "paths": paths, "workers": 4, "history": history}
    assert fuzz_left(view, 42, 50, 60.0) == 160.0 * 1.2
    paths["compile"]["seconds"] = 5.0  # 45 of 240 done: under a fifth, nothing to say yet
    assert fuzz_left(view, 42, 50, 60.0) is None
    paths["compile"] = {"examples": 10, "seconds": 150.0, "finished": 1}  # it ended early: all of it done
    assert fuzz_left(view, 50, 50, 200.0) is None


def test_the_last_run_s_seconds_round_trip_and_a_bad_file_is_named(tmp_path):
    from harness.artifacts import timings
    from harness.case.schema import FileError

    key = timings.plan_key("split,eager", 20, 0, "2.13.0+cpu")
    assert key == timings.plan_key("split,eager", 20, 0, "2.13.0") != timings.plan_key("split,eager", 20, 1, "2.13.0")
    assert timings.load(key, str(tmp_path)) == {}
    timings.save(key, {"split.fixed": 12.345, "eager.accumulate": 3.0}, str(tmp_path))
    assert timings.load(key, str(tmp_path)) == {"split.fixed": 12.35, "eager.accumulate": 3.0}
    for bad, words in (('{"paths": {"split.fixed": -1}}', "paths['split.fixed']"), ("[1]", "a JSON object"),
                       ('{"paths": {}, "x": 1}', "x")):
        (tmp_path / f"{key}.json").write_text(bad)
        with pytest.raises(FileError, match=re.escape(words)):
            timings.load(key, str(tmp_path))


def test_phase_lines_drop_the_emitters_estimates_and_show_one_only_when_it_holds():
    from harness.cli.progress import PhaseLines

    t = [0.0]
    lines = PhaseLines(width=None, clock=lambda: t[0])
    shown = []
    for step, text in [(1, "[selfcheck 1/21] a: caught"), (5, "[selfcheck 5/21] b: caught"),
                       (10, "[selfcheck 10/21] c: caught"), (11, "[selfcheck 21/21] d: caught"),
                       (20, "[phase] replay 632/5568 (case, path) pairs on 2 processes, ~45s left"),
                       (60, "[phase] replay 2000/5568 (case, path) pairs on 2 processes, ~12s left"),
                       (80, "[phase] replay 3000/5568 (case, path) pairs on 2 processes"),
                       (82, "[phase] replay 5111/5568 (case, path) pairs on 2 processes"),
                       (83, "[phase] replay 1/105 corpus cases on 2 paths, ~0s left"),
                       (83, "[phase] replay 105/105 corpus cases on 2 paths, ~0s left")]:
        t[0] = float(step)
        shown.append(lines.line(text))
    assert shown[0] == "[selfcheck 1/21] a: caught"  # too early for an estimate
    assert shown[1] == "[selfcheck 5/21] b: caught"  # a first estimate: nothing to hold it against
    assert shown[2] == "[selfcheck 10/21, ~00:11 left] c: caught"  # the same end as the one before
    assert shown[4] == "[phase] replay 632/5568 (case, path) pairs on 2 processes"  # its own ~45s dropped
    assert shown[5] == "[phase] replay 2000/5568 (case, path) pairs on 2 processes"
    assert shown[6] == "[phase] replay 3000/5568, ~00:51 left (case, path) pairs on 2 processes"
    assert shown[7] == "[phase] replay 5111/5568 (case, path) pairs on 2 processes"  # a jump: no ETA it belies
    assert shown[8:] == ["[phase] replay 1/105 corpus cases on 2 paths",  # a new total: a new count, no carried ETA
                         "[phase] replay 105/105 corpus cases on 2 paths"]  # done: no "~0s left"
    assert not any("~0s" in s or "00:00 left" in s for s in shown)


def test_the_replay_pool_s_count_gets_no_pace_based_eta():
    """The pool's pairs differ a thousandfold in cost, heaviest first: its
    line says how many ran and how many units wait, and at a steady pace
    that would give any D/N count an ETA, it gets none."""
    from harness.cli.progress import PhaseLines
    from harness.engine.replay_pool import tick_line

    t = [0.0]
    lines = PhaseLines(width=None, clock=lambda: t[0])
    paced = PhaseLines(width=None, clock=lambda: t[0])
    lines.line("[selfcheck 22/22] func_drops_microbatch: caught")
    for k in range(1, 8):
        t[0] = 10.0 * k
        ours = lines.line(tick_line(600 * k, 4834, 2, 34 - 4 * k, 34))
        assert "left" not in ours and ours.startswith(f"[phase] replay: {600 * k} of 4834"), ours  # no stale phase
        last = paced.line(f"[phase] replay {600 * k}/4834 (case, path) pairs")
    assert "left" in last  # the same pace as a D/N count: an ETA, which the pool's line must not get


def test_the_fuzz_line_counts_against_a_total_known_in_advance_and_never_reads_0_per_second():
    view = {"now": 100.0, "started": 40.0, "examples_budget": 20, "planned": 2960, "workers": 2,
            "paths": {}, "counts": {}, "details": {}}
    line = plain_line(view, None)
    assert "0/2960 examples (none finished yet)" in line and "0/s" not in line and "left" not in line
    view["paths"] = {"split.stock": {"examples": 640, "per_example": 1}}
    assert "640/2960 examples (11/s)" in plain_line(view, None)  # the total does not grow to what workers met
    assert "left" in plain_line(view, None)  # a fixed total, over a fifth done
    from harness.cli.progress import Steady

    steady = Steady()
    assert "left" not in plain_line(view, None, steady)  # a display's first estimate is held back
    view.update(now=130.0, paths={"split.stock": {"examples": 960, "per_example": 1}})
    assert "03:07 left" in plain_line(view, None, steady)  # the same rate: the same end, shown


def test_the_planned_total_is_the_budget_over_every_targets_paths_and_variants():
    from harness.cli.fuzz import planned
    from harness.engine.session import plan
    from harness.paths import resolve

    live = [p for p in resolve("split.fixed,eager,split.stock") if p.availability().ok]
    targets = plan(live, exact=None, seed=0, examples=5)
    assert planned(live, 5) == sum(5 * t.variants * len(t.paths) for t in targets) >= 5 * len(live)
    assert planned(live, None) is None and planned([], 5) is None  # a time budget ends at its deadline


def test_the_closing_fuzz_line_gives_no_eta():
    view = {"now": 130.0, "started": 40.0, "examples_budget": 20, "planned": 2960, "workers": 2,
            "paths": {"split.stock": {"examples": 2900, "per_example": 1}}, "counts": {}, "details": {}}
    assert "left" in plain_line(view, None)  # an estimate a running display could show
    out = io.StringIO()
    d = Display(lambda: dict(view), mode="plain", every=3600, stream=out).start()
    d.close()
    last = out.getvalue().splitlines()[-1]
    assert last.startswith("gradfuzz [fuzz 01:30, 2 workers] 2900/2960 examples") and "left" not in last


def test_instant_skipped_steps_give_no_eta():
    """The gate's self-check on 2 workers reports its 8 skipped canaries
    within 3 s, then takes 20 s over the 13 that run."""
    from harness.cli.progress import PhaseLines

    t = [0.0]
    lines = PhaseLines(width=None, clock=lambda: t[0])
    shown = []
    for i in range(1, 9):
        t[0] = 3.0
        shown.append(lines.line(f"[selfcheck {i}/21] c{i}: skipped (unavailable here: needs CUDA)"))
    assert not any("left" in s for s in shown)


def test_a_plan_never_run_here_reads_the_seconds_gradfuzz_ships(tmp_path, monkeypatch):
    """A fresh checkout (CI) has no history of its own: the README gate's
    plan then reads the seconds shipped in the package, and this machine's
    own last run, once there is one, wins."""
    from harness.artifacts import timings

    here, ref = str(tmp_path / "here"), str(tmp_path / "ref")
    monkeypatch.setattr(timings, "REFERENCE_DIR", ref)
    key = timings.plan_key("split.fixed,eager.accumulate", 20, 0, "2.13.0")
    assert timings.load_or_reference(key, here) == {}
    timings.save(key, {"split.fixed": 3.0}, ref)
    assert timings.load_or_reference(key, here) == {"split.fixed": 3.0}
    timings.save(key, {"split.fixed": 5.0}, here)
    assert timings.load_or_reference(key, here) == {"split.fixed": 5.0}


def test_the_shipped_seconds_are_the_readme_gate_s_plan_here():
    """Every shipped file loads as any timings file does; on the torch and
    paths of the README's CI (2.13, no training stack installed) the
    README gate's plan is among them."""
    import torch

    from harness.artifacts import timings
    from harness.paths import resolve, split_available

    shipped = [f[:-5] for f in os.listdir(timings.REFERENCE_DIR) if f.endswith(".json")]
    assert shipped and all(timings.load(k, timings.REFERENCE_DIR) for k in shipped)
    live, _ = split_available(resolve(None))
    if torch.__version__.split("+")[0] != "2.13.0" or any(p.name.startswith(("deepspeed", "megatron", "torchtitan"))
                                                            for p in live):
        pytest.skip("not the README's CI setting")
    key = timings.plan_key(",".join(p.name for p in live), 20, 0, torch.__version__)
    assert key in shipped, "the README gate's plan has no shipped seconds: copy .gradfuzz/timings/<key>.json of a run"

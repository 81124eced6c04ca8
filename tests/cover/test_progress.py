"""The live display and the plain lines, from a view (no fuzzing needed)."""

import io
import time

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

"""The stack entries' causal checks: each workaround removes its bug on every
path and corpus case of the entry and leaves the case right (nothing else
wrong), so the gate calls a match "known" by what removes it and a second
bug with the same signature stays wrong with the workaround in force."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from harness.gate.ledger import load as load_ledger
from harness.paths import resolve
from harness.paths.workarounds import apply

ROOT = Path(__file__).resolve().parents[2]
LEDGER = ROOT / "cases" / "ledger.json"
HAVE = {m: importlib.util.find_spec(m) is not None for m in ("deepspeed", "megatron")}

# (ledger id, its workaround, the paths it shows on here, its corpus cases)
CHECKS = [
    ("deepspeed-pipe-tied-allreduce-writes-sibling-grad", "clone-grads",
     ("deepspeed.pipe.stock", "deepspeed.pipe.zero1"),
     ("deepspeed/pipe_tied_allreduce_writes_sibling_grad.json", "checkpoint/reentrant_stack_alias_written_through.json",
      "pipeline/interleaved_1f1b_two_ranks_stolen_views.json")),
    ("deepspeed-torch-backward-chained-output-scaled-twice", "engine-backward",
     ("deepspeed.zero1.torch", "deepspeed.zero2.torch"),
     ("deepspeed/torch_backward_chained_output.json", "split/sign_flip_hook_chunk_cat_batch1.json")),
    ("megatron-overlap-unused-param-reset-assert", "no-overlap-grad-reduce",
     ("megatron.ddp.stock", "megatron.distopt.stock"), ("megatron/unused_param_overlap_reset_assert.json",)),
]


def test_the_ledger_names_these_workarounds():
    by_id = {s.id: s for s in load_ledger(str(LEDGER)).sites}
    for bug_id, wa, _, _ in CHECKS:
        assert by_id[bug_id].check == wa, bug_id


def test_a_workaround_applies_only_where_it_means_something():
    """engine-backward changes the loss.backward() drive only; the others keep their own workarounds."""
    from harness.paths.base import Options

    opts = Options()
    names = {p.name: p for p in resolve("deepspeed", opts) + resolve("megatron", opts)}
    assert apply(names["deepspeed.zero1.torch"], "engine-backward") is not None
    assert apply(names["deepspeed.zero1.stock"], "engine-backward") is None
    assert apply(names["deepspeed.pipe.stock"], "clone-grads") is not None
    assert apply(names["megatron.ddp.stock"], "no-overlap-grad-reduce") is not None
    assert apply(names["megatron.ddp.stock"], "paired-p2p") is None
    assert apply(names["megatron.pp.stock"], "paired-p2p") is not None


def _params() -> list:
    out = []
    for bug_id, wa, paths, cases in CHECKS:
        stack = "megatron" if bug_id.startswith("megatron") else "deepspeed"
        mark = pytest.mark.skipif(not HAVE[stack], reason=f"{stack} is not installed")
        out += [pytest.param(bug_id, wa, p, c, marks=mark, id=f"{p}-{Path(c).stem}")
                for p in paths for c in cases]
    return out


@pytest.mark.parametrize("bug_id, wa, path_name, case_file", _params())
def test_the_workaround_removes_the_bug_and_leaves_the_case_right(bug_id, wa, path_name, case_file):
    from harness.artifacts.corpus import load
    from harness.engine.check import CaseCheck

    (path,) = resolve(path_name)
    case = load(str(ROOT / "cases" / case_file)).case
    if path.supports(case) is not None:
        pytest.skip(f"{path_name} refuses it: {path.supports(case)}")
    assert CaseCheck(case).run(path), f"{bug_id} no longer shows on {path_name}"
    worked = apply(path, wa)
    assert worked is not None and worked.supports(case) is None
    assert CaseCheck(case).run(worked) == [], (bug_id, path_name)

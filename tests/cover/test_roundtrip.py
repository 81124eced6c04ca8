"""Every file gradfuzz writes loads back through its own schema.

Divergences are made the way the harness makes them: a path returns an
``Observation`` (a ``Failure``, ``Violation``s and ``Mutation``s with any
backward number, -1 included, odd names, long and non-ASCII text), the real
``compare`` turns it into ``Divergence``s, and the real writers save it: a
session's finding (``Session.on_finding`` -> ``findings.record``), the same
finding again (the count bump reads the file back), ``findings.merge`` into
another folder, a campaign's Redis log, and the xdist workers' status files.
Each is read back by the loader gradfuzz itself uses for it.
"""

from __future__ import annotations

import copy
import json
import math
from functools import lru_cache

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from harness.case.spec import Case, Input, Node, Param, Schedule, Use
from harness.engine import session as sessions
from harness.engine.check import check
from harness.engine.target import Finding
from harness.observation import Divergence, Failure, Mutation, Observation, Violation
from harness.artifacts import campaign, corpus, findings
from harness.paths import Options, resolve
from oracles.eager import observe
from tests.helpers import nested

# Every kind a path reports as a Violation, and the backward numbers a path
# reports: -1 is "before any backward" or "the whole process group".
VIOLATION_KINDS = ("placement", "collective", "timeout", "crash", "frozen", "graph", "hook", "layout", "replica")
BACKWARDS = st.sampled_from([-1, 0, 1, 2, 15])

_ODD = "\x00\x1b[31m\x7f\x85\u2028\u2029\t\r\n\"\\'{}[]: ;é‑漢🙂\U0010ffff"
TEXT = st.text(alphabet=st.characters(codec="utf-8") | st.sampled_from(_ODD), max_size=60)
LONG = st.builds(lambda s, n: s * n, TEXT.filter(bool), st.integers(1, 400))  # past MAX_DETAIL
ANY_TEXT = st.one_of(TEXT, LONG)
NUMBER = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-2**40, 2**40).map(float))


@lru_cache(maxsize=None)
def _case(microbatches: int) -> Case:
    # Two microbatches of a two-parameter case: value divergences on several names and backwards.
    return Case(params=(Param("w0", (3, 3)), Param("b1", (3,))),
                inputs=(Input("x0", (2, 3), requires_grad=True),),
                nodes=(Node("n0", "matmul", (Use("x0"), Use("w0"))), Node("n1", "add", (Use("n0"), Use("b1")))),
                outputs=(Use("n1"),), schedule=Schedule(microbatches=microbatches))


@lru_cache(maxsize=None)
def _oracle(microbatches: int) -> Observation:
    return observe(_case(microbatches))


@lru_cache(maxsize=None)
def _real_path():
    return resolve("split.stock", Options())[0]


class Scripted:
    """A path that reports a given observation: the harness's own compare,
    signatures and writers do the rest."""

    def __init__(self, obs: Observation) -> None:
        real = _real_path()
        self.name, self.contract, self.obs = real.name, real.contract, obs

    def supports(self, case: Case) -> str | None:
        return None

    def availability(self):
        return _real_path().availability()

    def run(self, case: Case) -> Observation:
        return self.obs

    def repro(self, case: Case):
        return _real_path().repro(case)


@st.composite
def scripted(draw) -> tuple[Case, Scripted]:
    microbatches = draw(st.sampled_from([1, 2]))
    case = _case(microbatches)
    obs = copy.deepcopy(_oracle(microbatches))
    obs.path = _real_path().name
    if draw(st.booleans()):
        obs.failure = Failure(draw(BACKWARDS), draw(st.sampled_from(["RuntimeError", "WorkerError", "Ö"])),
                              draw(ANY_TEXT))
    for _ in range(draw(st.integers(0, 3) | st.just(70))):  # 70: more than a file records
        obs.violations.append(Violation(draw(st.sampled_from(VIOLATION_KINDS)), draw(BACKWARDS), draw(ANY_TEXT),
                                        draw(ANY_TEXT), key=draw(TEXT)))
    for _ in range(draw(st.integers(0, 2))):
        obs.mutations.append(Mutation(draw(BACKWARDS), draw(ANY_TEXT), draw(NUMBER)))
    if draw(st.booleans()):  # a wrong value: a grad scaled, or poisoned
        step = obs.steps[draw(st.integers(0, len(obs.steps) - 1))]
        name = draw(st.sampled_from(sorted(step.grads)))
        step.grads[name] = step.grads[name] * draw(st.sampled_from([2.0, -1.0, 0.0, math.inf, math.nan]))
    return case, Scripted(obs)


class FakeRedis:
    """The list operations the campaign log uses, and its length query."""

    def __init__(self) -> None:
        self.lists: dict[str, list[bytes]] = {}

    def rpush(self, key: str, value: str) -> None:
        self.lists.setdefault(key, []).append(value.encode())

    def lrange(self, key: str, start: int, stop: int) -> list[bytes]:
        return self.lists.get(key, [])[start:stop + 1]

    def eval(self, script: str, numkeys: int, key: str, last: int) -> list[int]:
        """The one script the merge sends: the byte length of every item up to ``last``, before any is fetched."""
        return [len(v) for v in self.lists.get(key, [])[: int(last) + 1]]


class _Scripts(findings._ScriptMaker):
    def __init__(self) -> None:
        self.paths = {_real_path().name: _real_path()}


def _found(case: Case, path: Scripted, divs: list[Divergence], flaky: bool, replayed: bool = False) -> Finding:
    for d in divs:  # as TargetRun._confirm_and_record leaves them
        d.case, d.flaky = case.to_json(), flaky
    return Finding(path, case, divs, flaky, 3, 0.5, replayed=replayed)


def _recorded(divs: list[Divergence]) -> list[dict]:
    return json.loads(json.dumps([{k: v for k, v in d.to_json().items() if k != "case"} for d in divs]))


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(made=scripted(), flaky=st.booleans())
def test_every_finding_gradfuzz_saves_loads_back(tmp_path_factory, monkeypatch, made, flaky):
    case, path = made
    divs = check(case, path)
    assert all(d.microbatch is None or d.microbatch >= 0 for d in divs), [d.microbatch for d in divs]
    if not divs:
        return
    tmp = tmp_path_factory.mktemp("found")
    redis = FakeRedis()
    monkeypatch.setattr(campaign, "redis_client", lambda url: redis)
    monkeypatch.setattr(findings, "_ScriptMaker", _Scripts)  # merge's scripts, without building every path
    s = sessions.Session(save_dir=str(tmp / "found"), db_spec="redis://fake/0", seed=0)
    sig = divs[0].signature
    s.on_finding(_found(case, path, divs, flaky))
    assert not s.result.errors, s.result.errors
    file = tmp / "found" / f"{sig}.json"
    entry = corpus.load(file)
    assert entry.case == case and entry.meta["signature"] == sig and entry.meta["count"] == 1
    kept = entry.meta["divergences"]
    assert 1 <= len(kept) <= corpus.MAX_DIVERGENCES
    assert kept[0]["signature"] == sig and kept[0]["microbatch"] == divs[0].microbatch
    for got, want in zip(kept, _recorded(divs)):
        assert got.keys() == want.keys()
        assert {k: v for k, v in got.items() if not isinstance(v, (str, float))} == \
            {k: v for k, v in want.items() if not isinstance(v, (str, float))}
    compile((tmp / "found" / f"{sig}.py").read_text(encoding="utf-8"), "repro.py", "exec")  # a script that parses

    # Found again (the count bump reads the file first), merged into another folder, and from Redis.
    s.on_finding(_found(case, path, copy.deepcopy(divs), flaky))
    assert corpus.load(file).meta["count"] == 2
    summary = findings.merge([str(tmp / "found"), "redis://fake/0"], str(tmp / "merged"))
    assert summary["signatures"] == 1
    assert corpus.load(tmp / "merged" / f"{sig}.json").meta["count"] == 2
    ((got_sig, got_entry, _),) = {e[0]: e for e in campaign.fetch_findings("redis://fake/0")}.values()
    assert got_sig == sig and got_entry.case == case

    # A worker's status file, read back by the controller.
    sessions.write_status(str(tmp / "status-gw0.json"), s.snapshot())
    result, _ = sessions.combine(sessions.read_statuses(str(tmp)))
    assert [d.signature for d in result.divergences] == [d.signature for d in s.result.divergences]


def test_a_hang_after_a_rank_raised_saves_and_saves_again(tmp_path):
    """The issue's case: fsdp2's rank 1 raises, rank 0 hangs in the collective.
    The error has a backward number or none; the hang is the whole group's,
    which ranks report as -1. Saved once and found again (the second gate
    run), the file must load; it held ``"microbatch": -1`` and stopped the gate."""
    case = nested(2)
    obs = copy.deepcopy(observe(case))
    obs.path = "split.stock"
    obs.failure = Failure(-1, "WorkerError", "rank 1: _foreach_norm cannot compute the infinity norm on an empty tensor")
    obs.violations.append(Violation("timeout", -1, "process group", "the case hung (a mismatched collective?)",
                                    key="timeout"))
    path = Scripted(obs)
    divs = check(case, path)
    assert [(d.kind, d.microbatch) for d in divs] == [("error", None), ("timeout", None)]
    s = sessions.Session(save_dir=str(tmp_path), seed=0)
    for _ in range(2):
        s.on_finding(_found(case, path, copy.deepcopy(divs), False))
    e = corpus.load(tmp_path / f"{divs[0].signature}.json")
    assert e.meta["count"] == 2 and [d["microbatch"] for d in e.meta["divergences"]] == [None, None]


def test_a_file_holding_microbatch_minus_one_is_refused_with_what_to_do(tmp_path):
    """Files written before the fix: a clear error naming the file, the field and the fix."""
    s = sessions.Session(save_dir=str(tmp_path), seed=0)
    case = nested()
    obs = copy.deepcopy(observe(case))
    obs.path = "split.stock"
    obs.failure = Failure(0, "RuntimeError", "boom")
    path = Scripted(obs)
    divs = check(case, path)
    s.on_finding(_found(case, path, divs, False))
    file = tmp_path / f"{divs[0].signature}.json"
    data = json.loads(file.read_text())
    data["meta"]["divergences"][0]["microbatch"] = -1
    file.write_text(json.dumps(data))
    with pytest.raises(corpus.CorpusError) as e:
        corpus.load(file)
    msg = str(e.value)
    assert str(file) in msg and "meta.divergences[0].microbatch" in msg and "null" in msg

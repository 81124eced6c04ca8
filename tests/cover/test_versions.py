"""Versions are part of a verdict: a ledger range names a training stack's
releases beside torch's, and ``gradfuzz versions`` finds that range by
bisecting over the releases noxfile.py lists."""

import json
import os
import sys

import pytest

from harness.artifacts import corpus
from harness.artifacts.corpus import relation
from harness.cli import versions as v
from harness.gate import ledger

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def have(**installed):
    return lambda name: installed.get(name.replace("-", "_"))


@pytest.mark.parametrize("packages,installed,expected", [
    ({}, {}, "in"),
    ({"deepspeed": ">=0.16,<0.18"}, {"deepspeed": "0.17.6"}, "in"),
    ({"deepspeed": ">=0.16,<0.18"}, {"deepspeed": "0.18.0"}, "after"),
    ({"deepspeed": ">=0.16,<0.18"}, {"deepspeed": "0.15.4"}, "before"),
    ({"deepspeed": ">=0.16"}, {}, "before"),  # the stack is not installed: its bug cannot show
    ({"deepspeed": ">=0.16", "megatron-core": "<0.15"}, {"deepspeed": "0.19.8", "megatron_core": "0.16.1"}, "after"),
])
def test_a_range_holds_only_when_torch_and_every_named_stack_are_in_it(packages, installed, expected):
    assert relation(">=2.11", packages, "2.13.0+cpu", have(**installed)) == expected
    assert relation("<2.11", packages, "2.13.0", have(**installed)) == "after"  # torch decides first


def _ledger(tmp_path, packages):
    bug = {"id": "ds-bug", "path": "deepspeed.zero3.stock", "torch": ">=2.11", "summary": "s", "packages": packages}
    f = tmp_path / "ledger.json"
    f.write_text(json.dumps({"gradfuzz_ledger": 1, "signature_scheme": ledger.SIGNATURE_SCHEME, "bugs": [bug]}))
    return f


def test_ledger_entries_carry_package_ranges_and_write_them_back(tmp_path):
    led = ledger.load(str(_ledger(tmp_path, {"deepspeed": ">=0.16,<0.18"})))
    (bug,) = led.sites
    assert bug.packages == (("deepspeed", ">=0.16,<0.18"),)
    assert bug.range == "torch >=2.11, deepspeed >=0.16,<0.18"
    assert ledger.to_json(led)["bugs"][0]["packages"] == {"deepspeed": ">=0.16,<0.18"}


@pytest.mark.parametrize("packages,field", [
    ({"deepspeed": "not a range"}, "bugs[0].packages.deepspeed"),
    ({"../evil": ">=1"}, "bugs[0].packages key"),
    (["deepspeed"], "bugs[0].packages"),
    ({f"p{i}": ">=1" for i in range(9)}, "bugs[0].packages"),
])
def test_bad_package_ranges_are_refused_naming_the_field(tmp_path, packages, field):
    with pytest.raises(corpus.CorpusError, match=field.replace("[", r"\[").replace("]", r"\]")):
        ledger.load(str(_ledger(tmp_path, packages)))


def test_bisection_runs_few_releases_and_finds_both_ends():
    releases = [f"0.{i}.0" for i in range(10, 30)]
    ran = []

    def outcome(r):
        ran.append(r)
        return v.DIVERGES if "0.14.0" <= r < "0.23.0" else v.AGREES

    seen = v.bisect(releases, outcome)
    assert len(ran) == len(set(ran)) < len(releases)
    spec = v.specifier(releases, v.filled(releases, seen))
    assert spec == ">=0.14.0,<0.23.0"
    assert "4 of 20" not in v.table("deepspeed", releases, seen)  # the count said is the real one
    assert f"{len(seen)} of 20 releases run" in v.table("deepspeed", releases, seen)


def test_ranges_open_at_the_ends_the_list_reaches_and_gaps_are_said():
    rs = ["1.0", "1.1", "1.2", "1.3"]
    assert v.specifier(rs, dict(zip(rs, [v.DIVERGES, v.DIVERGES, v.AGREES, v.AGREES]))) == "<1.2"
    assert v.specifier(rs, dict(zip(rs, [v.AGREES, v.DIVERGES, v.DIVERGES, v.DIVERGES]))) == ">=1.1"
    split = dict(zip(rs, [v.DIVERGES, v.AGREES, v.DIVERGES, v.AGREES]))
    assert v.specifier(rs, split) == "!=1.1,<1.3"  # a release inside that agrees is left out by name
    assert "none of the releases of x run" in v.table("x", rs, dict.fromkeys(rs, v.AGREES))
    unknown = v.filled(rs, {"1.0": v.AGREES, "1.3": v.DIVERGES})
    assert unknown["1.1"] == "unknown (not run)" and v.specifier(rs, unknown) is None
    assert "range: not known" in v.table("x", rs, unknown)


def test_a_refusal_or_a_release_without_the_drive_is_not_affected_and_not_agreement():
    """A review found the six DeepSpeed misuse ranges by hand because the
    tool read a refusal (the stack raised: the user was told) as "agrees" and
    a release without loss.backward() as "diverges". Both are releases the
    bug is not in, said as what they are."""
    refused = v.verdict({"deepspeed.zero1.misuse": "refused: raised TypeError: backward() got an unexpected keyword",
                         "deepspeed.zero0.misuse": "outside its contract: no misuse drawn"})
    absent = v.verdict({"deepspeed.zero1.torch": "absent: DeepSpeed 0.16.9 has no loss.backward() drive"})
    assert v.outcome_class(refused) == v.REFUSED and v.outcome_class(absent) == v.ABSENT
    assert v.outcome_class(v.verdict({"p": "unavailable: deepspeed is not installed here"})) == v.UNKNOWN
    rs = ["0.16.9", "0.18.2", "0.18.3", "0.18.6", "0.18.7", "0.19.0", "0.19.8"]
    seen = dict(zip(rs, [absent, absent, "diverges on 1 of 1 paths: x", "diverges on 1 of 1 paths: x", refused,
                         "diverges on 1 of 1 paths: x", "diverges on 1 of 1 paths: x"]))
    assert v.specifier(rs, seen) == ">=0.18.3,!=0.18.7"
    assert "refused" in v.table("deepspeed", rs, seen).splitlines()[4]
    # the bisection looks at the class: a refusal between two agreements is a change it runs down
    bisected = v.bisect(rs, lambda r: refused if r == "0.18.7" else v.AGREES, samples=4)
    assert sorted(bisected, key=rs.index) == rs[:1] + rs[2:]  # 0.18.6 and 0.19.0 run to find the refusal's ends


def test_deepspeed_loss_backward_drive_is_absent_before_the_release_that_hooks_outputs(monkeypatch):
    import importlib.util

    from packaging.version import Version

    from harness.paths.deepspeed import paths as ds

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    monkeypatch.setattr(ds, "installed_release", lambda: Version("0.18.2"))
    torch_drive = ds.DeepSpeedPath("deepspeed.zero1.torch", 1, drive="torch")
    a = torch_drive.availability()
    assert not a.ok and a.absent and "0.18.3" in a.reason
    monkeypatch.setattr(ds, "installed_release", lambda: Version("0.18.3"))
    assert not torch_drive.availability().absent
    monkeypatch.setattr(ds, "installed_release", lambda: Version("0.16.9"))
    assert not ds.DeepSpeedPath("deepspeed.zero1.stock", 1).availability().absent  # the other drives are there


def test_a_release_where_nothing_ran_is_no_answer_not_agreement():
    assert v.verdict({"deepspeed.zero0.stock": "unavailable: not installed"}).startswith("no answer")
    got = v.verdict({"a": v.AGREES, "b": "diverges: timeout [t-1] the case hung"})
    assert got == "diverges on 1 of 2 paths: b: timeout [t-1] the case hung" and v.outcome_class(got) == v.DIVERGES
    assert v.outcome_class("no answer: the session failed") == "unknown"
    # the bisection compares classes: two releases that diverge differently are not a change
    rs = ["1.0", "1.1", "1.2", "1.3", "1.4"]
    seen = v.bisect(rs, lambda r: f"diverges on 1 of 1 paths: p: value [{r}]", samples=2)
    assert sorted(seen) == ["1.0", "1.4"] and v.specifier(rs, v.filled(rs, seen)) == ""


def test_the_release_list_is_noxfiles(tmp_path):
    """One list: ``versions`` reads the releases from ``nox -l --json``."""
    fake = tmp_path / "nox.py"
    sessions = [{"name": "stack", "call_spec": {"package": "deepspeed", "release": r}} for r in ("0.19.8", "0.14.5")]
    sessions.append({"name": "gate", "call_spec": {"torch": "2.13.0"}})
    fake.write_text(f"print({json.dumps(json.dumps(sessions))})")
    assert v.from_nox(f"{sys.executable} {fake}", "deepspeed") == ["0.14.5", "0.19.8"]
    text = open(os.path.join(ROOT, "noxfile.py")).read()
    assert '"deepspeed": [' in text and "def stack(" in text


def test_here_replays_one_case_on_what_is_installed(tmp_path, capsys):
    from harness.cli.main import main
    from tests.helpers import nested

    f = tmp_path / "case.json"
    f.write_text(json.dumps(corpus.Entry(nested(), {}).to_json()))
    assert main(["versions", str(f), "--here", "--paths", "eager.accumulate,deepspeed.zero0"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["eager.accumulate"] == v.AGREES
    assert got["deepspeed.zero0.stock"] in (v.AGREES, "unavailable: deepspeed is not installed here: "
                                            "pip install 'gradfuzz[deepspeed]'")


def test_releases_without_a_nox_session_are_refused(tmp_path):
    """A release noxfile.py has no session for would only fail inside nox: it is named up front."""
    from harness.paths import UsageError

    fake = tmp_path / "nox.py"
    sessions = [{"name": "stack", "call_spec": {"package": "deepspeed", "release": "0.19.8"}}]
    fake.write_text(f"print({json.dumps(json.dumps(sessions))})")
    with pytest.raises(UsageError, match="0.17.6 of deepspeed have no nox session"):
        v.cmd_versions(argparse_namespace(case="x.json", package="deepspeed", releases="0.17.6,0.19.8",
                                          nox=f"{sys.executable} {fake}"))


def argparse_namespace(**kw):
    import argparse

    base = {"here": False, "paths": None, "all": False, "samples": v.SAMPLES, "timeout": 1.0}
    return argparse.Namespace(**{**base, **kw})

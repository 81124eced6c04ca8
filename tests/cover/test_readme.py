"""The README's two commands are what CI runs: keep them in step."""

import os
import re

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def _readme_commands() -> list[str]:
    text = open(os.path.join(ROOT, "README.md")).read()
    section = text.split("## The two commands", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```\n(.+?)\n```", section)


def test_ci_runs_the_readme_install_and_test_commands():
    install, test = _readme_commands()
    ci = open(os.path.join(ROOT, ".ci", "run")).read().splitlines()
    assert install.split(" && ")[0] in ci
    assert ci[-1] == test


def test_the_readme_is_a_front_page():
    assert len(open(os.path.join(ROOT, "README.md")).read().splitlines()) <= 150, "the manual goes to docs/"


def _ledger():
    from harness.gate import ledger

    return ledger, ledger.load(os.path.join(ROOT, "cases", "ledger.json"))


def test_the_ledger_page_lists_every_ledger_entry():
    ledger, led = _ledger()
    page = open(os.path.join(ROOT, "docs", "ledger.md")).read()
    rows = set(page.splitlines())
    stale = [b.id for b in led.bugs if ledger.doc_row(b) not in rows]
    assert not stale, (f"docs/ledger.md's bug table is stale for {stale}: regenerate its rows with "
                       "harness.gate.ledger.doc_row (the command is on the page)")
    listed = re.findall(r"^\| `([^`]+)` \| `", page, re.M)
    assert sorted(listed) == sorted(b.id for b in led.bugs), "docs/ledger.md lists a bug the ledger does not hold"


FOUNDING = ("split-nested-double-count", "dtensor-partial-lost-on-transposed-grad", "graphed-static-grad-alias")


def test_the_docs_count_the_ledger_as_it_is():
    """The counts the README and docs/ledger.md give are the ledger's own."""
    ledger, led = _ledger()
    n = ledger.counts(led)
    assert all(any(b.id == f for b in led.bugs) for f in FOUNDING)
    readme = " ".join(open(os.path.join(ROOT, "README.md")).read().split())
    m = re.search(r"ledger holds (\d+) such bugs: the three founding bugs and (\d+) that .*?and (\d+) misuses", readme)
    assert m, "README.md no longer says how many bugs the ledger holds"
    assert tuple(map(int, m.groups())) == (n["bugs"], n["bugs"] - len(FOUNDING), n["misuses"]), \
        f"README.md counts {m.group(0)!r}; the ledger holds {n}"
    page = " ".join(open(os.path.join(ROOT, "docs", "ledger.md")).read().split())
    m = re.search(r"ledger holds (\d+) entries, one per bug: (\d+) bugs and (\d+) misuses, at (\d+) places", page)
    assert m, "docs/ledger.md no longer says how many entries the ledger holds"
    assert tuple(map(int, m.groups())) == (n["entries"], n["bugs"], n["misuses"], n["places"]), \
        f"docs/ledger.md counts {m.group(0)!r}; the ledger holds {n}"

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


def test_the_ledger_page_lists_every_ledger_entry():
    import json

    page = open(os.path.join(ROOT, "docs", "ledger.md")).read()
    bugs = json.load(open(os.path.join(ROOT, "cases", "ledger.json")))["bugs"]
    missing = [b["id"] for b in bugs if f"| `{b['id']}` | `{b['path']}` | `{b['torch']}` |" not in page]
    assert not missing, f"docs/ledger.md's bug table is stale for {missing}: regenerate it from cases/ledger.json"

"""``gradfuzz report BUG-ID``: a ledger bug as an issue a maintainer can file.

A ledger entry says what gradfuzz knows of a bug in gradfuzz's words (path
names, signatures); an upstream issue needs torch's: a title, the versions
affected, a script that needs only torch, what was expected and what
happened, and what upstream already has. Everything here comes from the
ledger entry and its corpus cases, so the issue says no more than the
ledger can back; ``--run`` replays the case here to put numbers under
"Actual" (the case is checked data, as in ``gradfuzz repro``; the script
beside it is only quoted, never run).
"""

from __future__ import annotations

import argparse
import os
import re
from typing import Any

from harness.artifacts import corpus
from harness.artifacts.text import scrub
from harness.case import schema as sc
from harness.case.vocab import printable
from harness.case.budget import MAX_SCRIPT_BYTES
from harness.gate import ledger as ledger_mod

_REF = re.compile(r"(?<![\w/])(?:pytorch(?:/pytorch)?)?#(\d{3,7})\b")
# Marks around the quoted script while the issue is assembled (private-use characters, dropped from the text).
_SCRIPT, _QUOTED = "\ue000", "\ue001"
_URL = re.compile(r"https://github\.com/[\w.-]+/[\w.-]+/(?:issues|pull)/\d+")


def add_parser(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("report", help="write a ledger bug as an upstream-ready issue in Markdown")
    r.add_argument("bug", metavar="BUG-ID", help="a ledger id (gradfuzz ledger lists them; docs/ledger.md too)")
    r.add_argument("--ledger", metavar="FILE", help="known-bug ledger (default: cases/ledger.json of the installed "
                   "gradfuzz project)")
    r.add_argument("--out", metavar="FILE", help="write the Markdown here (default: standard output)")
    r.add_argument("--run", action="store_true", help="replay the bug's case here and show what this torch "
                   "computes under Actual (runs the case, never the script file)")
    r.set_defaults(func=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    from harness.paths import UsageError

    led = ledger_mod.load(args.ledger)
    try:
        bug = led.bug(args.bug)
    except KeyError:
        close = sorted(b.id for b in led.bugs if args.bug.split("-")[0] in b.id)[:8]
        raise UsageError(f"no bug {args.bug!r} in {args.ledger} ({len(led.bugs)} bugs)"
                         + (f"; similar ids: {', '.join(close)}" if close else "; `gradfuzz ledger` lists them")) from None
    text = issue(bug, led.root, run=args.run)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
        print(f"gradfuzz report: {bug.id} written to {args.out} ({len(text.splitlines())} lines)")
    else:
        print(text, end="")
    return 0


def issue(bug: ledger_mod.Bug, root: str, run: bool = False) -> str:
    """The Markdown issue for ``bug``; ``root`` is the ledger's folder (its cases are relative to it)."""
    case_file, script_file = _script_case(bug, root)
    entry = corpus.load(os.path.join(root, case_file)) if case_file else None
    meta = entry.meta if entry else {}
    lines = [f"# {title(bug)}", "",
             f"<!-- gradfuzz report {bug.id}: ledger entry and case {case_file or '(none)'} -->", "",
             "### 🐛 Describe the bug", "", bug.summary, ""]
    notes = [f"- on `{p.path}`: {p.note}" for p in bug.places if p.note]
    if notes:
        lines += ["Where it shows:", "", *notes, ""]
    if meta.get("analysis"):
        lines += ["Why:", "", str(meta["analysis"]), ""]
    lines += _script_section(script_file, case_file, bug, root, entry)
    lines += ["**Expected:** what eager autograd computes for the same module and schedule: the script's "
              "`expected()`, plain `torch.autograd.grad` per backward in float64, summed out of place.", "",
              f"**Actual:** {meta.get('title') or bug.summary}", ""]
    if run and entry is not None:
        lines += _actual(bug, entry) + [""]
    lines += ["### Affected versions", ""]
    lines += [f"- torch `{p.torch}`" + "".join(f", {n} `{s}`" for n, s in p.packages) + f" (gradfuzz paths `{p.path}`)"
              for p in bug.places]
    checked = meta.get("checked") or {}
    if checked:
        lines.append("- this case, checked: " + ", ".join(f"torch {v} {what}" for v, what in sorted(checked.items())))
    lines += ["", "### Related", ""]
    links = related(bug.upstream)
    lines += [f"- {u}" for u in links] or ["- none found upstream"]
    lines += [f"- what gradfuzz's ledger says of upstream: {bug.upstream}" if bug.upstream else "",
              f"- found with gradfuzz (differential gradient fuzzing); the case: `gradfuzz repro cases/{case_file}`"
              if case_file else "", "", "### Versions", "",
              "Paste `python -m torch.utils.collect_env` here.", ""]
    # The script is quoted as it is (scrub would cut its "#!/usr/bin/env" like a path of this machine);
    # everything else drops this machine's absolute paths. Both escape control characters.
    out = []
    for part in "\n".join(lines).split(_SCRIPT):
        out.append(part[len(_QUOTED):] if part.startswith(_QUOTED) else scrub(part))
    return "".join(out) + "\n"


def title(bug: ledger_mod.Bug) -> str:
    """``[component] first clause of the summary``: what broke, in torch's names."""
    first = bug.places[0].path.split(",")[0].strip().split(".")[0]
    head = re.split(r": |; | \(", bug.summary, maxsplit=1)[0].strip().rstrip(".")
    if len(head) > 110:
        head = head[:110].rsplit(" ", 1)[0] + " ..."
    return f"[{component(first)}] {head[:1].upper()}{head[1:]}"


def component(head: str) -> str:
    """The upstream component a path-name head reaches, in the words its
    family declares (``Family.components``), so a new family's issues are
    titled in its stack's terms without a line here; else the head itself."""
    from harness.paths import families

    for fam in families():
        if head in fam.components:
            return fam.components[head]
    return head


def related(upstream: str) -> list[str]:
    """Every issue and pull request the ledger's upstream text names, as links (pytorch#N is pytorch/pytorch)."""
    out = [u for u in _URL.findall(upstream)]
    for n in _REF.findall(upstream):
        for kind in ("issues", "pull"):
            if f"pytorch/pytorch/{kind}/{n}" in " ".join(out):
                break
        else:
            out.append(f"https://github.com/pytorch/pytorch/issues/{n}")
    return list(dict.fromkeys(out))


def _script_case(bug: ledger_mod.Bug, root: str) -> tuple[str | None, str | None]:
    """The first of the bug's cases with a standalone script beside it, else its first case."""
    for c in bug.all_cases:
        py = os.path.join(root, c[:-len(".json")] + ".py") if c.endswith(".json") else None
        if py and os.path.isfile(py):
            return c, py
    return (bug.all_cases[0], None) if bug.all_cases else (None, None)


def _script_section(script_file: str | None, case_file: str | None, bug: ledger_mod.Bug, root: str,
                    entry: corpus.Entry | None) -> list[str]:
    if case_file is None:
        return ["gradfuzz keeps no corpus case of this bug (one whose showing depends on what memory held is kept "
                "out of the replay, which must count the same twice); the upstream note under Related names a "
                "torch-only script where there is one.", ""]
    if script_file is not None:
        text = sc.read_regular(script_file, MAX_SCRIPT_BYTES, "repro script").decode("utf-8", "replace")
        how = "plain `python repro.py`" if "torchrun" not in text else "the `torchrun` line in its docstring"
        source = os.path.relpath(script_file, os.path.dirname(root))
    else:
        text, how, source = _generated(bug, entry), "plain `python repro.py`", "generated by `gradfuzz repro --script`"
    if text is None:
        return ["No standalone script could be made here for this case; "
                f"`gradfuzz repro cases/{case_file} --paths {bug.places[0].path.split(',')[0].strip()} --script` "
                "writes one where its path runs.", ""]
    return [f"A script that needs only torch ({source}); run it with {how}. It computes the grads both ways and "
            "exits 1 when they differ:", "", "```python", _SCRIPT + _QUOTED + printable(text.rstrip("\n"), layout=True)
            + _SCRIPT, "```", ""]


def _generated(bug: ledger_mod.Bug, entry: corpus.Entry | None) -> str | None:
    """A script made from the case on the first of the bug's paths that runs here."""
    if entry is None:
        return None
    from harness.artifacts import repro
    from harness.paths import close_paths, resolve, split_available

    for place in bug.places:
        live: list[Any] = []
        try:
            live, _ = split_available([p for p in resolve([place.path.split(",")[0].strip().split("*")[0].rstrip(".")])
                                       if ledger_mod.covers(place.path, p.name)])
            for p in live:
                if p.supports(entry.case) is None:
                    return repro.script(entry.case, p.name, p.repro(entry.case), title=entry.meta.get("title", ""))
        except Exception:  # a family that cannot be built here: try the next place
            continue
        finally:
            close_paths(live)
    return None


def _actual(bug: ledger_mod.Bug, entry: corpus.Entry) -> list[str]:
    """What this torch computes for the case on the bug's first path that runs here."""
    import torch

    from harness.engine.check import replay_entries
    from harness.paths import close_paths, resolve, split_available

    for place in bug.places:
        name = place.path.split(",")[0].strip()
        if "*" in name:
            continue
        live, _ = split_available(resolve([name]))
        try:
            for r in replay_entries([entry], [p for p in live if p.name == name]):
                if r.skipped is not None:
                    continue
                if not r.divergences:
                    return [f"Replayed here on torch {torch.__version__} ({name}): the case agrees."]
                return [f"Replayed here on torch {torch.__version__} ({name}):", "", "```",
                        *[d.detail for d in r.divergences[:4]], "```"]
        finally:
            close_paths(live)
    return ["(not replayed: none of the bug's paths runs here)"]

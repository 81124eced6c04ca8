"""Gate reports people read: terminal, Markdown and JUnit XML (the HTML page
is ``harness.gate.html``).

The JSON record (``GateReport.to_json``) is the source; every other form is
rendered from it, so they cannot disagree.
"""

from __future__ import annotations

import os
import re
import xml.etree.ElementTree as ET
from typing import Any

from harness.case import schema as sc
from harness.gate.status import FAILING, ORDER, STATUSES
from harness.observation import BUG_CLASS, MISUSE_CLASS
from harness.artifacts.text import ELLIPSIS, PROJECT, one_line, relative, scrub, shorten

STATUS_WORDS = {k: s.words for k, s in STATUSES.items()}
MAX_ROWS = 40  # table rows a reviewer reads; the JSON record keeps every row
CELL = 160  # characters of detail in a Markdown cell
TITLE = 120  # characters of a finding's one-line title


def words(status: str) -> str:
    """How reports name a status: from the status table, so a status added
    there shows in every report (an unknown one shows as itself)."""
    return STATUS_WORDS.get(status, status)


def misuse(g: dict[str, Any]) -> bool:
    """Is a group (or row) a misuse finding: a use the stack's docs do not
    support that it silently gets wrong (``harness.observation.MISUSE_CLASS``)?"""
    return (g.get("first") or g).get("finding_class", BUG_CLASS) == MISUSE_CLASS


def label(g: dict[str, Any]) -> str:
    """A group's status as every form shows it: misuse findings marked, so
    they are never read as a bug of a documented use."""
    return f"MISUSE, {words(g['status'])}" if misuse(g) else words(g["status"])


MISUSE_HEADING = "misuse findings (a use the stack's docs do not support, silently wrong; listed apart)"


def _rank(status: str) -> int:
    return ORDER.index(status) if status in ORDER else len(ORDER)


def _sorted(rows):
    return sorted(rows, key=lambda r: (_rank(r["status"]), r["path"]))


def family(path: str) -> str:
    return path.split(".", 1)[0]


def _key(r: dict[str, Any]) -> tuple[str, ...]:
    """What makes two rows one line: the same bug on any path (a bug seen on
    31 paths is one thing to read), else the same signature (a new finding
    is news of its own), else the family for rows that pass (unavailable
    paths) and the row itself for the rest (a harness error each)."""
    cls = r.get("finding_class", BUG_CLASS)  # a misuse never shares a line with a bug
    if r.get("bug"):
        return (r["status"], "bug", r["bug"], cls)
    if r.get("signature"):
        return (r["status"], "signature", r["signature"], cls)
    if r["status"] in FAILING:
        return (r["status"], "row", r["path"], r["detail"], cls)
    if r["status"] == "unavailable":  # one line per reason: 19 deepspeed paths, one missing package
        return (r["status"], "reason", one_line(r["detail"]), cls)
    return (r["status"], "family", family(r["path"]), cls)


def groups(rep: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows grouped into one line per bug (or per signature where no bug
    owns it), worst first, with the count, the paths and one representative row."""
    out: dict[tuple[str, ...], dict[str, Any]] = {}
    for r in _sorted(rep["rows"]):
        what = r.get("bug") or r.get("signature") or ""
        g = out.setdefault(_key(r), {"status": r["status"], "what": what, "family": family(r["path"]), "count": 0,
                                     "paths": [], "first": r})
        g["count"] += 1
        if r["path"] not in g["paths"]:
            g["paths"].append(r["path"])
    return list(out.values())


def _paths_text(g: dict[str, Any], most: int = 4) -> str:
    paths = g["paths"]
    return ", ".join(paths[:most]) + (f" and {len(paths) - most} more" if len(paths) > most else "")


# --- a finding's title and repro ------------------------------------------------------------


def _times(ratio: float) -> str:
    return f"{ratio:.3g}x"


def _when(d: dict[str, Any]) -> str:
    k = d.get("microbatch")
    if k is None or k < 0:
        return ""
    return f" after {k + 1} microbatch{'' if k == 0 else 'es'}"


def _value_words(d: dict[str, Any]) -> str:
    """A wrong value in words: whose grad, by what factor, when."""
    label = d.get("param") or "a value"
    subject = label if " " in label else f"{label}'s grad"
    detail, ratio, when = d.get("detail") or "", d.get("ratio"), _when(d)
    if ratio is not None and abs(ratio) < 1e-6:
        return f"{subject} is zero{when} where eager's is not"
    if ratio is None:
        if "where autograd gives none" in detail:
            return f"{label} gets a grad{when} where eager gives none"
        return f"{subject} has the wrong shape{when}" if "shape" in detail else f"{subject} differs from eager's{when}"
    if abs(ratio - 1) < 0.01:
        rel = d.get("max_rel")
        return f"{subject} differs from eager's{when}" + (f" (max rel diff {rel:.2g})" if rel is not None else "")
    return f"{subject} is {_times(ratio)} eager's{when}" + _explanation(detail)


_EXPLAINED = re.compile(r"; ratio actual/expected [^;]+; (?P<why>.+)$")


def _explanation(detail: str) -> str:
    """The decomposition the comparison found ("actual = 2*g1, expected g1 +
    g2"), without its trailing aside, as ": ..."; else nothing."""
    m = _EXPLAINED.search(one_line(detail))
    if m is None:
        return ""
    why = m["why"]
    while (short := re.sub(r" \([^()]*\)$", "", why)) != why:
        why = short
    return f": {why}"


def _clause(detail: str) -> str:
    """A violation's first clause: "w0.grad after backward 0 has strides (1, 3), the parameter (3, 1)"."""
    return re.split(r"; |: |, but ", one_line(detail), maxsplit=1)[0]


def _error_words(d: dict[str, Any]) -> str:
    raised = (d.get("detail") or "").removeprefix("raised ").removesuffix(" (the eager oracle ran this case fine)")
    return f"raises {raised.splitlines()[0] if raised else 'an error'}{_when(d)} where eager runs"


def title(row: dict[str, Any]) -> str | None:
    """A finding's one line for an upstream report, from its path, kind,
    tensor and ratio: "split.stock: w0's grad is 2x eager's after 2
    microbatches (value)". None for a row with no divergence."""
    d = row.get("divergence")
    if not d:
        return None
    kind = d.get("kind") or "divergence"
    what = {"value": _value_words, "error": _error_words}.get(kind, lambda d: _clause(d.get("detail") or kind))(d)
    return shorten(scrub(f"{row['path']}: {one_line(what)}"), TITLE - len(kind) - 3) + f" ({kind})"


def _saved_by_signature(save_dir: str) -> dict[str, str]:
    """Saved findings by every signature each one shows: one file is saved
    per finding, named by its first divergence's signature."""
    out: dict[str, str] = {}
    try:
        names = sorted(n for n in os.listdir(save_dir) if n.endswith(".json"))
    except OSError:
        return out
    for n in names:
        f = os.path.join(save_dir, n)
        try:
            meta = sc.read_json(f, sc.MAX_CORPUS_BYTES, "finding file").get("meta") or {}
        except (sc.FileError, AttributeError):
            continue  # not a finding file gradfuzz could load: no link to it
        for sig in [meta.get("signature")] + [d.get("signature") for d in meta.get("divergences") or []]:
            if isinstance(sig, str):
                out.setdefault(sig, f)
    return out


def _corpus_file(source: str) -> str | None:
    """The one corpus file a replayed row came from (``corpus FILE``), as
    named or under the project's ``cases/`` (ledger entries name their cases so)."""
    if not source.startswith("corpus ") or "," in source:
        return None
    name = source[len("corpus "):]
    return next((f for f in (name, os.path.join(PROJECT, "cases", name)) if os.path.isfile(f)), None)


class Repros:
    """Where a reviewer finds each failing row's standalone repro: the
    corpus file a replayed finding came from, or the finding the fuzzing
    saved under ``save_dir``; its ``.py`` script where one was written."""

    def __init__(self, save_dir: str | None) -> None:
        self.save_dir = save_dir
        self._index: dict[str, str] | None = None

    def _saved(self, sig: str) -> str | None:
        if not self.save_dir or not sig:
            return None
        direct = os.path.join(self.save_dir, f"{sig}.json")
        if os.path.exists(direct):
            return direct
        if self._index is None:
            self._index = _saved_by_signature(self.save_dir)
        return self._index.get(sig)

    def __call__(self, row: dict[str, Any]) -> str | None:
        """The relative path of ``row``'s repro, or None."""
        if row.get("repro"):
            return relative(row["repro"])
        found = _corpus_file(row.get("source") or "") or self._saved(row.get("signature") or "")
        if not found:
            return None
        script = found[:-5] + ".py" if found.endswith(".json") else found
        return relative(script if os.path.exists(script) else found)


class _LinkedFrom(Repros):
    """Repro links as a file in ``base`` reaches them (None: the working
    directory): a Markdown report under ``.gradfuzz/gate/`` links
    ``../../cases/split/x.py``, not a path that works only from where the gate ran."""

    def __init__(self, save_dir: str | None, base: str | None) -> None:
        super().__init__(save_dir)
        self.base = base

    def __call__(self, row: dict[str, Any]) -> str | None:
        link = super().__call__(row)
        if link is None or self.base is None or os.path.isabs(link) or not os.path.exists(link):
            return link
        return os.path.relpath(os.path.abspath(link), self.base)


def _needs_repro(g: dict[str, Any]) -> bool:
    return g["status"] in FAILING and bool(g["first"].get("divergence"))


# --- the verdict --------------------------------------------------------------------------


def _counted(rep: dict[str, Any], failing: bool) -> list[str]:
    c = rep["counts"]
    keys = ORDER + sorted(k for k in c if k not in ORDER)
    return [f"{c[k]} {k.replace('_', ' ')}" for k in keys if c.get(k) and (k in FAILING) == failing]


def headline(rep: dict[str, Any]) -> str:
    """The verdict and why in one line: what fails the gate, then the rest."""
    fails, rest = _counted(rep, True), _counted(rep, False)
    why = (f"{', '.join(fails)} fail the gate" if fails else "nothing fails the gate") + (
        f"; {', '.join(rest)}" if rest else "") + _misuse_counts(rep)
    return f"gradfuzz gate {'PASSED' if rep['passed'] else 'FAILED'} on {on(rep)}: {why}"


def _misuse_counts(rep: dict[str, Any]) -> str:
    """``; of these, misuse: 1 new, 2 known``: the rows of the misuse class,
    by status (they are in the counts before it as well)."""
    c: dict[str, int] = {}
    for r in rep["rows"]:
        if misuse(r):
            c[r["status"]] = c.get(r["status"], 0) + 1
    shown = [f"{c[k]} {k.replace('_', ' ')}" for k in ORDER + sorted(set(c) - set(ORDER)) if c.get(k)]
    return f"; of these, misuse: {', '.join(shown)}" if shown else ""


def on(rep: dict[str, Any]) -> str:
    """What the verdict is about: torch, and the training stacks installed (``torch 2.13.0, deepspeed 0.19.8``)."""
    return ", ".join([f"torch {rep['torch']}"] + [f"{k} {v}" for k, v in (rep.get("packages") or {}).items()])


def _facts(rep: dict[str, Any]) -> str:
    sc = rep.get("selfcheck") or []
    ex = rep.get("examples") or {}
    skipped = sum(1 for s in sc if s.get("skipped"))
    parts = [f"self-check {sum(1 for s in sc if s['caught'])}/{len(sc)} canaries caught"
             + (f", {skipped} skipped" if skipped else "") if sc else "no self-check",
             f"{sum(ex.values()):,} examples over {len(ex)} paths" + _unjudged(rep),
             f"{rep['seconds']:.0f}s" + _phases(rep)]
    return "; ".join(parts)


def _unjudged(rep: dict[str, Any]) -> str:
    """`` (12 unjudged: a wrong grad would agree)``: cases run that a wrong grad
    would have passed, counted apart from passes."""
    n = sum((rep.get("unjudged") or {}).values())
    return f" ({n:,} unjudged: a wrong grad would agree)" if n else ""


def _phases(rep: dict[str, Any]) -> str:
    """`` (self-check 120s 23%, replay ...)``: which phase a slow gate spends its time in."""
    ph, total = rep.get("phases") or {}, rep["seconds"] or 1.0
    return f" ({', '.join(f'{k} {v:.0f}s {100 * v / total:.0f}%' for k, v in ph.items())})" if ph else ""


def verdict(rep: dict[str, Any]) -> str:
    """The last line on the terminal, pytest style."""
    parts = _counted(rep, True) + _counted(rep, False)
    text = f" gradfuzz gate on {on(rep)}: {'PASSED' if rep['passed'] else 'FAILED'} ({', '.join(parts) or 'nothing to report'}) in {rep['seconds']:.0f}s "
    return text.center(max(len(text) + 8, 79), "=")


def _overflow(rest: list[dict[str, Any]], full: str | None, at: str | None = None) -> str:
    """The groups not shown, counted, the report that has them (named as a
    reader at ``at`` finds it: a report file's folder; None: the working
    directory), then the ids of their bugs: a log searched for a bug id
    finds it even when its row is past the limit."""
    n = len(rest)
    if not full:
        head = f"{ELLIPSIS} and {n} more rows: see the JSON report (gate --json FILE)"
    else:
        where = os.path.relpath(os.path.abspath(full), os.path.abspath(at)) if at is not None else relative(full)
        head = f"{ELLIPSIS} and {n} more rows: see {where}"
    ids = list(dict.fromkeys(g["first"]["bug"] for g in rest if g["first"].get("bug")))
    return head + (f"; their bugs: {', '.join(f'[{i}]' for i in ids)}" if ids else "")


def _shows_detail(g: dict[str, Any]) -> bool:
    """Detail a reader needs: why it fails, or the reason of a row with no
    divergence (fixed, not reproduced, unavailable); a known bug's id says enough."""
    return g["status"] in FAILING or not g["first"].get("divergence")


# --- the forms ----------------------------------------------------------------------------


def terminal(rep: dict[str, Any], *, save_dir: str | None = None, full: str | None = None,
             width: int | None = None, notes: list[str] | tuple[str, ...] = ()) -> str:
    """The verdict first, the worst rows last next to the closing verdict
    line, then rows not shown and ``notes`` (where the reports and findings
    went); each line cut at a word to ``width``, or whole without one (a CI
    log, where a cut line cannot be widened)."""
    repros = Repros(save_dir)
    lines = [_fit(headline(rep), width), _fit(_facts(rep), width)]
    broken = [f"{c['name']} BROKEN" for c in rep["selfcheck"] if c.get("broken")]
    if broken:
        lines.append(_fit("self-check: " + "; ".join(broken), width))
    lines += [_fit(line, width) for line in skipped_canaries(rep)]
    every, absent = _apart(groups(rep))
    lines += [_fit(_unavailable_line(g), width) for g in absent]  # what did not run here, beside the canaries
    room = max(MAX_ROWS - len(absent), 0)
    shown = every[:room]
    for g in reversed([g for g in shown if not misuse(g)]):  # the worst last, next to the verdict
        lines += _terminal_group(g, repros, width)
    if any(misuse(g) for g in shown):
        lines.append(_fit(MISUSE_HEADING + ":", width))
        for g in reversed([g for g in shown if misuse(g)]):
            lines += _terminal_group(g, repros, width)
    if len(every) > room:  # after the rows it counts the rest of
        lines.append(_fit(_overflow(every[room:], full), width))
    lines += [_fit(n, width) for n in notes]
    lines.append(verdict(rep))
    return "\n".join(lines)


def skipped_canaries(rep: dict[str, Any]) -> list[str]:
    """One line per reason the self-check skipped canaries for, naming
    them: why "13/21 caught" is not a loss of detection here (no CUDA, a
    stack not installed) and what would run the rest."""
    by_reason: dict[str, list[str]] = {}
    for c in rep.get("selfcheck") or []:
        if c.get("skipped"):
            by_reason.setdefault(one_line(c["skipped"]), []).append(c["name"])
    return [f"self-check skipped {len(names)} canar{'y' if len(names) == 1 else 'ies'} ({why}): {', '.join(names)}"
            for why, names in by_reason.items()]


def _apart(every: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The groups of rows, and apart from them the unavailable paths' (one
    per reason): those are always listed, beside the skipped canaries and
    within the row limit, never left in "… and N more rows", so "32
    unavailable" always comes with its reasons (a line per missing package
    or device)."""
    return [g for g in every if g["status"] != "unavailable"], [g for g in every if g["status"] == "unavailable"]


def _unavailable_line(g: dict[str, Any]) -> str:
    """The reason and every path it keeps out, on one line."""
    times = f" x{g['count']}" if g["count"] > 1 else ""
    return f"{label(g)}{times} ({scrub(g['first']['detail'])}): {', '.join(g['paths'])}"


def _terminal_group(g: dict[str, Any], repros: Repros, width: int | None) -> list[str]:
    r = g["first"]
    if g["status"] == "unavailable":
        return [_fit(_unavailable_line(g), width)]
    times = f" x{g['count']}" if g["count"] > 1 else ""
    ident = f" [{g['what']}]" if g["what"] else ""
    out = [_fit(f"{label(g)}{times}:{ident} on {_paths_text(g)}", width)]
    if _needs_repro(g):
        out.append(_indented(title(r) or "", width))
        link = repros(r)
        run = f"python {link}" if link and link.endswith(".py") else f"gradfuzz repro {link}" if link else None
        out.append(_indented(f"repro: {run or 'not saved (gate --save DIR)'}", width))
    if _shows_detail(g):
        out.append(_indented(scrub(r["detail"]), width))
        if r.get("upstream"):
            out.append(_indented(f"upstream: {r['upstream']}", width))
    return out


def _indented(text: str, width: int | None) -> str:
    return "    " + _fit(text, width - 4 if width else None)


def _fit(text: str, width: int | None) -> str:
    """``text`` on one line, cut at a word to ``width`` where there is one."""
    return shorten(text, width) if width else one_line(text)


def _cell(text: str, width: int = CELL) -> str:
    """A Markdown table cell: one line, no path of this machine, cut at a word, ``|`` escaped."""
    return shorten(scrub(text), width).replace("|", "\\|")


def _md_ident(g: dict[str, Any], repros: Repros) -> str:
    r = g["first"]
    if _needs_repro(g):
        link = repros(r)
        name = _cell(title(r) or g["what"], TITLE)
        head = f"[{name}]({link})" if link else f"{name} (repro not saved)"
        return head + (f"<br>`{g['what']}`" if g["what"] else "")
    ident = _cell(g["what"], TITLE)
    if ident and (r.get("upstream") or "").startswith("http"):
        ident = f"[{ident}]({r['upstream'].split()[0]})"
    return ident


def markdown(rep: dict[str, Any], *, save_dir: str | None = None, full: str | None = None,
             at: str | None = None) -> str:
    """The CI summary: the verdict first, then one table row per bug (at most
    ``MAX_ROWS``, the rest counted), each new finding titled and linked to its
    repro. ``at``: the file it is written to, so its links work from there
    (None: from the working directory, as in a CI step summary)."""
    repros = _LinkedFrom(save_dir, os.path.dirname(os.path.abspath(at)) if at else None)
    out = [
        f"## {'✅' if rep['passed'] else '❌'} gradfuzz gate {'PASSED' if rep['passed'] else 'FAILED'} on torch `{rep['torch']}`",
        "",
        f"**{headline(rep).split(': ', 1)[1]}.** {_facts(rep)}.",
        "",
        *[f"- {_cell(line, 2 * CELL)}" for line in skipped_canaries(rep)],
        *([""] if skipped_canaries(rep) else []),
        "| status | bug / finding | paths | detail |",
        "| --- | --- | --- | --- |",
    ]
    shown, absent = _apart(groups(rep))

    def table_row(g: dict[str, Any]) -> str:
        paths = ", ".join(f"`{p}`" for p in g["paths"][:4]) + (f" and {len(g['paths']) - 4} more" if len(g["paths"]) > 4 else "")
        return f"| {_cell(label(g))} | {_md_ident(g, repros)} | {paths} | {_cell(g['first']['detail'])} |"

    room = max(MAX_ROWS - len(absent), 0)  # the unavailable paths' rows always shown, within the limit
    out += [table_row(g) for g in shown[:room] if not misuse(g)] + [table_row(g) for g in absent]
    if any(misuse(g) for g in shown[:room]):
        out += ["", f"### {MISUSE_HEADING[0].upper()}{MISUSE_HEADING[1:]}", "",
                "| status | bug / finding | paths | detail |", "| --- | --- | --- | --- |"]
        out += [table_row(g) for g in shown[:room] if misuse(g)]
    if len(shown) > room:
        out += ["", _overflow(shown[room:], full, repros.base)]
    if any(_needs_repro(g) for g in shown):
        out += ["", "Each linked repro runs alone: `python FILE.py`, or `gradfuzz repro FILE.json` on this harness."]
    return "\n".join(out) + "\n"


def junit(rep: dict[str, Any], *, save_dir: str | None = None) -> str:
    """One test case per bug (or signature) and one per fuzzed path, so a CI
    test view lists what failed, not 70 rows; the verdict is the suite's first property."""
    repros = Repros(save_dir)
    suite = ET.Element("testsuite", name=f"gradfuzz gate (torch {rep['torch']})")
    props = ET.SubElement(suite, "properties")
    ET.SubElement(props, "property", name="verdict", value=headline(rep))
    failures = skipped = tests = 0
    for g in groups(rep):
        tests += 1
        r = g["first"]
        name = (title(r) if _needs_repro(g) else None) or f"{g['status']} {g['what'] or r['path']}"
        tc = ET.SubElement(suite, "testcase", classname=f"gradfuzz.{g['family']}{'.misuse' if misuse(g) else ''}",
                           name=name)
        detail = scrub(r["detail"])
        link = repros(r) if _needs_repro(g) else None
        body = f"{label(g)} x{g['count']} on {', '.join(g['paths'])}\n{detail}" + (
            f"\nrepro: {link}" if link else "")
        if g["status"] in FAILING:
            failures += 1
            ET.SubElement(tc, "failure", message=f"{label(g)}: {shorten(detail, 200)}").text = body
        elif g["status"] == "unavailable":
            skipped += 1
            ET.SubElement(tc, "skipped", message=shorten(f"{', '.join(g['paths'])}: {detail}", 300))
        else:
            ET.SubElement(tc, "system-out").text = body
    for name, n in sorted((rep.get("examples") or {}).items()):
        tests += 1
        ET.SubElement(ET.SubElement(suite, "testcase", classname=f"gradfuzz.{family(name)}", name=f"examples {name}"),
                      "system-out").text = f"{n} examples" + (
            f", {u} unjudged (a wrong grad would agree)" if (u := (rep.get("unjudged") or {}).get(name)) else "")
    suite.set("tests", str(tests))
    suite.set("failures", str(failures))
    suite.set("skipped", str(skipped))
    suite.set("errors", "0")
    return ET.tostring(suite, encoding="unicode")

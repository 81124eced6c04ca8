"""Gate reports people read: terminal, Markdown, JUnit XML, self-contained HTML.

The JSON record (``GateReport.to_json``) is the source; every other form is
rendered from it, so they cannot disagree. The HTML pictures need the
optional ``report`` extra (matplotlib); without it the page says so.
"""

from __future__ import annotations

import base64
import html
import io
import xml.etree.ElementTree as ET
from typing import Any

from harness.gate.status import FAILING, ORDER, STATUSES

STATUS_WORDS = {k: s.words for k, s in STATUSES.items()}


def _sorted(rows):
    return sorted(rows, key=lambda r: (ORDER.index(r["status"]), r["path"]))


def family(path: str) -> str:
    return path.split(".", 1)[0]


def groups(rep: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows grouped by (status, ledger bug or signature, path family), worst
    first: one line per bug and family however many paths and cases show
    it, with the count, the paths and one representative row."""
    out: dict[tuple[str, str, str], dict[str, Any]] = {}
    for r in _sorted(rep["rows"]):
        what = r["bug"] or (r["signature"] if r["status"] in ("new", "regression") else "") or ""
        key = (r["status"], what, family(r["path"]))
        g = out.setdefault(key, {"status": r["status"], "what": what, "family": key[2], "count": 0, "paths": [],
                                 "first": r})
        g["count"] += 1
        if r["path"] not in g["paths"]:
            g["paths"].append(r["path"])
    return list(out.values())


def _paths_text(g: dict[str, Any], most: int = 4) -> str:
    paths = g["paths"]
    return ", ".join(paths[:most]) + (f" and {len(paths) - most} more" if len(paths) > most else "")


def verdict(rep: dict[str, Any]) -> str:
    """The last line on the terminal, pytest style."""
    c = rep["counts"]
    parts = [f"{c[k]} {k.replace('_', ' ')}" for k in ORDER if c.get(k)]
    text = f" gradfuzz gate on torch {rep['torch']}: {'PASSED' if rep['passed'] else 'FAILED'} ({', '.join(parts) or 'nothing to report'}) in {rep['seconds']:.0f}s "
    return text.center(max(len(text) + 8, 79), "=")


def terminal(rep: dict[str, Any]) -> str:
    lines = []
    if rep["selfcheck"]:
        caught = [c for c in rep["selfcheck"] if c["caught"]]
        lines.append(f"self-check: {len(caught)}/{len(rep['selfcheck'])} canaries caught"
                     + "".join(f"; {c['name']} skipped ({c['skipped']})" for c in rep["selfcheck"] if c["skipped"])
                     + "".join(f"; {c['name']} BROKEN" for c in rep["selfcheck"] if c.get("broken")))
    ex = rep.get("examples") or {}
    if ex:
        lines.append(f"examples: {sum(ex.values())} over {len(ex)} paths")
    for g in reversed(groups(rep)):  # the worst last, next to the verdict
        r = g["first"]
        times = f" x{g['count']}" if g["count"] > 1 else ""
        ident = f" [{g['what']}]" if g["what"] else ""
        lines.append(f"{STATUS_WORDS[g['status']]}{times}: {g['family']}{ident} on {_paths_text(g)}")
        if g["status"] in (*FAILING, "fixed") or g["status"] == "known" and not g["what"]:
            lines.append(f"    {r['detail'][:400]}")
        if r.get("upstream") and g["status"] != "known":
            lines.append(f"    upstream: {r['upstream']}")
    lines.append(verdict(rep))
    return "\n".join(lines)


def markdown(rep: dict[str, Any]) -> str:
    c = rep["counts"]
    out = [
        f"## gradfuzz gate: {'✅ passed' if rep['passed'] else '❌ failed'} on torch `{rep['torch']}`",
        "",
        (f"{c['error']} harness errors, " if c.get("error") else "")
        + f"{c['new']} new, {c['regression']} regressions, {c['known']} known, {c['fixed']} fixed by this version, "
        f"{c['unavailable']} paths unavailable; self-check {sum(1 for s in rep['selfcheck'] if s['caught'])}"
        f"/{len(rep['selfcheck'])} canaries caught.",
        "",
        "| status | rows | family: paths | bug / signature | detail |",
        "| --- | --- | --- | --- | --- |",
    ]
    for g in groups(rep):
        r = g["first"]
        ident = g["what"]
        if ident and r.get("upstream", "").startswith("http"):
            ident = f"[{ident}]({r['upstream'].split()[0]})"
        detail = r["detail"].replace("|", "\\|").replace("\n", " ")[:300]
        out.append(f"| {STATUS_WORDS[g['status']]} | {g['count']} | {g['family']}: `{_paths_text(g)}` | {ident} | {detail} |")
    return "\n".join(out) + "\n"


def junit(rep: dict[str, Any]) -> str:
    """One test case per group of rows (status, bug or signature, family) and
    one per fuzzed path, so a CI test view lists what failed, not 70 rows."""
    suite = ET.Element("testsuite", name=f"gradfuzz gate (torch {rep['torch']})")
    failures = skipped = tests = 0
    for g in groups(rep):
        tests += 1
        r = g["first"]
        tc = ET.SubElement(suite, "testcase", classname=f"gradfuzz.{g['family']}",
                           name=f"{g['status']} {g['what'] or r['path']}")
        body = f"{STATUS_WORDS[g['status']]} x{g['count']} on {', '.join(g['paths'])}\n{r['detail']}"
        if g["status"] in FAILING:
            failures += 1
            ET.SubElement(tc, "failure", message=f"{STATUS_WORDS[g['status']]}: {r['detail'][:200]}").text = body
        elif g["status"] == "unavailable":
            skipped += 1
            ET.SubElement(tc, "skipped", message=f"{', '.join(g['paths'])}: {r['detail'][:300]}")
        else:
            ET.SubElement(tc, "system-out").text = body
    for name, n in sorted((rep.get("examples") or {}).items()):
        tests += 1
        ET.SubElement(ET.SubElement(suite, "testcase", classname=f"gradfuzz.{family(name)}", name=f"examples {name}"),
                      "system-out").text = f"{n} examples"
    suite.set("tests", str(tests))
    suite.set("failures", str(failures))
    suite.set("skipped", str(skipped))
    suite.set("errors", "0")
    return ET.tostring(suite, encoding="unicode")


def _heatmaps(row: dict[str, Any], path: Any) -> str:
    """Expected, actual and difference of the diverging grad, as one inline PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "<p><em>Install the <code>report</code> extra (matplotlib) for heatmaps.</em></p>"
    grads = _grads_for(row, path)
    if grads is None:
        return ""
    expected, actual = grads
    e2, a2 = (t.reshape(t.shape[0], -1) if t.dim() > 1 else t.reshape(1, -1) for t in (expected, actual))
    fig, axes = plt.subplots(1, 3, figsize=(9, 3))
    lim = float(max(e2.abs().max(), a2.abs().max(), 1e-12))
    for ax, (title, t, cmap, vlim) in zip(axes, [("expected", e2, "RdBu_r", lim), ("actual", a2, "RdBu_r", lim),
                                                  ("actual - expected", a2 - e2, "PuOr_r", float((a2 - e2).abs().max()) or 1.0)]):
        im = ax.imshow(t.numpy() if _has_numpy() else t.tolist(), cmap=cmap, vmin=-vlim, vmax=vlim)
        ax.set_title(title, fontsize=10)
        ax.set_xticks([])
        ax.set_yticks([])
        fig.colorbar(im, ax=ax, fraction=0.046)
    fig.suptitle(f"{row['path']}: grad of {row['divergence']['param']} after backward {row['divergence']['microbatch']}", fontsize=10)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return f'<img alt="heatmaps" src="data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}">'


def _has_numpy() -> bool:
    try:
        import numpy  # noqa: F401
    except ImportError:
        return False
    return True


def _grads_for(row: dict[str, Any], path: Any):
    """Re-run the case to get the two grads (reports store the case, not tensors)."""
    d = row.get("divergence") or {}
    if path is None or not row.get("case") or d.get("kind") != "value" or not d.get("param"):
        return None
    from harness.case.spec import Case
    from harness.engine.check import CaseCheck

    cc = CaseCheck(Case.from_json(row["case"]))
    try:
        obs = cc.observe(path)
        oracle = cc.oracle
    except Exception:
        return None
    k, name = d["microbatch"], d["param"]
    if k is None or k >= len(obs.steps):
        return None
    e, a = oracle.steps[k].grads.get(name), obs.steps[k].grads.get(name)
    if e is None or a is None or e.shape != a.shape:
        return None
    return e, a


def _resolve_quietly(name: str) -> list[Any]:
    from harness.paths import resolve

    try:
        return resolve(name)
    except Exception:
        return []


def html_page(rep: dict[str, Any]) -> str:
    from harness.out import repro
    from harness.paths import close_paths
    from harness.case.spec import Case

    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>gradfuzz gate</title><style>",
        "body{font-family:system-ui,sans-serif;margin:2em;max-width:1100px}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:4px 8px;font-size:13px;vertical-align:top}"
        ".new,.regression,.selfcheck,.error{background:#fdd}.fixed{background:#dfd}.known{background:#ffd}"
        "pre{background:#f6f6f6;padding:8px;overflow:auto;max-height:320px;font-size:12px}",
        "</style></head><body>",
        f"<h1>gradfuzz gate: {'passed' if rep['passed'] else 'FAILED'} on torch {html.escape(rep['torch'])}</h1>",
        "<p>" + ", ".join(f"{n} {html.escape(k.replace('_', ' '))}" for k, n in rep["counts"].items() if n)
        + f"; {sum((rep.get('examples') or {}).values())} examples over {len(rep.get('examples') or {})} paths;"
        f" {rep['seconds']:.0f}s</p>",
        "<table><tr><th>status</th><th>rows</th><th>family: paths</th><th>bug / signature</th><th>detail</th></tr>",
    ]
    # One section per group with a case to show: a known bug replayed from many
    # corpus cases would otherwise re-run (and plot) the same thing dozens of times.
    grouped = groups(rep)
    anchors = {id(g): f"d{i}" for i, g in enumerate(x for x in grouped if x["first"].get("case")
                                                     and x["first"].get("divergence"))}
    for g in grouped:
        r = g["first"]
        what = html.escape(g["what"])
        link = f"<a href='#{anchors[id(g)]}'>{what or 'details'}</a>" if id(g) in anchors else what
        parts.append(f"<tr class='{g['status']}'><td>{STATUS_WORDS[g['status']]}</td><td>{g['count']}</td>"
                     f"<td>{html.escape(g['family'])}: {html.escape(_paths_text(g))}</td><td>{link}</td>"
                     f"<td>{html.escape(r['detail'][:500])}</td></tr>")
    parts.append("</table>")
    paths: dict[str, Any] = {}
    try:
        for g in (g for g in grouped if id(g) in anchors):
            r = g["first"]
            name = r["path"]
            if name not in paths:
                paths[name] = next((p for p in _resolve_quietly(name) if p.name == name), None)
            path = paths[name]
            more = f" ({g['count']} rows on {', '.join(g['paths'])}; the first is shown)" if g["count"] > 1 else ""
            parts.append(f"<h2 id='{anchors[id(g)]}'>{html.escape(STATUS_WORDS[g['status']])}: {html.escape(name)} "
                         f"{html.escape(g['what'])}</h2><p>{html.escape(r['detail'])}{more}</p>")
            parts.append(_heatmaps(r, path))
            try:
                case = Case.from_json(r["case"])
                text = repro.script(case, name, path.repro(case), title=r["detail"][:120])
                parts.append("<details><summary>standalone repro script</summary><pre>" + html.escape(text) + "</pre></details>")
            except Exception as e:  # a report never dies for want of a script
                parts.append(f"<p>(no repro script: {html.escape(str(e))})</p>")
    finally:
        close_paths([p for p in paths.values() if p is not None])
    parts.append("</body></html>")
    return "\n".join(parts)

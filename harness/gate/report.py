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

STATUS_WORDS = {
    "new": "NEW divergence",
    "regression": "REGRESSION (known bug back on a version that had it fixed)",
    "selfcheck": "SELF-CHECK FAILED",
    "known": "known bug, expected on this version",
    "fixed": "known bug fixed by this version",
    "not_reproduced": "known bug not reproduced (ledger range may be too wide)",
    "unavailable": "path unavailable",
}
ORDER = ["selfcheck", "regression", "new", "fixed", "known", "not_reproduced", "unavailable"]


def _sorted(rows):
    return sorted(rows, key=lambda r: (ORDER.index(r["status"]), r["path"]))


def terminal(rep: dict[str, Any]) -> str:
    lines = [f"gradfuzz gate on torch {rep['torch']}: {'PASSED' if rep['passed'] else 'FAILED'} "
             f"({rep['seconds']:.0f}s, examples {rep['examples']})"]
    caught = [c for c in rep["selfcheck"] if c["caught"]]
    if rep["selfcheck"]:
        lines.append(f"  self-check: {len(caught)}/{len(rep['selfcheck'])} canaries caught"
                     + "".join(f"; {c['name']} skipped ({c['skipped']})" for c in rep["selfcheck"] if c["skipped"]))
    for r in _sorted(rep["rows"]):
        bug = f" [{r['bug']}]" if r["bug"] else (f" [{r['signature']}]" if r["signature"] else "")
        lines.append(f"  {STATUS_WORDS[r['status']]}: {r['path']}{bug}")
        lines.append(f"      {r['detail'][:400]}")
        if r.get("upstream"):
            lines.append(f"      upstream: {r['upstream']}")
    return "\n".join(lines)


def markdown(rep: dict[str, Any]) -> str:
    c = rep["counts"]
    out = [
        f"## gradfuzz gate: {'✅ passed' if rep['passed'] else '❌ failed'} on torch `{rep['torch']}`",
        "",
        f"{c['new']} new, {c['regression']} regressions, {c['known']} known, {c['fixed']} fixed by this version, "
        f"{c['unavailable']} paths unavailable; self-check {sum(1 for s in rep['selfcheck'] if s['caught'])}"
        f"/{len(rep['selfcheck'])} canaries caught.",
        "",
        "| status | path | bug / signature | detail |",
        "| --- | --- | --- | --- |",
    ]
    for r in _sorted(rep["rows"]):
        ident = r["bug"] or r["signature"] or ""
        if r.get("upstream", "").startswith("http"):
            ident = f"[{ident}]({r['upstream'].split()[0]})"
        detail = r["detail"].replace("|", "\\|").replace("\n", " ")[:300]
        out.append(f"| {STATUS_WORDS[r['status']]} | `{r['path']}` | {ident} | {detail} |")
    return "\n".join(out) + "\n"


def junit(rep: dict[str, Any]) -> str:
    """One test case per path and source (corpus case or fuzz target)."""
    suite = ET.Element("testsuite", name=f"gradfuzz gate (torch {rep['torch']})")
    cases: dict[tuple[str, str], list[dict]] = {}
    for r in rep["rows"]:
        cases.setdefault((r["path"], r["source"] or "path"), []).append(r)
    for name, n in rep["examples"].items():
        cases.setdefault((name, "fuzz"), [])
    failures = skipped = 0
    for (path, source), rows in sorted(cases.items()):
        tc = ET.SubElement(suite, "testcase", classname=f"gradfuzz.{path}", name=source)
        bad = [r for r in rows if r["status"] in ("new", "regression", "selfcheck")]
        if bad:
            failures += 1
            f = ET.SubElement(tc, "failure", message=f"{STATUS_WORDS[bad[0]['status']]}: {bad[0]['detail'][:200]}")
            f.text = "\n\n".join(f"{STATUS_WORDS[r['status']]} [{r['bug'] or r['signature']}]\n{r['detail']}" for r in bad)
        elif any(r["status"] == "unavailable" for r in rows):
            skipped += 1
            ET.SubElement(tc, "skipped", message=rows[0]["detail"][:300])
        elif rows:
            out = ET.SubElement(tc, "system-out")
            out.text = "\n".join(f"{STATUS_WORDS[r['status']]}: {r['bug'] or r['signature']}: {r['detail']}" for r in rows)
    suite.set("tests", str(len(cases)))
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
        ".new,.regression,.selfcheck{background:#fdd}.fixed{background:#dfd}.known{background:#ffd}"
        "pre{background:#f6f6f6;padding:8px;overflow:auto;max-height:320px;font-size:12px}",
        "</style></head><body>",
        f"<h1>gradfuzz gate: {'passed' if rep['passed'] else 'FAILED'} on torch {html.escape(rep['torch'])}</h1>",
        f"<p>{html.escape(str(rep['counts']))}; examples {html.escape(str(rep['examples']))}; {rep['seconds']:.0f}s</p>",
        "<table><tr><th>status</th><th>path</th><th>bug / signature</th><th>detail</th></tr>",
    ]
    for r in _sorted(rep["rows"]):
        parts.append(f"<tr class='{r['status']}'><td>{STATUS_WORDS[r['status']]}</td><td>{html.escape(r['path'])}</td>"
                     f"<td>{html.escape(r['bug'] or r['signature'] or '')}</td><td>{html.escape(r['detail'][:500])}</td></tr>")
    parts.append("</table>")
    # One section per distinct finding: a known bug replayed from many corpus
    # cases would otherwise re-run (and plot) the same thing dozens of times.
    sections: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in _sorted(rep["rows"]):
        if r.get("case") and r.get("divergence"):
            sections.setdefault((r["status"], r["path"], r["bug"] or r["signature"] or ""), []).append(r)
    paths: dict[str, Any] = {}
    try:
        for i, ((status, name, what), rows) in enumerate(sections.items()):
            r = rows[0]
            if name not in paths:
                paths[name] = next((p for p in _resolve_quietly(name) if p.name == name), None)
            path = paths[name]
            more = f" ({len(rows)} rows; the first is shown)" if len(rows) > 1 else ""
            parts.append(f"<h2 id='d{i}'>{html.escape(STATUS_WORDS[status])}: {html.escape(name)} "
                         f"{html.escape(what)}</h2><p>{html.escape(r['detail'])}{more}</p>")
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

"""The gate's self-contained HTML page: the verdict, the table, and per
shown group its grads as heatmaps and its standalone repro script.

Rendered from the JSON record as the other forms are
(``harness.gate.report``). The pictures need the optional ``report`` extra
(matplotlib); without it the page says so.
"""

from __future__ import annotations

import base64
import html
import io
from typing import Any

from harness.artifacts.text import scrub, shorten
from harness.gate.report import (MAX_ROWS, TITLE, Repros, _facts, _needs_repro, _overflow, _paths_text, groups,
                                 headline, label, title)
from harness.gate.status import FAILING


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


def html_page(rep: dict[str, Any], *, save_dir: str | None = None, full: str | None = None) -> str:
    """A self-contained page: the verdict first, the table (at most
    ``MAX_ROWS``), then a section per shown group with a case: heatmaps and
    the standalone repro script."""
    from harness.paths import close_paths

    repros = Repros(save_dir)
    grouped = groups(rep)
    shown = grouped[:MAX_ROWS]
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>gradfuzz gate</title><style>",
        "body{font-family:system-ui,sans-serif;margin:2em;max-width:1100px}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:4px 8px;font-size:13px;vertical-align:top}"
        ".fails{background:#fdd}.fixed{background:#dfd}.known{background:#ffd}"
        "pre{background:#f6f6f6;padding:8px;overflow:auto;max-height:320px;font-size:12px}",
        "</style></head><body>",
        f"<h1>gradfuzz gate {'PASSED' if rep['passed'] else 'FAILED'} on torch {html.escape(rep['torch'])}</h1>",
        f"<p><strong>{html.escape(headline(rep).split(': ', 1)[1])}.</strong> {html.escape(_facts(rep))}.</p>",
        "<table><tr><th>status</th><th>rows</th><th>paths</th><th>bug / finding</th><th>detail</th></tr>",
    ]
    # One section per group with a case to show: a known bug replayed from many
    # corpus cases would otherwise re-run (and plot) the same thing dozens of times.
    anchors = {id(g): f"d{i}" for i, g in enumerate(x for x in shown if x["first"].get("case")
                                                     and x["first"].get("divergence"))}
    for g in shown:
        parts.append(_html_row(g, anchors.get(id(g)), repros))
    parts.append("</table>")
    if len(grouped) > MAX_ROWS:
        parts.append(f"<p>{html.escape(_overflow(grouped[MAX_ROWS:], full))}</p>")
    paths: dict[str, Any] = {}
    try:
        for g in (g for g in shown if id(g) in anchors):
            parts += _html_section(g, anchors[id(g)], paths)
    finally:
        close_paths([p for p in paths.values() if p is not None])
    parts.append("</body></html>")
    return "\n".join(parts)


def _html_row(g: dict[str, Any], anchor: str | None, repros: Repros) -> str:
    r = g["first"]
    what = html.escape(shorten(scrub(title(r) or g["what"]) if _needs_repro(g) else g["what"], TITLE))
    cell = f"<a href='#{anchor}'>{what or 'details'}</a>" if anchor else what
    if _needs_repro(g):
        link = repros(r)
        cell += (f"<br>repro: <a href='{html.escape(link)}'>{html.escape(link)}</a>" if link
                 else "<br>repro not saved") + (f"<br><code>{html.escape(g['what'])}</code>" if g["what"] else "")
    css = f"{g['status']}{' fails' if g['status'] in FAILING else ''}"
    return (f"<tr class='{html.escape(css)}'><td>{html.escape(label(g))}</td><td>{g['count']}</td>"
            f"<td>{html.escape(_paths_text(g))}</td><td>{cell}</td>"
            f"<td>{html.escape(shorten(scrub(r['detail']), 500))}</td></tr>")


def _html_section(g: dict[str, Any], anchor: str, paths: dict[str, Any]) -> list[str]:
    from harness.case.spec import Case
    from harness.artifacts import repro

    r = g["first"]
    name = r["path"]
    if name not in paths:
        paths[name] = next((p for p in _resolve_quietly(name) if p.name == name), None)
    path = paths[name]
    more = f" ({g['count']} rows on {', '.join(g['paths'])}; the first is shown)" if g["count"] > 1 else ""
    out = [f"<h2 id='{anchor}'>{html.escape(label(g))}: {html.escape(name)} "
           f"{html.escape(g['what'])}</h2><p>{html.escape(scrub(r['detail']))}{html.escape(more)}</p>",
           _heatmaps(r, path)]
    try:
        case = Case.from_json(r["case"])
        text = scrub(repro.script(case, name, path.repro(case), title=title(r) or shorten(r["detail"], 120)))
        out.append("<details><summary>standalone repro script</summary><pre>" + html.escape(text) + "</pre></details>")
    except Exception as e:  # a report never dies for want of a script
        out.append(f"<p>(no repro script: {html.escape(scrub(str(e)))})</p>")
    return out

"""Findings saved as they happen: one corpus file per signature, never two.

Several fuzzers (xdist workers, or separate sessions) may write into one
corpus directory at once. Every update of a signature's file is a
read-modify-write under an exclusive ``flock`` on ``<dir>/.gradfuzz.lock``,
and the write itself is atomic (temp file and rename), so an interrupt at
any moment leaves either the old file or the new one, and two writers never
lose each other's counts. A signature found again bumps ``meta.count``; the
case kept is the smaller one (fewer nodes, parameters, backwards, ...), and
its standalone repro script is replaced with it.

Counts are kept per writer (``meta.counts``: writer id -> finds), and
``meta.count`` is their sum; merging takes the larger count per writer, so
merging the same source twice neither loses nor double-counts anything.
"""

from __future__ import annotations

import datetime
import fcntl
import hashlib
import json
import os
import socket
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
import pathlib
from typing import Any, Iterator

from harness.case import schema as sc
from harness.case.spec import Case
from harness.observation import Divergence
from harness.artifacts import corpus, repro
from harness.paths.base import Path, Repro

LOCK_NAME = ".gradfuzz.lock"
# Findings live outside the replayed corpus until someone files them (README "The corpus").
DEFAULT_DIR = os.path.join(".gradfuzz", "found")
_writer: tuple[int, str] | None = None


def writer_id() -> str:
    """This process's name in ``meta.counts`` (new after a fork)."""
    global _writer
    if _writer is None or _writer[0] != os.getpid():
        _writer = (os.getpid(), f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}")
    return _writer[1]


def case_size(case: Case) -> tuple[int, ...]:
    """Smaller is simpler: what a person has to read first, then tie-breaks."""
    s = case.schedule
    return (
        len(case.nodes),
        len(case.params),
        s.backwards,
        len(case.hooks) + len(case.retain_grad) + len(getattr(s, "events", ()) or ()),
        sum(len(p.shape) and _numel(p.shape) for p in case.params),
        len(json.dumps(case.to_json(), sort_keys=True)),
    )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


@contextmanager
def locked(directory: str | os.PathLike) -> Iterator[None]:
    """An exclusive lock over a corpus directory, released by the kernel if we die."""
    d = pathlib.Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    fd = os.open(d / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing drops the flock


@dataclass(frozen=True)
class Recorded:
    file: str
    new: bool  # first time this signature was saved here
    count: int  # times found, over every writer
    replaced: bool  # the new case was smaller and replaced the kept one


def record(directory: str | os.PathLike, signature: str, entry: corpus.Entry, script: str | None,
           counts: dict[str, int] | None = None, *, bump: bool = True) -> Recorded:
    """Save ``entry`` as ``<signature>.json`` (and its repro), or count one more find of it.

    ``counts`` (writer id -> finds) is given when merging a corpus that
    already counted its finds; by default this is one find by this process.
    ``bump=False``: the same find seen again (a fuzz target's seeded stream
    making a find its database replay already counted): the smaller case is
    kept, the count stays.
    """
    pathlib.Path(directory).mkdir(parents=True, exist_ok=True)
    target = sc.safe_target(directory, signature, ".json")  # inside ``directory``, never an importable name
    with locked(directory):
        old = _read(target)
        meta = {k: v for k, v in entry.meta.items() if k not in ("count", "counts")}
        now = _now()
        if old is None:
            c = _countable(_bounded(dict(counts) if counts is not None else {_key(writer_id()): 1}), target)
            meta.update(signature=signature, count=sum(c.values()), counts=c,
                        first_seen=entry.meta.get("first_seen", now), last_seen=entry.meta.get("last_seen", now))
            corpus.save(directory, signature, corpus.Entry(entry.case, meta), script)
            return Recorded(str(target), True, meta["count"], False)
        c = dict(old.meta.get("counts") or {"(before counts)": int(old.meta.get("count", 1))})
        if counts is None:
            me = _key(writer_id())
            c[me] = c.get(me, 0) + (1 if bump or me not in c else 0)
        else:
            for w, n in counts.items():
                w = _key(w)
                c[w] = max(c.get(w, 0), int(n))
        c = _countable(_bounded(c), target)
        keep_new = case_size(entry.case) < case_size(old.case)
        kept = meta if keep_new else {k: v for k, v in old.meta.items() if k not in ("count", "counts")}
        first_seen = min(filter(None, (old.meta.get("first_seen"), entry.meta.get("first_seen"), now)))
        last_seen = max(filter(None, (old.meta.get("last_seen"), entry.meta.get("last_seen"), now)))
        # Ledger fields written by people (known-bug expectations) survive a smaller case.
        for k in ("expect", "notes"):
            if k in old.meta and k not in kept:
                kept[k] = old.meta[k]
        kept.update(signature=signature, count=sum(c.values()), counts=c, first_seen=first_seen, last_seen=last_seen)
        case = entry.case if keep_new else old.case
        corpus.save(directory, signature, corpus.Entry(case, kept), script if keep_new else None)
        return Recorded(str(target), False, kept["count"], keep_new)


MAX_WRITERS = 4096  # the corpus schema's bound on meta.counts
MAX_KEY = 256  # ... and on each writer's name
EARLIER = "(earlier writers)"


def _key(writer: str) -> str:
    """A writer's name as ``meta.counts`` holds it: a merge names a source
    by its folder, which can be longer than a key may be (the same long name
    always gives the same short one, so merging twice still counts once)."""
    if len(writer) <= MAX_KEY:
        return writer
    return f"{writer[:MAX_KEY - 18]}~{hashlib.sha1(writer.encode()).hexdigest()[:16]}"


def _countable(c: dict[str, int], target: pathlib.Path) -> dict[str, int]:
    """Counts whose total the corpus schema reads back (at most 2**53, exact
    in a JSON reader's float): refused here, before writing, not later by
    the next reader of the file (merged counts of many writers once summed
    past it)."""
    total = sum(c.values())
    if total > corpus.MAX_COUNT:
        raise corpus.CorpusError(target, f"field meta.count: the merged counts sum to {total}; "
                                         f"a corpus file holds at most {corpus.MAX_COUNT}")
    return c


def _bounded(c: dict[str, int]) -> dict[str, int]:
    """Counts within the schema's bounds: every run adds a writer (a process),
    so a signature found by thousands of them folds the smallest counts into
    one ``(earlier writers)`` entry; the total stays."""
    short: dict[str, int] = {}
    for w, n in c.items():
        short[_key(w)] = max(short.get(_key(w), 0), n)
    c = short
    if len(c) <= MAX_WRITERS:
        return c
    kept = dict(sorted(((w, n) for w, n in c.items() if w != EARLIER), key=lambda wn: (-wn[1], wn[0]))[:MAX_WRITERS - 1])
    return {**kept, EARLIER: sum(c.values()) - sum(kept.values())}


def _read(target: pathlib.Path) -> corpus.Entry | None:
    if not target.exists():
        return None
    return corpus.load(target)  # a corrupt file is an error naming it, never overwritten silently


def merge(sources: list[str], into: str) -> dict[str, Any]:
    """Merge corpus directories (and Redis finding logs, ``redis://...``) into ``into``.

    Per-writer counts merge by maximum (so merging twice changes nothing)
    and the smaller case wins. Every source is read and checked whole
    before anything is written. Signatures are checked (the harness's own
    format, or a content hash for a hand-filed case) and repro scripts are
    generated here from the checked case, never copied: a script from
    another machine or from Redis is text from a stranger. Returns a summary.
    """
    from harness.artifacts import campaign

    items: list[tuple[str, str, corpus.Entry]] = []
    for src in sources:
        if src.startswith(("redis://", "rediss://", "unix://")):
            items += [(src, sig, e) for sig, e, _ in campaign.fetch_findings(src)]
        else:
            for f in corpus.discover([src]):
                e = corpus.load(f)
                items.append((src, e.meta.get("signature") or sc.case_signature(e.case.to_json()), e))
    merged: dict[str, int] = {}
    added = 0
    scripts = _ScriptMaker()
    for src, sig, e in items:
        found = e.meta.get("found_with", {}).get("path", "")
        script = scripts(e.case, found, e.meta.get("title", ""))
        counts = e.meta.get("counts") or {f"{src}:{sig}": int(e.meta.get("count", 1))}
        r = record(into, sig, e, script, counts=counts)
        added += r.new
        merged[sig] = r.count
    return {"into": into, "signatures": len(merged), "new": added, "counts": merged}


class _ScriptMaker:
    """Repro scripts for merged finds, with the machinery of the path that found
    them when this installation has it (paths are made once, on first need)."""

    def __init__(self) -> None:
        self.paths: dict[str, Any] | None = None

    def __call__(self, case: Case, path_name: str, title: str) -> str:
        if self.paths is None:
            from harness.paths import Options, all_paths

            try:
                self.paths = {p.name: p for p in all_paths(Options())}
            except Exception:  # no machinery here: a script with the oracle side only
                self.paths = {}
        p = self.paths.get(path_name)
        machinery = p.repro(case) if p is not None else Repro(
            template="none", why=f"path {path_name!r} is not installed here")
        return repro.script(case, path_name or "unknown path", machinery, title=title)


def save_finding(save_dir: str, path: Path, case: Case, divs: list[Divergence], source: str) -> str:
    """Save one finding, de-duplicated by signature (``harness.artifacts.findings``)."""
    entry, text = finding_entry(path, case, divs, source)
    return record(save_dir, divs[0].signature, entry, text).file


def finding_entry(path: Path, case: Case, divs: list[Divergence], source: str) -> tuple[corpus.Entry, str]:
    """A finding as a corpus entry and its standalone repro script."""
    import torch

    first = divs[0]
    meta = {
        "title": sc.to_line(f"{path.name}: {first.detail.split(';')[0]}"),  # one line (corpus schema)
        "source": source,
        "found_with": {"torch": torch.__version__, "path": path.name},
        "signature": first.signature,
        "flaky": any(d.flaky for d in divs),
        "finding_class": first.finding_class,  # misuse findings are listed apart (docs/reports.md)
        "divergences": _recorded(divs),
    }
    entry = corpus.Entry(case, meta)
    text = repro.script(case, path.name, path.repro(case), title=meta["title"])
    return entry, text


MAX_DETAIL = 4000  # characters of a divergence's text kept in the file (a hang report's stacks run longer)


def _recorded(divs: list[Divergence]) -> list[dict[str, Any]]:
    """Divergences as a finding's ``meta.divergences``: what the corpus schema
    reads back, whatever the divergence held. At most the schema's count (the
    first ones: the one the signature names comes first), and long texts cut
    so that the file stays far inside the corpus file's size limit."""
    out, size = [], 0
    for d in divs[:corpus.MAX_DIVERGENCES]:
        j = {k: v for k, v in d.to_json().items() if k != "case"}
        for k, v in j.items():
            if isinstance(v, str) and len(v) > MAX_DETAIL:
                j[k] = v[:MAX_DETAIL] + f" [... {len(v) - MAX_DETAIL} more characters]"
        size += len(json.dumps(j))
        if out and size > sc.MAX_CORPUS_BYTES // 4:  # escaped non-ASCII text is up to 12 bytes a character
            break
        out.append(j)
    return out

"""Progress people like to watch: a live ``rich`` display on a terminal,
plain periodic lines otherwise (CI logs).

A display reads *views* (``Session.snapshot()`` or the combination of
xdist workers' status files) from a callable, on its own thread, so the
fuzzing loop never waits for the terminal.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from typing import IO, Any, Callable

from harness.artifacts.text import one_line, scrub, shorten, unescaped

View = dict[str, Any]


def _clock(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def wanted(view: View) -> int:
    """The cases an examples budget comes to: ``planned`` where the front
    counted it before the run (every path of every target, fixed), else over
    the paths the view has met so far (0: no budget), a total that grows as
    workers start targets."""
    if view.get("planned"):
        return int(view["planned"])
    budget = view.get("examples_budget") or 0
    return sum(budget * int(t.get("per_example", 1)) for t in view.get("paths", {}).values())


ETA_AFTER = 0.2  # of a fixed total done before an ETA is shown: before that one slow step swings it by minutes
ETA_MIN_S = 5.0  # seconds of a count before an ETA: skipped steps first (canaries that cannot run) are instant


def eta(done: float, total: float, elapsed: float, fixed: bool = True) -> float | None:
    """Seconds left at the rate so far, or None where the figure would
    mislead: a total still growing (``fixed`` False), less than
    ``ETA_AFTER`` of it done (the first steps of a phase are its slowest:
    imports, the heaviest targets first) or under ``ETA_MIN_S`` spent, or
    nothing left to do."""
    if not fixed or total <= 0 or elapsed < ETA_MIN_S or not ETA_AFTER * total <= done < total:
        return None
    return elapsed / done * (total - done)


def fuzz_left(view: View, done: float, total: float, elapsed: float, fixed: bool = True) -> float | None:
    """Seconds left of an examples budget, target by target: each started
    target at its own rate, the ones not started at the median rate, the
    work shared by the workers but never ending before the slowest target's
    own remainder (a compile flavour or a two-rank schedule runs on one
    worker at a fraction of the others' rate, so the pooled rate, which the
    fast targets set, ends the phase too early). ``eta``'s gates apply.
    Where the view holds the last run's seconds per path (``history``),
    those are the unit of work instead (``_by_history``)."""
    if view.get("history"):
        return _by_history(view, view["history"], elapsed, fixed)
    pooled = eta(done, total, elapsed, fixed)
    if pooled is None:
        return None
    budget, paths = view.get("examples_budget"), view.get("paths", {})
    rates = sorted(t["seconds"] / t["examples"] for t in paths.values() if t.get("examples") and t.get("seconds"))
    if not budget or not rates:
        return pooled
    typical = rates[len(rates) // 2]
    wants = {n: budget * int(t.get("per_example", 1)) for n, t in paths.items()}
    own = [(t["seconds"] / t["examples"] if t.get("examples") and t.get("seconds") else typical)
           * (wants[n] - t.get("examples", 0)) for n, t in paths.items() if t.get("examples", 0) < wants[n]]
    unstarted = max(total - sum(wants.values()), 0) * typical
    workers = max(int(view.get("workers") or 1), 1)
    return max(pooled, (sum(own) + unstarted) / workers, max(own, default=0.0))


def _by_history(view: View, history: dict[str, float], elapsed: float, fixed: bool) -> float | None:
    """Seconds left where the last run of the same plan took ``history``
    seconds per path (``harness.artifacts.timings``): work counted in those
    seconds, a path done as far as its own seconds reach (all of it once its
    target ended), at the rate this run keeps; never before the slowest
    unfinished path's own remainder at this machine's pace."""
    paths = view.get("paths", {})
    done, rest, ran, took = 0.0, [0.0], 0.0, 0.0
    for name, before in history.items():
        t = paths.get(name, {})
        now = float(t.get("seconds") or 0.0)
        if t.get("finished"):
            done, ran, took = done + before, ran + before, took + now
        else:
            done += min(now, before)
            rest.append(max(before - now, 0.0))
    left = eta(done, sum(history.values()), elapsed, fixed)
    pace = took / ran if ran > 0 else 1.0  # this run's seconds per second of the last one
    return None if left is None else max(left, max(rest) * pace)


class Steady:
    """An ETA shown only while it holds: each estimate is compared with the
    end the one before it projected, and shown when the two agree (within a
    quarter of the time left, or ``SLACK_S``). Work that is not uniform (the
    replay's heavy compile pairs first, then thousands of light ones at
    once) gives estimates that disagree, and then none is printed: an ETA
    of 07:32 with 24 s to go is worse than no ETA."""

    SLACK_S = 10.0

    def __init__(self) -> None:
        self.total: float = -1
        self.end: float | None = None  # when the last estimate said the count would end

    def __call__(self, done: float, total: float, elapsed: float, now: float, fixed: bool = True,
                 view: View | None = None) -> float | None:
        if total != self.total:
            self.total, self.end = total, None
        left = eta(done, total, elapsed, fixed) if view is None else fuzz_left(view, done, total, elapsed, fixed)
        if left is None:
            return None
        before, self.end = self.end, now + left
        return left if before is not None and abs(self.end - before) <= max(self.SLACK_S, left / 4) else None


def summarize(view: View, steady: Steady | None = None) -> dict[str, Any]:
    """The numbers both displays show, from a view (``steady``: the display's
    ETA across views; without it, any estimate ``eta`` gives)."""
    now = view.get("now") or time.time()
    elapsed = now - view["started"]
    paths = view.get("paths", {})
    total = sum(t["examples"] for t in paths.values())
    left = None
    if view.get("deadline"):
        left = max(0.0, view["deadline"] - now)
    elif view.get("examples_budget") or view.get("planned"):
        fixed = bool(view.get("planned"))
        left = (steady(total, wanted(view), elapsed, now, fixed, view) if steady is not None
                else fuzz_left(view, total, wanted(view), elapsed, fixed))
    by_path: dict[str, int] = {}
    for sig, n in view.get("counts", {}).items():
        p = view.get("details", {}).get(sig, {}).get("path", "?")
        by_path[p] = by_path.get(p, 0) + 1
    return {"elapsed": elapsed, "left": left, "total": total, "rate": total / elapsed if elapsed > 0 else 0.0,
            "by_path": by_path, "signatures": len(view.get("counts", {})),
            "finds": sum(view.get("counts", {}).values())}


def line_width(stream: IO[str] | None = None) -> int | None:
    """Columns a line may take on ``stream`` (default stdout): a terminal's
    width, since a 2,000-character line wraps into a screenful nobody reads;
    ``$COLUMNS`` where set; else None, every line whole. A CI log has no
    width, and a line cut there loses its end (a bug id, a phase's time)
    for good: nobody can widen a log."""
    cols = os.environ.get("COLUMNS", "").strip()
    if cols.isdigit() and int(cols) > 0:
        return max(40, int(cols))
    stream = stream or sys.stdout
    try:
        if stream.isatty():
            return max(40, os.get_terminal_size(stream.fileno()).columns)
    except (AttributeError, ValueError, OSError):
        pass
    return None


def fit(line: str, width: int | None = None) -> str:
    """A progress line as shown: one line, no path of this machine, cut at a
    word to ``width`` (None: whole, as in a log; ``line_width`` says which)."""
    return shorten(scrub(line), width) if width else one_line(scrub(line))


def _listing(items: list[str], room: int) -> str:
    """As many of ``items`` as fit in ``room`` characters, the rest counted."""
    shown: list[str] = []
    for i, item in enumerate(items):
        more = f" (+{len(items) - i - 1} more)" if i < len(items) - 1 else ""
        if len(", ".join(shown + [item]) + more) > room:
            return ", ".join(shown) + f"{' ' if shown else ''}(+{len(items) - len(shown)} more)"
        shown.append(item)
    return ", ".join(shown)


def plain_line(view: View, width: int | None = None, steady: Steady | None = None) -> str:
    """The fuzz phase in one line within ``width``: time, done/total, ETA,
    finds; then the slowest paths first, as many as fit, the rest counted
    (no ``width``, a log line: the slowest within ``LOG_LISTING`` characters)."""
    s = summarize(view, steady)
    paths = view.get("paths", {})
    left = f", {_clock(s['left'])} left" if s["left"] is not None else ""
    workers = f", {view['workers']} workers" if view.get("workers", 1) > 1 else ""
    want = wanted(view)
    done = f"{s['total']}/{want}" if want else f"{s['total']}"
    # Nothing finished yet (workers importing torch, a first compile): say so, not "0/s".
    rate = f"({s['rate']:.0f}/s)" if s["total"] else "(none finished yet)"
    head = (f"gradfuzz [fuzz {_clock(s['elapsed'])}{left}{workers}] {done} examples {rate}; "
            f"{s['finds']} finds, {s['signatures']} distinct")
    speed = lambda t: t["examples"] / max(s["elapsed"], 1e-9)  # noqa: E731
    slowest = sorted(paths.items(), key=lambda kv: (speed(kv[1]), kv[0]))
    items = [f"{name} {t['examples']} ({speed(t):.0f}/s)" for name, t in slowest]
    room = (width - len(head) - len("; slowest: ")) if width else LOG_LISTING
    if not items or room < 20:
        return fit(head, width)
    return fit(f"{head}; slowest: {_listing(items, room)}", width)


LOG_LISTING = 200  # characters of a log line's list of the slowest paths: the few that matter, the rest counted

_COUNT = re.compile(r"^\[(?P<announce>phase\] )?(?P<phase>[a-z][\w-]*)[^\]\d]*?\b(?P<done>\d+)/(?P<total>\d+)")
# "[phase] NAME" with no D/N count: the line names its phase itself.
_PHASE = re.compile(r"^\[phase\] (?P<phase>[a-z][\w-]*)")
# An emitter's own estimate (", ~12s left", ", ~01:30 left"): PhaseLines gives the ETA, by one rule.
_OWN_ETA = re.compile(r",? ~(?:\d+s|\d+(?::\d\d)+) left")


class PhaseLines:
    """The gate's progress callback: every line names its phase (selfcheck,
    replay, fuzz), done/total where the emitter counted, an ETA once it is
    stable (``eta``: a fixed total, enough of it done; ``Steady``: the
    estimate agrees with the one before it), and fits the
    terminal. Emitters stay simple: this is the one place that knows how
    wide a line may be and when an estimate is worth printing.

    ``[NAME i/N]`` reports step i done; ``[phase] NAME ... i/N`` announces
    step i starting. A new total within a phase is a new count (the gate's
    replay counts pairs on its workers, then files): its ETA starts over."""

    def __init__(self, stream: IO[str] | None = None, verbose: bool = False, width: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = stream
        self.verbose = verbose
        self.width = width
        self.clock = clock
        self.phase = ""
        self.total = -1  # the current count's total
        self.since = clock()  # when the current count began (or the phase before it ended)
        self.steady = Steady()

    def line(self, text: str) -> str:
        """``text`` as shown: phase, count, ETA, width."""
        text = _OWN_ETA.sub("", text)
        m = _COUNT.match(text)
        if m is None and (named := _PHASE.match(text)):  # a phase that counts with no pace (the replay pool)
            self.phase, self.total, self.since = named["phase"], -1, self.clock()
            return fit(text, self._width())
        if m is None:
            return fit(f"[{self.phase}] {text}" if self.phase and not text.startswith(f"[{self.phase}") else text,
                       self._width())
        now = self.clock()
        done, total = int(m["done"]) - (1 if m["announce"] else 0), int(m["total"])
        if m["phase"] != self.phase or total != self.total:
            started = now if m["announce"] or m["phase"] == self.phase else self.since
            self.phase, self.total, self.since = m["phase"], total, started
            self.steady = Steady()
        left = self.steady(done, total, now - self.since, now) if int(m["done"]) < total else None
        if left is not None and left >= 1:  # "~00:00 left" says nothing
            text = f"{text[:m.end()]}, ~{_clock(left)} left{text[m.end():]}"
        self.since = self.since if done < total else now  # the next phase starts where this one ends
        return fit(text, self._width())

    def _width(self) -> int | None:
        return self.width if self.width is not None else line_width(self.stream or sys.stderr)

    def __call__(self, text: str) -> None:
        if text.startswith("[case]") and not self.verbose:
            return
        print(self.line(text), file=self.stream or sys.stderr, flush=True)


def render(view: View) -> Any:
    """The live display: one table per concern, refreshed a few times a second."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    s = summarize(view)
    head = Text.assemble(
        ("gradfuzz fuzz", "bold"),
        f"  {_clock(s['elapsed'])} elapsed",
        (f"  {_clock(s['left'])} left" if s["left"] is not None else "  time left: -"),
        f"  {view.get('workers', 1)} worker(s)",
        f"  {s['total']:,} examples, {s['rate']:.0f}/s",
        ("  INTERRUPTED: finishing" if view.get("stopping") else "", "bold red"),
    )
    paths = Table(box=None, pad_edge=False, header_style="bold", expand=False)
    for col, just in (("path", "left"), ("examples", "right"), ("ex/s", "right"), ("run", "right"),
                      ("outside contract", "right"), ("signatures", "right")):
        paths.add_column(col, justify=just)  # type: ignore[arg-type]
    for name, t in view.get("paths", {}).items():
        skipped = sum(t["skipped"].values())
        n = s["by_path"].get(name, 0)
        paths.add_row(name, f"{t['examples']:,}", f"{t['examples'] / max(s['elapsed'], 1e-9):.0f}", f"{t['run']:,}",
                      f"{skipped:,}", Text(str(n), style="bold red" if n else "green"))
    for name, why in view.get("unavailable", {}).items():
        paths.add_row(Text(name, style="dim"), "-", "-", "-", "-", Text(f"unavailable: {why[:60]}", style="dim"))
    parts: list[Any] = [head, paths]
    counts = view.get("counts", {})
    if counts:
        divs = Table(box=None, pad_edge=False, header_style="bold", title="divergences by signature",
                     title_justify="left")
        details_ = view.get("details", {})
        widest = lambda key: max([len(str(d.get(key, ""))) for d in details_.values()] + [4])  # noqa: E731
        for col, width in (("finds", 5), ("path", widest("path")), ("kind", widest("kind")),
                           ("signature", max(map(len, counts))), ("first at", 8)):
            divs.add_column(col, no_wrap=True, min_width=width)
        divs.add_column("detail", overflow="ellipsis", no_wrap=True, ratio=1, min_width=20)
        details = view.get("details", {})
        for sig, n in sorted(counts.items(), key=lambda kv: -kv[1]):
            d = details.get(sig, {})
            divs.add_row(str(n), d.get("path", ""), d.get("kind", ""), sig,
                         f"{d.get('examples', '?')} ex" if d.get("examples") is not None else "",
                         (d.get("detail", "") + (" FLAKY" if d.get("flaky") else ""))[:90])
        parts.append(divs)
    if view.get("saved"):
        parts.append(Text(f"saved {len(view['saved'])} corpus file(s), e.g. {view['saved'][-1]}", style="dim"))
    for e in view.get("errors", [])[-3:]:
        parts.append(Text(f"error: {e}", style="red"))
    return Group(*parts)


class Display:
    """Runs the chosen display on a thread until ``close()``.

    ``mode``: ``live`` (rich), ``plain`` (a line every ``every`` seconds,
    and one per new signature at once), or ``none``; ``auto`` picks live on
    a terminal and plain otherwise.
    """

    def __init__(self, source: Callable[[], View], mode: str = "auto", every: float = 10.0,
                 stream: IO[str] | None = None) -> None:
        out = stream or sys.stdout
        if mode == "auto":
            mode = "live" if out.isatty() else "plain"
        self.mode = mode
        self.source = source
        self.every = every
        self.stream = out if mode == "live" else (stream or sys.stderr)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._events: list[str] = []
        self._lock = threading.Lock()
        self._seen: set[str] = set()
        self._steady = Steady()
        self.stopping = False

    def event(self, line: str) -> None:
        """A one-off line (a new divergence, an unavailable path)."""
        if self.mode == "plain":
            print(fit(f"gradfuzz: {line}", line_width(self.stream)), file=self.stream, flush=True)
        elif self.mode == "live":
            with self._lock:
                self._events.append(line)

    def start(self) -> "Display":
        if self.mode in ("live", "plain"):
            self._thread = threading.Thread(target=self._live if self.mode == "live" else self._plain,
                                            name="gradfuzz-display", daemon=True)
            self._thread.start()
        return self

    def _view(self) -> View:
        v = self.source()
        v["stopping"] = self.stopping
        return v

    def _new_signatures(self, v: View) -> list[str]:
        """Lines for signatures first seen in this view; only for views read
        from worker status files (an in-process session reports through
        ``event`` as it saves)."""
        lines = []
        for sig in v.get("counts", {}):
            if sig not in self._seen:
                self._seen.add(sig)
                d = v.get("details", {}).get(sig, {})
                if v.get("from_status"):
                    where = f" -> {d['file']}" if d.get("file") else ""
                    lines.append(f"[{d.get('path')}] divergence {sig}: {d.get('detail', '')}{where}")
        return lines

    def _plain(self) -> None:
        next_line = time.monotonic() + self.every
        while not self._stop.wait(0.25):
            try:
                v = self._view()
            except Exception:
                continue
            for line in self._new_signatures(v):
                print(fit(f"gradfuzz: {line}", line_width(self.stream)), file=self.stream, flush=True)
            if time.monotonic() >= next_line:
                next_line += self.every
                print(plain_line(v, line_width(self.stream), self._steady), file=self.stream, flush=True)

    def _live(self) -> None:
        from rich.console import Console
        from rich.live import Live
        from rich.markup import escape

        console = Console(file=unescaped(self.stream))  # rich draws with escapes of its own
        v: View = {}
        with Live(console=console, refresh_per_second=4, transient=False) as live:
            while True:
                try:
                    v = self._view()
                    live.update(render(v))
                except Exception:
                    pass
                with self._lock:
                    events, self._events = self._events, []
                try:
                    events += self._new_signatures(v)
                except Exception:
                    pass
                for e in events:
                    live.console.print(f"[bold]gradfuzz:[/bold] {escape(e)}", markup=True, highlight=False)
                if self._stop.wait(0.25):
                    try:
                        live.update(render(self._view()))
                    except Exception:
                        pass
                    break

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.mode == "plain":
            try:
                # The closing line: the run is over, so no estimate (a fresh Steady shows none).
                print(plain_line(self._view(), line_width(self.stream), Steady()), file=self.stream, flush=True)
            except Exception:
                pass

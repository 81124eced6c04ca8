"""``gradfuzz versions CASE --package P``: over which releases of a training
stack a case diverges, as a range ready for the ledger.

Each release runs in its own venv, the ``stack`` session of ``noxfile.py``
(which also holds the release list, so there is one list); there the case is
replayed with ``gradfuzz versions CASE --here``. Installing a release costs
tens of seconds, so the releases are not all run: a few spread over the
list first, then a bisection of every stretch whose two ends disagree. The
one assumption, said in the output, is that a stretch whose ends agree has
no change inside it (``--all`` runs every release instead).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Callable

from packaging.version import InvalidVersion, Version

from harness.paths import UsageError

DIVERGES, AGREES, REFUSED, ABSENT, UNKNOWN = "diverges", "agrees", "refused", "absent", "unknown"
CLASSES = (DIVERGES, AGREES, REFUSED, ABSENT)
# A release the bug cannot be in: the case runs right, the stack refuses the
# use (raises or warns: the user was told), or the release lacks the drive.
NOT_AFFECTED = (AGREES, REFUSED, ABSENT)
SAMPLES = 4  # releases run before bisecting: the two ends and two between


def add_parser(sub: argparse._SubParsersAction) -> None:
    v = sub.add_parser("versions", help="bisect one corpus case over a training stack's releases (nox sessions)")
    v.add_argument("case", help="a corpus file")
    v.add_argument("--package", help="the stack's distribution (deepspeed, megatron-core, torchtitan): the "
                   "releases are noxfile.py's STACKS list for it")
    v.add_argument("--paths", help="paths to replay it on (default: the path it was found on)")
    v.add_argument("--releases", help="comma-separated releases to try, a part of noxfile.py's list (default: all of it)")
    v.add_argument("--all", action="store_true", help="run every release instead of bisecting")
    v.add_argument("--samples", type=int, default=SAMPLES, help="releases spread over the list run before bisecting "
                   "(default %(default)s; more finds a bug that lives only between two that agree)")
    v.add_argument("--nox", default=f"{sys.executable} -m nox", help="how to call nox (default: %(default)s)")
    v.add_argument("--timeout", type=float, default=900.0, help="seconds per release, install included (default 900)")
    v.add_argument("--here", action="store_true", help="no releases: replay on what is installed and print one JSON "
                   "line (what each release's session runs)")
    v.set_defaults(func=cmd_versions)


def cmd_versions(args: argparse.Namespace) -> int:
    if args.here:
        print(json.dumps(here(args.case, args.paths)))
        return 0
    if not args.package:
        raise UsageError("--package is needed (the stack whose releases to try), or --here")
    listed = from_nox(args.nox, args.package)
    if not listed:
        raise UsageError(f"noxfile.py lists no releases of {args.package!r} (STACKS): add them there")
    releases = _parse(args.releases.split(",")) if args.releases else listed
    if unknown := sorted(set(releases) - set(listed), key=Version):
        raise UsageError(f"--releases: {', '.join(unknown)} of {args.package} have no nox session (noxfile.py "
                         f"STACKS lists {', '.join(listed)}): add them there first")
    print(f"gradfuzz versions: {args.case} over {len(releases)} release(s) of {args.package}", file=sys.stderr)

    paths = args.paths or _found_on(args.case) or family_of(args.package)

    def outcome(release: str) -> str:
        got = in_session(args.nox, args.package, release, args.case, paths, args.timeout)
        print(f"  {args.package} {release}: {got}", file=sys.stderr)
        return got

    seen = {r: outcome(r) for r in releases} if args.all else bisect(releases, outcome, max(args.samples, 2))
    print(table(args.package, releases, seen))
    return 0


def _found_on(case: str) -> str | None:
    from harness.artifacts import corpus

    return corpus.load(case).meta.get("found_with", {}).get("path")


def family_of(package: str) -> str | None:
    """The family that tests ``package`` (its ``Family.package``): its paths are the default."""
    from harness.paths import families

    return next((f.name for f in families() if f.package == package), None)


def _parse(releases: list[str]) -> list[str]:
    try:
        return sorted((r.strip() for r in releases if r.strip()), key=Version)
    except InvalidVersion as e:
        raise UsageError(f"--releases: {e}") from None


def from_nox(nox: str, package: str) -> list[str]:
    """The releases of ``package`` that ``noxfile.py`` has a ``stack`` session for."""
    out = subprocess.run([*nox.split(), "-l", "--json"], capture_output=True, text=True, timeout=120)
    if out.returncode:
        raise UsageError(f"`{nox} -l --json` failed (run from the gradfuzz checkout, with nox installed): "
                         f"{out.stderr.strip()[-300:]}")
    sessions = json.loads(out.stdout)
    return _parse([s["call_spec"]["release"] for s in sessions
                   if s.get("name") == "stack" and s.get("call_spec", {}).get("package") == package])


def in_session(nox: str, package: str, release: str, case: str, paths: str | None, timeout: float) -> str:
    """Replay ``case`` in the nox session of one release: ``diverges``, ``agrees`` or why neither."""
    session = f"stack(package={package!r}, release={release!r})"
    cmd = [*nox.split(), "-s", session, "--", "-m", "harness", "versions", os.path.abspath(case), "--here"]
    cmd += ["--paths", paths] if paths else []
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"no answer: the session ran past {timeout:.0f} s"
    lines = [x for x in out.stdout.splitlines() if x.startswith("{")]
    if out.returncode or not lines:
        return f"no answer: the session failed ({(out.stderr.strip().splitlines() or ['exit %d' % out.returncode])[-1][:200]})"
    return verdict(json.loads(lines[-1]))


def here(case: str, paths: str | None) -> dict[str, str]:
    """Each path's outcome on ``case`` with what is installed here."""
    from harness.artifacts import corpus
    from harness.engine.check import CaseCheck
    from harness.paths import resolve

    entry = corpus.load(case)
    cc = CaseCheck(entry.case)
    out = {}
    for p in resolve(paths or _found_on(case) or None):
        a = p.availability()
        if not a.ok:
            out[p.name] = f"{ABSENT if a.absent else 'unavailable'}: {a.reason}"
        elif reason := p.supports(entry.case):
            out[p.name] = f"outside its contract: {reason}"
        else:
            divs = cc.run(p)
            refused = cc.seen[p.name].refused
            out[p.name] = f"{REFUSED}: {refused}" if refused else _outcome(divs)
    return out


def _outcome(divergences: list) -> str:
    """``agrees``, or ``diverges`` with the first finding (a timeout is not a wrong grad)."""
    if not divergences:
        return AGREES
    d = divergences[0]
    return f"{DIVERGES}: {d.kind} [{d.signature}] {' '.join(d.detail.split())[:160]}"


def verdict(per_path: dict[str, str]) -> str:
    """One release's outcome: diverges if any path does, agrees if all that
    ran agree; where none ran, refused or absent if a path says so (the
    stack told the user, or this release lacks the drive), else no answer."""
    classes = {k: outcome_class(v) for k, v in per_path.items()}
    ran = {k: v for k, v in per_path.items() if classes[k] in (DIVERGES, AGREES)}
    if not ran:
        said = set(classes.values()) - {UNKNOWN}
        word = REFUSED if REFUSED in said else ABSENT if said else "no answer"
        return f"{word}: " + "; ".join(f"{k} {v}" for k, v in per_path.items())[:300]
    hit = [f"{k}{v[len(DIVERGES):]}" for k, v in ran.items() if v != AGREES]
    return f"{DIVERGES} on {len(hit)} of {len(ran)} paths: {hit[0]}" if hit else AGREES


def outcome_class(outcome: str) -> str:
    """``diverges``, ``agrees``, ``refused``, ``absent`` or ``unknown``: what
    the bisection and the range look at."""
    word = outcome.split(" ")[0].rstrip(":")
    return word if word in CLASSES else UNKNOWN


def bisect(releases: list[str], outcome: Callable[[str], str], samples: int = SAMPLES) -> dict[str, str]:
    """Outcomes of the releases run: a spread first, then, between every two
    neighbours run that disagree, the middle, until they are adjacent."""
    n = len(releases)
    seen = {i: outcome(releases[i]) for i in sorted({round(k * (n - 1) / max(samples - 1, 1)) for k in range(samples)})}
    while True:
        run = sorted(seen)
        gaps = [(a, b) for a, b in zip(run, run[1:]) if b - a > 1 and outcome_class(seen[a]) != outcome_class(seen[b])]
        if not gaps:
            return {releases[i]: seen[i] for i in run}
        for a, b in gaps:
            seen[(a + b) // 2] = outcome(releases[(a + b) // 2])


def filled(releases: list[str], seen: dict[str, str]) -> dict[str, str]:
    """Every release's outcome: a release not run takes its run neighbours'
    outcome when they agree (the bisection's assumption), else stays unknown."""
    out, run = {}, [r for r in releases if r in seen]
    for r in releases:
        if r in seen:
            out[r] = seen[r]
            continue
        lo = [x for x in run if Version(x) < Version(r)]
        hi = [x for x in run if Version(x) > Version(r)]
        same = lo and hi and outcome_class(seen[lo[-1]]) == outcome_class(seen[hi[0]]) != UNKNOWN
        out[r] = f"{outcome_class(seen[lo[-1]])} (not run)" if same else f"{UNKNOWN} (not run)"
    return out


def specifier(releases: list[str], outcomes: dict[str, str]) -> str | None:
    """The affected range as a PEP 440 specifier: from the first diverging
    release to the last, open at an end the list reaches, with ``!=`` for
    each release inside that is not affected. None: no divergence, or an
    answer missing inside the stretch or at a border (where it starts or
    stops is not known)."""
    flags = [outcome_class(outcomes[r]) for r in releases]
    hit = [i for i, f in enumerate(flags) if f == DIVERGES]
    if not hit:
        return None
    lo, hi = hit[0], hit[-1]
    border = flags[lo - 1: lo] + flags[hi + 1: hi + 2]
    if any(f not in (DIVERGES, *NOT_AFFECTED) for f in flags[lo: hi + 1] + border):
        return None
    parts = [f">={releases[lo]}"] if lo > 0 else []
    parts += [f"!={releases[i]}" for i in range(lo, hi + 1) if flags[i] != DIVERGES]
    parts += [f"<{releases[hi + 1]}"] if hi + 1 < len(releases) else []
    return ",".join(parts)


def table(package: str, releases: list[str], seen: dict[str, str]) -> str:
    outcomes = filled(releases, seen)
    lines = [f"{package:<16} {r:<10} {outcomes[r]}" for r in releases]
    spec = specifier(releases, outcomes)
    if spec is None and any(o.startswith(DIVERGES) for o in outcomes.values()):
        lines.append("range: not known: a release without an answer lies inside the diverging stretch or borders it; "
                     "run the unknown releases (--releases, or --all)")
    elif spec is None:
        lines.append(f"range: none of the releases of {package} run diverges on this case")
    else:
        lines.append(f'range (for the ledger entry and meta.expect): "packages": {{"{package}": "{spec or ""}"}}'
                     + ("  (every release tried diverges)" if not spec else ""))
    if len(seen) < len(releases):
        lines.append(f"{len(seen)} of {len(releases)} releases run; a release marked (not run) was inferred from "
                     "its neighbours (run with --all to run each)")
    return "\n".join(lines)

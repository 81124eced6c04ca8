"""The gate's causal check for the findings of a fuzzing or replay session.

A signature match alone says only "resembles": coarse signatures are shared
by bugs of one path, and a second bug of the same shape would read as the
first. The gate settles it by running the case again with the bug's
workaround or fix probe in force; a person fuzzing locally should not need
the gate to tell a new bug from a known one. So a session ends by running
the same check once per distinct finding the ledger fits, within a time
budget, and says for each: known (and by what), known by signature only
(and why), or that the bug's own check leaves the case wrong (new).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from harness.gate import ledger as ledger_mod
from harness.gate.evidence import Evidence
from harness.gate.known import claim_new, claiming, confirm_known
from harness.gate.rows import Row, row_of
from harness.observation import Divergence
from harness.paths import Path

# What a confirmed row is called in a session's summary, by gate status.
WORDS = {"known": "known", "known_probe": "known (fix probe)", "known_signature_only": "known by signature only",
         "resembles": "NEW? resembles", "new": "NEW"}


@dataclass(frozen=True)
class Confirmed:
    status: str  # a gate row status: known, known_probe, known_signature_only, resembles
    bug: str
    note: str  # what the check did, as the gate says it

    def label(self) -> str:
        return f"{WORDS.get(self.status, self.status)} {self.bug}: {self.note}"


def confirm(divergences: Iterable[Divergence], paths: list[Path], ledger_file: str, seconds: float,
            progress: Callable[[str], None] = lambda s: None) -> tuple[dict[tuple[str, str], Confirmed], int]:
    """Per (path, signature) the ledger fits inside its range, or that a bug
    of its path claims by workaround (found known only when the workaround
    removes it), the gate's verdict, checked in the order found until
    ``seconds`` are spent; and how many were left unchecked for lack of time."""
    led = ledger_mod.load(ledger_file)
    version = torch.__version__.split("+")[0]
    by_name = {p.name: p for p in paths}
    todo: dict[tuple[str, str], Row] = {}
    for d in divergences:
        if d.case is None or d.path not in by_name:
            continue
        bug = led.match(d.path, d.signature, version=version)
        if bug is not None and bug.relation(version) == "in":
            todo.setdefault((d.path, d.signature), row_of("known", d, bug, "session"))
        elif bug is None and claiming(led, d.path, version):  # the gate's claim, as for a new row there
            todo.setdefault((d.path, d.signature), row_of("new", d, None, "session"))
    done: dict[tuple[str, str], Confirmed] = {}
    deadline = time.monotonic() + seconds
    for i, (key, row) in enumerate(todo.items()):
        if time.monotonic() >= deadline:
            return done, len(todo) - i
        progress(f"[confirm] {i + 1}/{len(todo)} {row.path} [{row.signature}]: running "
                 f"{row.bug or 'the claiming bugs'}'s check")
        before, rows = row.detail, [row]
        confirm_known(rows, [by_name[row.path]], Evidence(led, version), None)
        claim_new(rows, [by_name[row.path]], led, version, None)
        if row.status == "new":  # no claiming bug's workaround removed it: not in the ledger, as before
            continue
        done[key] = Confirmed(row.status, row.bug or "", row.detail[len(before) + 2:-1])
        for r in rows[1:]:  # a second bug the check exposed (the first one hid it)
            done.setdefault((r.path, r.signature or ""),
                            Confirmed("new", "", f"exposed by {row.bug}'s check: {r.detail}"))
    return done, 0

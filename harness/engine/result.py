"""What a fuzzing or replay run found: per-path tallies and the divergences."""

from __future__ import annotations

from dataclasses import dataclass, field

from harness.observation import Divergence


@dataclass
class Tally:
    examples: int = 0
    run: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    # Time to detection: examples and seconds until the first failing example
    # (before shrinking), from this path's cold start.
    first_hit_examples: int | None = None
    first_hit_seconds: float | None = None
    # Cases replayed from the example database (earlier runs' failures): run
    # apart from the seeded stream, so not part of ``examples``.
    replayed: int = 0
    # Cases per drawn example (``Contract.data_variants``): what a budget of N
    # examples comes to in ``examples``.
    per_example: int = 1
    # OpInfo ops (table keys) in the cases this path ran: the reach of a run,
    # read beside its examples (refused cases add none).
    ops: set[str] = field(default_factory=set)
    # Cases run (of ``run``) that tolerance mode cannot judge: a wrong
    # parameter grad would agree with the oracle (``values.blind_to``).
    # Never counted as passes.
    unjudged: int = 0
    # Shards of this path's target that have ended: from then on its
    # ``seconds`` are final (a progress estimate counts its work as done).
    finished: int = 0


@dataclass
class Result:
    paths: dict[str, Tally] = field(default_factory=dict)
    divergences: list[Divergence] = field(default_factory=list)
    unavailable: dict[str, str] = field(default_factory=dict)
    saved: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    expected: list[Divergence] = field(default_factory=list)  # known bugs on this torch

    @property
    def examples(self) -> int:
        return sum(t.examples for t in self.paths.values())

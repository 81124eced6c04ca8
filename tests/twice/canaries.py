"""The toy family's canary: a loop that never runs one part of its loss."""

from harness.paths import Canary
from tests.twice.paths import Twice


def canaries() -> list[Canary]:
    return [Canary("twice_forgets_half", lambda: Twice("canary.twice_forgets_half", forget=1), "twice.halves")]

"""The toy family's canary: a loop that runs only one of its two halves."""

from harness.paths import Canary
from tests.twice.path import Twice


def canaries() -> list[Canary]:
    return [Canary("twice_forgets_half", lambda: Twice("canary.twice_forgets_half", times=1), "twice.halves")]

"""``twice.*``: a toy family, added by following docs/adding-a-family.md.

Each microbatch's backward runs twice at half scale, as a loop that splits
its loss in two would. Registered like a third party's family, by one entry
point line (see test_twice.py), and nothing outside this folder knows it.
"""

from harness.paths import Family
from harness.paths.family import lazy

FAMILY = Family(
    "twice",
    paths=lazy("tests.twice.path:paths"),
    canaries=lazy("tests.twice.canaries:canaries"),
    docs="tests/twice/README.md",
)

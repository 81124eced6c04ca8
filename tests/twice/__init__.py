"""``twice.*``: a toy family, added by following docs/adding-a-family.md.

Each microbatch's backward runs once per part of the loss (2 or 4 parts,
the family's own part of the case), as a loop that splits its loss would. Registered like a third party's family, by one entry
point line (see test_twice.py), and nothing outside this folder knows it.
"""

from harness.paths import Family
from harness.paths.family import lazy
from tests.twice.data import CASE_DATA

FAMILY = Family(
    "twice",
    paths=lazy("tests.twice.paths:paths"),
    canaries=lazy("tests.twice.canaries:canaries"),
    case_data=CASE_DATA,
    docs="tests/twice/README.md",
    machinery=("torch.autograd",),
)

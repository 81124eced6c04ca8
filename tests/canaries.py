"""The canaries live in the package (``gradfuzz selfcheck`` needs them on
every installation); this name is kept for ``--split-impl tests.canaries:X``."""

from harness.canaries import *  # noqa: F401,F403
from harness.canaries import CANARIES, double_count_nested, drops_accumulated, loses_tied_site  # noqa: F401

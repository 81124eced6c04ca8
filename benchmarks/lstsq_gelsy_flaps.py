"""torch.linalg.lstsq's default CPU driver (gelsy) flaps on a rank-deficient system.

Torch only:  python benchmarks/lstsq_gelsy_flaps.py

Why gradfuzz cares: harness/compare/values.py (_explain, _explain_sites)
writes a wrong grad as a combination of per-backward grads with
torch.linalg.lstsq and puts the result's shape ("last backward repeated", or no
explanation and only a ratio class) into the divergence's signature. With a
microbatch of one row of small integers, a backward's own grad is often all
zero, the design matrix has a zero column, and gelsy (the CPU default) returns
one of two solutions depending on the heap (its JPVT workspace is allocated
uninitialized: pytorch#187411, pytorch#71222; measured here: flaps on the
2.11.0 and 2.13.0 wheels, stable on 2.14.1, which looks like the fix of
pytorch#187436). The same case then files under
two signatures from run to run: issue 33's split.stock-value-1d4244ecab
(cases/split/sign_flip_hook_chunk_cat_batch1.json shows split.stock-value-f44305131a
or -38a79323ac, split.twin-value-b2922c7c9a or -e1ee0bdc8c). gelsd (SVD) answers
the same every time. Below: the exact system of that case (g1 = 0, g2 = (0, -2),
actual (0, 2)).
Exit 1 when gelsy gave more than one answer.
"""
import sys
from collections import Counter

import torch

A = torch.tensor([[0.0, 0.0], [0.0, -2.0]])  # columns: backward 0's own grad (zero), backward 1's
y = torch.tensor([[0.0], [2.0]])  # the path's accumulated grad: -1 x g2
junk = []
print(f"torch {torch.__version__}")
flaps = False
for driver in (None, "gelsd"):
    seen = Counter()
    for i in range(200):
        junk.append(torch.randint(-9, 9, (i % 7 + 1,)))  # move the allocator around, as a fuzzing process does
        sol = torch.linalg.lstsq(A, y, driver=driver).solution.reshape(-1)
        seen[tuple(round(float(c), 3) for c in sol)] += 1
    print(f"  driver={driver or 'default (gelsy)'}: {dict(seen)}")
    flaps |= driver is None and len(seen) > 1
print("FLAPS: the explanation, and so the signature, depends on the heap" if flaps else "stable")
sys.exit(1 if flaps else 0)

"""How many drawn cases a path cannot take (redrawn by its target's filter, never run) and how many it runs.

    PYTHONPATH=. python benchmarks/contract_rate.py PATH EXAMPLES
"""
import sys
from harness.engine import target as T
from harness.engine.runner import Result
from harness.generate import cases
from harness.paths import resolve

name, n = sys.argv[1], int(sys.argv[2])
path = resolve(name)[0]
count = {"drawn": 0, "outside": 0}

real_cases = T.cases
def counted(**kw):
    def look(c):
        count["drawn"] += 1
        count["outside"] += path.supports(c) is not None
        return c
    return real_cases(**kw).map(look)
T.cases = counted
result = Result()
from harness.engine.runner import fuzz_path
fuzz_path(path, examples=n, deadline=None, seed=0, result=result, save_dir=None)
t = result.paths[path.name]
print(f"{name}: {t.examples} examples handed to the path, {t.run} run ({100 * (t.examples - t.run) / max(t.examples, 1):.1f}% "
      f"outside its contract); the filter saw {count['drawn']} drawn cases and redrew {count['outside']} "
      f"({100 * count['outside'] / max(count['drawn'], 1):.1f}%) before any path ran them")

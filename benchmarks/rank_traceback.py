"""Run one corpus case on one process-group path and print each rank's
traceback when it raises (``gradfuzz repro`` shows the first line only).

    python benchmarks/rank_traceback.py FILE PATH [BACKEND] [WORLD_SIZE]
"""
import sys

from harness.artifacts import corpus
from harness.paths import Options, resolve


def main() -> None:
    file, name = sys.argv[1], sys.argv[2]
    backend = sys.argv[3] if len(sys.argv) > 3 else None
    world = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    (path,) = resolve(name, Options(backend=backend, world_size=world))
    case = corpus.load(file).case
    print(f"{name} on {file}: supports -> {path.supports(case)}")
    obs = path.run(case)
    print("failure:", obs.failure)
    for rank, tb in sorted((obs.extra or {}).get("tracebacks", {}).items()):
        print(f"--- rank {rank} ---\n{tb}")


if __name__ == "__main__":  # the ranks start by forkserver on CUDA: they import this file
    main()

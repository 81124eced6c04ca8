"""Run as ``__main__`` in a child by the process tests: prints what the child
sees (argv, working directory, environment, import path, stdin) as one JSON
line, then ends as told: ``python -m tests.child_probe [SECONDS [STATUS]]``
sleeps SECONDS and exits with STATUS ("segv": kills itself with SIGSEGV)."""

import json
import os
import signal
import sys
import time

if __name__ == "__main__":
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 0.0
    status = sys.argv[2] if len(sys.argv) > 2 else "0"
    time.sleep(seconds)
    print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "slot": os.environ.get("GRADFUZZ_SLOT"),
                      "probe": os.environ.get("GRADFUZZ_PROBE"), "path": sys.path, "pid": os.getpid(),
                      "ppid": os.getppid(), "stdin": "" if sys.stdin is None or sys.stdin.isatty() else sys.stdin.read(),
                      "modules": "torch" in sys.modules,
                      "threads": sys.modules["torch"].get_num_threads() if "torch" in sys.modules else None}), flush=True)
    sys.stderr.write("probe stderr\n")
    if status == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    sys.exit(int(status))

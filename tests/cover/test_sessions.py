"""Fuzzing sessions as a user runs them: real ``gradfuzz`` processes, a real
``redis-server``, a real SIGINT, pytest-xdist workers."""

import json
import re
import os
import signal
import subprocess
import sys
import time
from typing import Any

from harness.artifacts import corpus
from tests.redis_server import redis_server

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CANARY = ["--paths", "split.stock", "--split-impl", "harness.paths.split.canaries:drops_accumulated", "--mode", "exact"]


def gradfuzz(*args, cwd, timeout=180):
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _corpus_is_consistent(directory):
    files = corpus.discover([directory])
    for f in files:
        e = corpus.load(f)  # parses, right version, valid case
        assert e.meta["count"] == sum(e.meta["counts"].values())
        assert os.path.exists(f[:-5] + ".py"), f"{f} has no repro script"
    return files


def test_two_fuzzers_share_one_redis_and_the_second_replays_the_first_failure_first(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    with redis_server(tmp_path) as url:
        r1 = gradfuzz("fuzz", *CANARY, "--examples", "40", "--seed", "1", "--db", url, "--json", "r.json",
                      "--progress", "none", cwd=a)
        assert r1.returncode == 1, r1.stdout + r1.stderr
        first = json.loads((a / "r.json").read_text())["findings"]
        assert first
        # A separate working directory, a different seed: only Redis connects them.
        r2 = gradfuzz("fuzz", *CANARY, "--examples", "40", "--seed", "7", "--db", url, "--json", "r.json",
                      "--progress", "none", cwd=b)
        assert r2.returncode == 1, r2.stdout + r2.stderr
        second = json.loads((b / "r.json").read_text())["findings"]
        assert set(first) <= set(second)
        # The second machine replayed the first's failures from Redis before it drew a case of its own.
        assert all(second[s].get("replayed") for s in first), second
        # The same shrunk case on both machines.
        for sig in first:
            assert (corpus.load(a / ".gradfuzz" / "found" / f"{sig}.json").case
                    == corpus.load(b / ".gradfuzz" / "found" / f"{sig}.json").case)
        # One command merges the campaign's findings (the Redis log) into one corpus.
        m = gradfuzz("merge", url, "--into", "merged", cwd=tmp_path)
        assert m.returncode == 0, m.stdout + m.stderr
        for sig in first:
            assert corpus.load(tmp_path / "merged" / f"{sig}.json").meta["count"] == 2
    _corpus_is_consistent(tmp_path / "merged")


def test_sigint_stops_prints_the_summary_writes_json_and_leaves_the_corpus_intact(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.Popen(
        [sys.executable, "-m", "harness", "fuzz", "--paths", "split", "--minutes", "5", "--db", "db",
         "--save", "found", "--json", "r.json", "--progress", "plain", "--progress-every", "0.5"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not list((tmp_path / "found").glob("*.json")):  # at least one finding saved
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no finding within 120s"
            time.sleep(0.2)
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out + err
    assert "INTERRUPTED; so far fuzzed" in out and "split.stock" in out and "saved" in out
    assert "gradfuzz [" in err  # the plain progress lines (stdout is not a terminal)
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["interrupted"] is True and data["examples"] > 0 and data["divergences"]
    files = _corpus_is_consistent(tmp_path / "found")
    assert sorted(os.path.basename(f) for f in files) == sorted(os.path.basename(f) for f in data["saved"])


def test_n2_runs_on_two_xdist_workers_with_plain_progress_lines(tmp_path):
    r = gradfuzz("fuzz", "-n", "2", "--paths", "split,graphed", "--examples", "80", "--seed", "3", "--db", "none",
                 "--save", "found", "--json", "r.json", "--progress-every", "1", cwd=tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["workers"] == 2
    # two shards of 40 cases each; each case goes to split.stock, then (unless stock diverged) split.fixed
    assert data["paths"]["split.stock"]["examples"] >= 80 and data["paths"]["split.fixed"]["run"] >= 60
    assert any(d["path"] == "split.stock" for d in data["divergences"])
    assert "graphed.stock" in data["unavailable"] or "graphed.stock" in data["paths"]
    assert "gradfuzz [" in r.stderr and "workers" in r.stderr
    assert "divergence split.stock-" in r.stderr  # new signatures are announced as workers save them
    _corpus_is_consistent(tmp_path / "found")


def _one_core() -> None:
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


def test_more_workers_than_cores_on_the_process_group_paths_share_their_files(tmp_path):
    """``gate -n 16`` on 16 cores ended in a harness error in the
    ddp/fsdp2 fuzz shard. Two xdist workers, each with its own two-rank
    process group, on one core, two shards of one target writing into one
    findings folder, one example database and one run folder: no harness
    error, and every file gradfuzz wrote loads back (the findings through
    the corpus schema, the status files through the controller)."""
    # A wall-clock budget: a hanging case (fsdp2's clip over an empty shard) costs a timeout per run.
    r = subprocess.run([sys.executable, "-m", "harness", "fuzz", "-n", "2", "--shards", "2", "--paths", "ddp,fsdp2",
                        "--minutes", "0.2", "--seed", "0", "--timeout", "15", "--db", "db", "--save", "found",
                        "--json", "r.json", "--progress", "none", "--keep-run-dir"],
                       cwd=tmp_path, env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True,
                       timeout=170, preexec_fn=_one_core)
    assert r.returncode in (0, 1), r.stdout + r.stderr
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["workers"] == 2 and not data.get("errors"), data.get("errors")
    # A harness error is a summary line "error: ..." (a finding's detail may
    # quote one, e.g. a rank's "Fatal Python error: Segmentation fault").
    assert not re.search(r"^(gradfuzz: )?error:", r.stdout + r.stderr, re.M), r.stdout
    assert data["paths"]["ddp.stock"]["examples"] >= 2 and data["paths"]["fsdp2.stock"]["examples"] > 0
    files = _corpus_is_consistent(tmp_path / "found") if (tmp_path / "found").exists() else []
    assert sorted(files) == sorted(data["saved"])
    for d in data["divergences"]:
        assert d["microbatch"] is None or d["microbatch"] >= 0, d
    (run_dir,) = (tmp_path / ".gradfuzz" / "runs").iterdir()
    statuses = [json.loads(f.read_text()) for f in run_dir.glob("status-*.json")]
    assert len(statuses) == 2 and all(s["done"] and not s["errors"] for s in statuses)


def test_pytest_plugin_adds_fuzz_targets_replay_items_and_skips_unavailable_paths(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    cases = tmp_path / "corpus"
    cases.mkdir()
    src = os.path.join(ROOT, "cases", "split", "nested_weight_double_count.json")
    (cases / "nested.json").write_text(open(src).read())
    env = {**os.environ, "PYTHONPATH": ROOT}
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "-rs", "-v",
         "--gradfuzz-paths=split.fixed,graphed.stock", "--gradfuzz-examples=40", "--gradfuzz-db=none",
         f"--gradfuzz-corpus={cases}", "--gradfuzz-save=found", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "PASSED gradfuzz::fuzz[split.fixed-shard0]" in out and "PASSED gradfuzz::fuzz[split.fixed-shard1]" in out
    assert "[gw0]" in out and "[gw1]" in out
    assert "PASSED gradfuzz::replay[split.fixed::corpus/nested.json]" in out
    assert "SKIPPED gradfuzz::fuzz[graphed.stock]" in out and "graphed.stock unavailable here" in out


def test_pytest_plugin_items_are_plain_hypothesis_tests():
    """What a driver of Hypothesis tests (HypoFuzz) needs: a pytest.Function whose obj is @given."""
    from harness.paths import resolve
    from harness.engine.target import Target

    test = Target(resolve("split.fixed"), exact=True).plain_test(max_examples=5)
    assert getattr(test, "is_hypothesis_test", False)
    test()  # split.fixed agrees with the oracle: passes as a plain Hypothesis test


def test_shards_are_planned_shard_by_shard_heaviest_target_first():
    """With S shards on S workers, the first S items must not all be the
    heaviest target's: every target's shard 0 comes before any shard 1."""
    from harness.engine.session import plan
    from harness.paths import heaviness, resolve

    paths = resolve("split.fixed,ddp.fixed,compile.aot_eager")
    targets = plan(paths, exact=None, seed=0, shards=3)
    order = [(t.shard, t.paths[0].name) for t in targets]
    assert [s for s, _ in order] == [0, 0, 0, 1, 1, 1, 2, 2, 2], order
    names = [n for _, n in order[:3]]
    assert names == sorted(names, key=lambda n: -heaviness(next(p for p in paths if p.name == n))), names
    assert names[0] == "compile.aot_eager"


def test_targets_whose_paths_run_in_children_get_fewer_shards_of_a_small_budget():
    """-n 16 with 20 examples: a compile shard of one example started six
    children that compiled cold (and, on torch 2.11, queued for Inductor's
    ISA probe behind every other); in-process targets keep one per worker,
    and the shards of a target still split exactly its budget."""
    from harness.engine.session import plan
    from harness.paths import CHILD_SHARD_EXAMPLES, resolve

    paths = resolve("split.fixed,compile.aot_eager")
    targets = plan(paths, exact=None, seed=0, shards=16, examples=20)
    by_name: dict[str, list] = {}
    for t in targets:
        by_name.setdefault(t.name, []).append(t)
    assert len(by_name["split.fixed"]) == 16
    assert len(by_name["compile.aot_eager"]) == 20 // CHILD_SHARD_EXAMPLES
    for ts in by_name.values():
        assert {t.shards for t in ts} == {len(ts)}
        assert sorted(t.shard for t in ts) == list(range(len(ts)))
    assert len(plan(paths, exact=None, seed=0, shards=16, examples=2)) == 17  # one compile shard, never none
    assert len(plan(paths, exact=None, seed=0, shards=16)) == 32  # a time budget keeps every shard


def test_a_worker_running_two_shards_of_a_target_adds_their_seconds():
    from harness.engine.result import Result
    from harness.engine.target import Target, TargetRun
    from harness.paths import resolve

    result = Result()
    for shard in (0, 1):
        TargetRun(Target(resolve("split.fixed"), exact=True, shard=shard, shards=2), result, examples=3).run()
        if shard == 0:
            first = result.paths["split.fixed"].seconds
    assert first > 0
    assert result.paths["split.fixed"].seconds > first


def test_first_round_queues_light_items_behind_light_ones():
    """A worker runs an item only once its successor is queued: xdist's
    round-robin put the 17th of 19 targets (a light one) behind the
    heaviest, where it waited minutes while other workers idled."""
    from harness.pytest_plugin import first_round

    for n, w in [(19, 16), (55, 16), (16, 16), (3, 16), (5, 2), (0, 2)]:
        rounds, pending = first_round(n, w)
        assert sorted([i for r in rounds for i in r] + pending) == list(range(n))
        assert [r[0] for r in rounds] == list(range(min(n, w)))  # heaviest first, one per worker
        if n >= 2 * w:
            assert all(len(r) == 2 for r in rounds)  # every worker can start
        else:
            assert pending == []  # all sent: the scheduler shuts the workers down, so each starts
    rounds, _ = first_round(19, 16)
    assert [r[1:] for r in rounds[:13]] == [[]] * 13
    assert [r[1] for r in rounds[13:]] == [18, 17, 16]


def _simulate(costs: list[float], workers: int) -> tuple[float, list[list[int]]]:
    """The gate's fuzz scheduler run against fake workers: each runs its
    queued items in order; returns when the last one ends, and what each ran."""
    import heapq

    from harness.pytest_plugin import _shard_scheduling

    class Node:
        shutting_down = False

        def __init__(self, i: int) -> None:
            self.i, self.queue = i, []
            self.gateway = type("Gateway", (), {"id": f"gw{i}"})()

        def send_runtest_some(self, items: list[int]) -> None:
            self.queue.extend(items)

        def shutdown(self) -> None:
            self.shutting_down = True

    class Config:
        def getvalue(self, name: str) -> Any:
            return [f"{workers}*popen"]

        def getoption(self, name: str) -> Any:
            return None

    sched = _shard_scheduling()(Config())
    nodes = [Node(i) for i in range(workers)]
    for n in nodes:
        sched.add_node(n)
    for n in nodes:
        sched.add_node_collection(n, [f"item{i}" for i in range(len(costs))])
    sched.schedule()
    ran: list[list[int]] = [[] for _ in nodes]
    clock = [(0.0, n.i) for n in nodes]
    end = 0.0
    while clock:
        t, i = heapq.heappop(clock)
        node = nodes[i]
        if not node.queue:
            end = max(end, t)
            continue
        item = node.queue[0]
        ran[i].append(item)
        t += costs[item]
        node.queue.pop(0)
        sched.mark_test_complete(node, item, duration=costs[item])
        heapq.heappush(clock, (t, i))
    return end, ran


def test_the_fuzz_scheduler_hands_out_one_item_at_a_time():
    """Targets heaviest first, then many light ones: xdist's refill sent a
    worker up to half of its share at once, so the four heaviest queued on
    one worker (the README gate's fuzz phase: 532 s on one worker, 342 s on
    the other). One item at a time, the two end within the lightest items."""
    costs = [246.0, 148.0, 87.0, 66.0, 59.0, 46.0, 34.0, 32.0, 28.0, 26.0] + [4.0] * 30
    end, ran = _simulate(costs, 2)
    assert sorted(i for r in ran for i in r) == list(range(len(costs)))
    assert end <= sum(costs) / 2 + max(costs[10:]) + 1, (end, ran)
    assert {0, 1} & set(ran[0]) and {0, 1} & set(ran[1])  # the two heaviest on two workers


def test_compile_flavours_are_planned_by_their_cost():
    from harness.engine.session import plan
    from harness.paths import resolve

    names = [t.name for t in plan(resolve("compile"), exact=None, seed=0)]
    avail = ["compile.dynamic.symbolic", "compile.autograd", "compile.inductor",
             "compile.autograd.eager_forward", "compile.dynamic.recompile", "compile.aot_eager"]
    assert [n for n in names if n in avail] == avail, names

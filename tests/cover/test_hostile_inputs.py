"""Corpus files, ledgers, gate reports and Redis items are input from strangers.

The loaders are fuzzed with Hypothesis (arbitrary JSON, arbitrary bytes, and
valid files with one part replaced by arbitrary JSON): each returns a valid
object or raises its one input error type, in bounded time. Generated repro
scripts are parsed and compared with the template: hostile text changes
constants, never code. Names that become files are refused unless they are
signatures written inside the target folder.
"""

from __future__ import annotations

import ast
import copy
import json
import os
import signal
import time

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from harness.paths.dtensor.data import Machinery as DTensorMachinery
from harness.paths.pipeline.data import Machinery as PipelineMachinery
from harness.case import schema
from harness.case.spec import Case, SpecError
from harness.gate import ledger
from harness.artifacts import corpus, findings, repro
from harness.materialize.source import checked
from harness.paths.base import Repro
from tests.redis_server import redis_server

CASE_FILE = "cases/split/nested_weight_double_count.json"
LEDGER_FILE = "cases/ledger.json"

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20)
    | st.sampled_from(["", "no", "false", "1", "class", "../x", "split.stock", "<2.13", "float32", "matmul", "w0", "n0"]),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=12) | st.sampled_from(
        ["case", "meta", "params", "nodes", "shape", "name", "op", "args", "ref", "version", "gradfuzz_corpus",
         "gradfuzz_ledger", "bugs", "id", "path", "torch", "rows", "status", "schedule", "hooks", "factor"]), kids, max_size=5),
    max_leaves=20,
)


def _paths(doc, prefix=()):
    """Every position in a JSON document, as key tuples."""
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, prefix + (i,))


def _replace(doc, where, value):
    doc = copy.deepcopy(doc)
    if not where:
        return value
    cur = doc
    for k in where[:-1]:
        cur = cur[k]
    cur[where[-1]] = value
    return doc


@st.composite
def mutated(draw, base):
    """``base`` with one position replaced by arbitrary JSON (or deleted)."""
    positions = list(_paths(base))
    where = draw(st.sampled_from(positions))
    if where and draw(st.integers(0, 4)) == 0:
        doc = copy.deepcopy(base)
        cur = doc
        for k in where[:-1]:
            cur = cur[k]
        del cur[where[-1]]
        return doc
    return _replace(base, where, draw(json_values))


BASE_ENTRY = json.load(open(CASE_FILE))
BASE_LEDGER = json.load(open(LEDGER_FILE))
BASE_LEDGER = {**BASE_LEDGER, "bugs": BASE_LEDGER["bugs"][:2]}
BASE_REPORT = {"schema": 1, "torch": "2.13.0", "passed": True, "rows": [
    {"status": "known", "path": "split.stock", "detail": "d", "bug": "b", "signature": "split.stock-value-0123456789",
     "source": "fuzz", "case": None, "divergence": None, "upstream": ""}]}
FAST = settings(max_examples=300, deadline=2000, suppress_health_check=list(HealthCheck), database=None)
counts: dict[str, int] = {}


def _bounded(fn, what):
    counts[what] = counts.get(what, 0) + 1
    start = time.monotonic()
    try:
        return fn()
    finally:
        assert time.monotonic() - start < 2.0, f"{what} took {time.monotonic() - start:.1f}s"


def check_corpus(data):
    try:
        e = _bounded(lambda: corpus.from_json(data, "hostile.json"), "corpus")
    except corpus.CorpusError as err:
        assert "hostile.json" in str(err)
        return
    assert isinstance(e.case, Case)
    assert Case.from_json(e.case.to_json()) == e.case  # what loads, round-trips
    checked(e.case)


def check_ledger(data):
    try:
        led = _bounded(lambda: ledger.from_json(data, "hostile-ledger.json"), "ledger")
    except corpus.CorpusError as err:
        assert "hostile-ledger.json" in str(err)
        return
    for b in led.sites:
        assert all(isinstance(c, str) and ".." not in c for c in b.cases)
        b.relation("2.13.0")


def check_report(data):
    try:
        rep = _bounded(lambda: ledger.report_from_json(data, "report.json"), "report")
    except corpus.CorpusError as err:
        assert "report.json" in str(err)
        return
    from harness.gate.versions import table

    table([rep])


@FAST
@given(mutated(BASE_ENTRY))
def test_corpus_loader_mutations(data):
    check_corpus(data)


@FAST
@given(json_values)
def test_loaders_on_arbitrary_json(data):
    check_corpus(data)
    check_ledger(data)
    check_report(data)
    try:
        Case.from_json(data)
    except SpecError:
        pass


@FAST
@given(mutated(BASE_LEDGER))
def test_ledger_loader_mutations(data):
    check_ledger(data)


@FAST
@given(mutated(BASE_REPORT))
def test_report_loader_mutations(data):
    check_report(data)


@settings(max_examples=200, deadline=2000, suppress_health_check=list(HealthCheck), database=None)
@given(st.binary(max_size=200) | st.binary(max_size=50).map(lambda b: json.dumps(BASE_ENTRY).encode()[:400] + b))
def test_loaders_on_arbitrary_bytes(tmp_path_factory, raw):
    f = tmp_path_factory.mktemp("b") / "bytes.json"
    f.write_bytes(raw)
    for load in (corpus.load, ledger.load, ledger.load_report):
        try:
            _bounded(lambda: load(str(f)), "bytes")
        except corpus.CorpusError as err:
            assert str(f) in str(err)


@pytest.mark.parametrize("raw, words", [
    (b"[" * 100_000, "nests"),
    (b"\xff\xfe{}", "not UTF-8"),
    (b"", "empty"),
    (b'{"gradfuzz_corpus": 1, "case": {}, "meta": {"x": ' + b"1" * 5000 + b"}}", "not usable JSON"),
])
def test_malformed_bytes_name_the_file(tmp_path, raw, words):
    f = tmp_path / "bad.json"
    f.write_bytes(raw)
    with pytest.raises(corpus.CorpusError, match=words) as info:
        corpus.load(f)
    assert str(f) in str(info.value)


def test_oversized_file_is_refused_before_it_is_read(tmp_path):
    f = tmp_path / "big.json"
    f.write_bytes(b" " * (schema.MAX_CORPUS_BYTES + 1))
    start = time.monotonic()
    with pytest.raises(corpus.CorpusError, match="larger than"):
        corpus.load(f)
    assert time.monotonic() - start < 1


@pytest.mark.parametrize("where, value, field", [
    (("case", "exact"), "no", "case.exact"),
    (("case", "version"), True, "case.version"),
    (("case", "seed"), 2**80, "case.seed"),
    (("case", "params", 0, "shape"), [200_000, 200_000], "case.params[0].shape"),
    (("case", "params", 0, "shape"), [3000, 3000], "case.params[0].shape"),  # 9M elements, under MAX_DIM, over MAX_NUMEL
    (("case", "params", 0, "requires_grad"), "false", "case.params[0].requires_grad"),
    (("case", "schedule", "microbatches"), True, "case.schedule.microbatches"),
    (("case", "nodes", 0, "name"), "class", "case.nodes[0].name"),
    (("meta", "title"), 'x"""\nimport os', "meta.title"),
    (("meta", "signature"), "../../escape/sitecustomize", "meta.signature"),
    (("meta", "signature"), "torch", "meta.signature"),
    (("meta", "found_with"), {"path": "split.stock\nimport os"}, "meta.found_with.path"),
    (("meta", "expect", 0, "torch"), 2.13, "meta.expect[0].torch"),
    (("case", "params", 0, "placement"), "shard\u00b2", "case.params[0].placement"),  # int() raised ValueError
    (("case", "params", 0, "placement"), "shard\u0661", "case.params[0].placement"),  # int() read 1
    (("case", "params", 0, "placement"), "shard" + "0" * 40 + "1", "case.params[0].placement"),
])
def test_hostile_fields_are_named(where, value, field):
    with pytest.raises(corpus.CorpusError) as info:
        corpus.from_json(_replace(BASE_ENTRY, where, value), "f.json")
    assert f"field {field}" in str(info.value)


def test_memory_budget_is_checked_before_any_tensor():
    data = copy.deepcopy(BASE_ENTRY)
    data["case"]["schedule"] = {"microbatches": 16, "steps": 8, "grad_init": "none", "zero_grad": "set_to_none",
                                "events": [{"after": i % 120, "kind": "alloc", "sizes": [2**22]} for i in range(64)]}
    with pytest.raises(corpus.CorpusError, match="schedule.events"):
        corpus.from_json(data, "f.json")


def _use(ref: str, index: int | None = None) -> dict:
    return {"ref": ref, "transpose": False, "index": index}


def _case(params: list, nodes: list, outputs: list, **schedule) -> dict:
    """A corpus entry around the given parts (one input, one backward unless told)."""
    case = {"version": 2, "dtype": "float32", "exact": True, "seed": 0, "params": params,
            "inputs": [{"name": "x0", "shape": [1], "requires_grad": False}], "nodes": nodes, "outputs": outputs,
            "hooks": [], "retain_grad": [],
            "schedule": {"microbatches": 1, "steps": 1, "grad_init": "none", "zero_grad": "set_to_none", **schedule}}
    return {"gradfuzz_corpus": 1, "case": case, "meta": {}}


def chunk_views(chunks: int = 2**20, nodes: int = 3) -> dict:
    """901 bytes; three nodes cut one 2**20-element parameter into
    2**20 views each. Under the element budget (128 MiB); it built 2.5 GB
    of tensor objects on eager alone (22.8 s) before the count of tensors."""
    return _case([{"name": "w0", "shape": [2**20], "requires_grad": True}],
                 [{"name": f"n{i}", "op": "chunk", "args": [_use("w0")], "attrs": [["chunks", chunks]]} for i in range(nodes)],
                 [_use(f"n{i}", 0) for i in range(nodes)])


def big_script() -> dict:
    """567 bytes, one 2**21-element parameter: inside the element
    budget, and a 27 MB repro script (8 s, 540 MB) before script size was budgeted."""
    return _case([{"name": "w0", "shape": [2**20, 2], "requires_grad": True}],
                 [{"name": "n0", "op": "sum", "args": [_use("w0")], "attrs": []}], [_use("n0")])


def retained_views() -> dict:
    """4,000 views a forward, 128 backwards held: within the tensor count, over the memory budget."""
    return _case([{"name": "w0", "shape": [4000], "requires_grad": True}],
                 [{"name": "n0", "op": "chunk", "args": [_use("w0")], "attrs": [["chunks", 4000]]}],
                 [_use("n0", 0)], microbatches=16, steps=8)


@pytest.mark.parametrize("make, field, words", [
    (chunk_views, "case.nodes[0].attrs", "a case may make 4096"),
    (big_script, "case.params[0].shape", "repro script would be about"),
    (retained_views, "case.nodes[0]", "a case may build 256 MiB"),
])
def test_what_is_really_built_is_budgeted_before_it_is(make, field, words):
    start = time.monotonic()
    with pytest.raises(corpus.CorpusError) as info:
        corpus.from_json(make(), "f.json")
    assert f"field {field}" in str(info.value) and words in str(info.value), str(info.value)
    assert time.monotonic() - start < 1


# --- repro scripts: data, never code ------------------------------------------------

def _skeleton(text: str) -> str:
    """The script's AST with every constant blanked: the template's code alone."""
    tree = ast.parse(text)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant):
            node.value = None
    return ast.dump(tree)


NONE = Repro(template="none", why="a test")
HOSTILE_TEXT = ['x"""\n__import__("os").system("id")\n"""', "'''; import os #", "\\", "\x00\u2028", "{x}", "a" * 500]


@pytest.mark.parametrize("text", HOSTILE_TEXT)
def test_script_from_hostile_text_has_only_the_template(text):
    case = corpus.load(CASE_FILE).case
    plain = repro.script(case, "split.stock", NONE, title="plain")
    hostile = repro.script(case, text, NONE, title=text)
    assert _skeleton(hostile) == _skeleton(plain)


def test_script_from_a_hostile_case_is_refused():
    case = corpus.load(CASE_FILE).case
    from dataclasses import replace

    from harness.case.spec import Hook

    node = case.nodes[0].name
    bad = replace(case, hooks=(Hook(node, "scale", "1)\n__import__('os').system('id')\n(0"),))  # type: ignore[arg-type]
    with pytest.raises(SpecError, match="factor"):
        repro.script(bad, "split.stock", NONE)
    renamed = replace(case, nodes=(replace(case.nodes[0], name="class"),) + case.nodes[1:])
    with pytest.raises(SpecError, match="name"):
        repro.script(renamed, "split.stock", NONE)


def test_dtensor_script_from_hostile_title_has_only_the_template():
    case = corpus.load(CASE_FILE).case
    machinery = Repro(template="torchrun", family=DTensorMachinery("stock", 2))
    plain = repro.script(case, "dtensor.stock", machinery, title="plain")
    hostile = repro.script(case, HOSTILE_TEXT[0], machinery, title=HOSTILE_TEXT[0])
    assert _skeleton(hostile) == _skeleton(plain)


def test_pipeline_script_from_hostile_title_has_only_the_template():
    case = corpus.load(CASE_FILE).case
    machinery = Repro(template="pipeline", family=PipelineMachinery("GPipe", "stock", (0,), 1))
    plain = repro.script(case, "pipeline.GPipe.stock", machinery, title="plain")
    hostile = repro.script(case, HOSTILE_TEXT[0], machinery, title=HOSTILE_TEXT[0])
    assert _skeleton(hostile) == _skeleton(plain)


# --- names that become files --------------------------------------------------------

@pytest.mark.parametrize("sig", ["../../escape/sitecustomize", "torch", "/tmp/x", "a/b", "split.stock-value-01234",
                                 "sitecustomize", "split.stock-value-0123456789/../../x"])
def test_only_signatures_become_files(tmp_path, sig):
    entry = corpus.load(CASE_FILE)
    with pytest.raises(SpecError, match="signature"):
        findings.record(tmp_path / "into", sig, entry, "print(1)\n")
    assert not any(p.suffix == ".py" for p in tmp_path.rglob("*"))


def test_merge_refuses_a_hostile_signature_and_writes_nothing(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    data = _replace(BASE_ENTRY, ("meta", "signature"), "../../escape/sitecustomize")
    (src / "a.json").write_text(json.dumps(data))
    with pytest.raises(corpus.CorpusError, match="meta.signature"):
        findings.merge([str(src)], str(tmp_path / "into"))
    assert not (tmp_path / "into").exists() and not (tmp_path / "escape").exists()


def test_merge_files_a_hand_written_case_under_its_content_hash(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "torch.json").write_text(json.dumps(BASE_ENTRY))  # a file name that is a module name
    summary = findings.merge([str(src)], str(tmp_path / "into"))
    (sig,) = summary["counts"]
    assert sig.startswith("corpus-case-") and schema.SIGNATURE_RE.match(sig)
    assert sorted(p.name for p in (tmp_path / "into").iterdir() if not p.name.startswith(".")) == [f"{sig}.json", f"{sig}.py"]


def test_redis_items_are_checked(tmp_path):
    redis = pytest.importorskip("redis")
    from harness.artifacts import campaign as database

    with redis_server(tmp_path) as url:
        client = redis.Redis.from_url(url)
        good = {"case": BASE_ENTRY["case"], "meta": {"title": "t"}}
        for item, words in [
            ({"signature": "../escape/torch", "entry": good, "script": "print(1)"}, "field signature"),
            ({"signature": "torch", "entry": good}, "field signature"),
            ({"signature": "split.fixed-value-0123456789", "entry": _replace(good, ("case", "hooks"), [
                {"node": "n0", "kind": "scale", "factor": "1)\nimport os\n(0"}])}, "field entry.case.hooks[0].factor"),
            (b"\xff{", "not UTF-8"),
            ({"signature": "split.fixed-value-0123456789", "entry": []}, "field entry"),
        ]:
            client.delete(database.FINDINGS_KEY)
            client.rpush(database.FINDINGS_KEY, item if isinstance(item, bytes) else json.dumps(item))
            with pytest.raises(database.DatabaseError) as info:
                findings.merge([url], str(tmp_path / "into"))
            assert f"{database.FINDINGS_KEY}[0]" in str(info.value) and words in str(info.value), str(info.value)
            assert not (tmp_path / "into").exists() and not (tmp_path / "escape").exists()


# --- the command line -------------------------------------------------------------------

@pytest.mark.parametrize("argv, words", [
    (["fuzz", "--examples", "0"], "--examples 0"),
    (["fuzz", "--examples", "-5"], "--examples -5"),
    (["fuzz", "--minutes", "-1"], "--minutes -1"),
    (["fuzz", "--minutes", "nan"], "--minutes nan"),
    (["fuzz", "--world-size", "0"], "--world-size 0"),
    (["fuzz", "--timeout", "-1"], "--timeout -1"),
    (["fuzz", "--examples", "1", "--json", "/proc/gradfuzz/x.json"], "--json"),
    (["gate", "--minutes", "-1"], "--minutes -1"),
    (["merge", "x", "--into", "/proc/gradfuzz"], "--into"),
])
def test_cli_usage_errors_before_any_work(capsys, argv, words):
    from harness.cli.main import main

    start = time.monotonic()
    assert main(argv) == 2
    assert words in capsys.readouterr().err
    assert time.monotonic() - start < 2


def test_cli_caps_processes_at_the_core_count(capsys):
    import argparse

    from harness.cli.main import check_args

    args = argparse.Namespace(command="fuzz", numprocesses="999")
    check_args(args)
    assert args.numprocesses == str(os.cpu_count()) and "-n 999" in capsys.readouterr().err


def test_replay_reads_the_file_before_building_paths(tmp_path, capsys, monkeypatch):
    from harness.cli import main as cli

    monkeypatch.setattr(cli, "resolve", lambda *a, **k: pytest.fail("paths built before the file was read"))
    (tmp_path / "e.json").write_bytes(b"")
    assert cli.main(["replay", str(tmp_path / "e.json")]) == 2
    assert "e.json: empty corpus file" in capsys.readouterr().err


def test_sigterm_stops_like_sigint():
    from harness.cli import fuzz as fuzz_command

    class Stop:
        requested = False

        def set(self):
            self.requested = True

    class Display:
        stopping = False

    got: list[int] = []
    stop = Stop()
    previous = fuzz_command._on_signals(stop, Display(), got)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
    finally:
        fuzz_command._restore(previous)
    assert stop.requested and got == [signal.SIGTERM]
    assert fuzz_command.exit_code(signal.SIGTERM) == 143 and fuzz_command.exit_code(signal.SIGINT) == 130


@pytest.mark.parametrize("kind, reproduces, finding", [("crash", False, False), ("crash", True, True), ("value", False, True)])
def test_a_crash_that_does_not_reproduce_is_a_harness_error(kind, reproduces, finding):
    """A worker killed from outside (by the harness, a signal, the OOM killer)
    dies once; the confirming re-run of the same case does not. That is the
    harness's error, not a finding against the path."""
    from types import SimpleNamespace

    from harness.engine.result import Result
    from harness.engine.target import TargetRun, _Round
    from harness.observation import Divergence

    case = corpus.load(CASE_FILE).case
    path = SimpleNamespace(name="dtensor.stock")
    div = Divergence("dtensor.stock", kind, None, None, None, None, None, "a rank died", "dtensor.stock-crash-0123456789")
    run = TargetRun.__new__(TargetRun)
    run.target = SimpleNamespace(check=lambda c, p, known: (None, [div]) if reproduces else None)
    run.result, run.known, run.findings, run.on_finding = Result(), set(), [], None
    run.drawn, run.started = 1, time.monotonic()
    run._confirm_and_record(_Round(path, case, [div]))
    assert bool(run.findings) == finding and bool(run.result.divergences) == finding
    assert bool(run.result.errors) == (not finding)
    if not finding:
        assert "harness error, not a finding" in run.result.errors[0]


def test_a_named_corpus_file_gets_no_importable_script(tmp_path):
    entry = corpus.load(CASE_FILE)
    corpus.save(tmp_path, "nested", entry)  # a corpus file a person names: fine without a script
    with pytest.raises(SpecError, match="imported"):
        corpus.save(tmp_path, "torch", entry, repro="print(1)\n")
    for bad in ("../x", "/abs", ".hidden", "a/b"):
        with pytest.raises(SpecError):
            corpus.save(tmp_path, bad, entry)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["nested.json"]


# --- the directory gradfuzz runs in ------------------------------------------------------

PLANTED = ("sitecustomize", "usercustomize", "torch", "harness", "hypothesis")


def _plant(where, mark) -> None:
    """Modules a checkout under review could hold: each would leave a mark if it ran."""
    for module in PLANTED:
        (where / f"{module}.py").write_text(f"open({str(mark)!r} + '_{module}', 'w').close()\n")


def test_a_worker_runs_nothing_from_the_directory_it_starts_in(tmp_path, monkeypatch):
    """The compile and graphed workers put the working directory
    first on their path, so a sitecustomize.py there ran inside them."""
    from harness.paths.compile.paths import FlavorWorker

    run_dir = tmp_path / "checkout"
    run_dir.mkdir()
    _plant(run_dir, tmp_path / "PWNED")
    monkeypatch.chdir(run_dir)
    monkeypatch.setenv("PYTHONPATH", str(run_dir))  # set after this process started: reaches no child
    worker = FlavorWorker()
    try:
        worker._ensure_child()  # started and ready
        assert worker._proc is not None and worker._proc.poll() is None
    finally:
        worker.close()
    assert not list(tmp_path.glob("PWNED*")), sorted(p.name for p in tmp_path.glob("PWNED*"))


def test_child_commands_start_isolated_with_absolute_paths_only():
    from harness.workers.interpreter import import_path, python

    argv = python("harness", "selfcheck")
    assert argv[1] == "-I" and json.loads(argv[4]) == import_path()
    assert all(os.path.isabs(p) for p in import_path())


# --- what is read: regular files only, bounded trees, sizes before bytes ---------------

def test_a_fifo_named_json_is_refused_not_waited_on(tmp_path, capsys):
    """A FIFO named *.json in a corpus directory hung replay and merge."""
    from harness.cli.main import main

    (tmp_path / "cases").mkdir()
    (tmp_path / "cases" / "ok.json").write_text(json.dumps(BASE_ENTRY))
    os.mkfifo(tmp_path / "cases" / "pipe.json")
    for argv in (["replay", str(tmp_path / "cases"), "--paths", "split.fixed"],
                 ["merge", str(tmp_path / "cases"), "--into", str(tmp_path / "into")]):
        start = time.monotonic()
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "pipe.json: not a regular file (a FIFO)" in err, err
        assert time.monotonic() - start < 5
    assert not list(tmp_path.glob("into/*.json"))  # checked whole before anything is written


@pytest.mark.parametrize("special", ["/dev/zero", "/dev/stdin"])
def test_a_device_is_not_a_corpus_file(special):
    if not os.path.exists(special):
        pytest.skip(f"no {special}")
    with pytest.raises(corpus.CorpusError, match="not a regular file|cannot read"):
        corpus.load(special)


def test_a_deep_corpus_tree_is_refused_without_recursion(tmp_path):
    """10,000 nested folders ended in RecursionError."""
    here = tmp_path
    for _ in range(corpus.MAX_TREE_DEPTH + 5):
        here = here / "d"
    here.mkdir(parents=True)
    (here / "x.json").write_text("{}")
    with pytest.raises(corpus.CorpusError, match="folders below"):
        corpus.discover([tmp_path])


def test_a_redis_item_is_measured_before_it_is_read(tmp_path, monkeypatch):
    """Merge read every item of the log before checking sizes (a MemoryError)."""
    redis = pytest.importorskip("redis")
    from harness.artifacts import campaign

    with redis_server(tmp_path) as url:
        client = redis.Redis.from_url(url)
        client.rpush(campaign.FINDINGS_KEY, b"{" + b" " * (schema.MAX_ITEM_BYTES + 1) + b"}")
        fetched: list = []
        real = redis.Redis.lrange
        monkeypatch.setattr(redis.Redis, "lrange", lambda self, *a: fetched.append(a) or real(self, *a))
        with pytest.raises(campaign.DatabaseError, match=r"findings\[0\]: \d+ bytes; an item may be"):
            findings.merge([url], str(tmp_path / "into"))
        assert fetched == []  # the size came from the server, not from the item


def test_merged_counts_past_2_53_are_refused_before_writing(tmp_path):
    """Two files each within 2**53 merged into a file gradfuzz then refused to read."""
    for name in ("a", "b"):
        src = tmp_path / name
        src.mkdir()
        data = _replace(_replace(BASE_ENTRY, ("meta", "counts"), {f"{name}:w": 2**53}), ("meta", "count"), 2**53)
        (src / "f.json").write_text(json.dumps(data))
    findings.merge([str(tmp_path / "a")], str(tmp_path / "into"))
    before = {p.name: p.read_bytes() for p in (tmp_path / "into").glob("*.json")}
    with pytest.raises(corpus.CorpusError, match="field meta.count: the merged counts sum to"):
        findings.merge([str(tmp_path / "b")], str(tmp_path / "into"))
    assert {p.name: p.read_bytes() for p in (tmp_path / "into").glob("*.json")} == before
    for f in (tmp_path / "into").glob("*.json"):
        corpus.load(f)  # what was written still reads


# --- output that could be turned against the reader ----------------

# Clear the screen, set the terminal's title, go back to the start of the line.
ESCAPES = ["\x1b[2J", "\x1b]0;title\x07", "\r"]


def _acts_on_a_terminal(text: str) -> list[str]:
    from harness.case.vocab import CONTROL

    return [c for c in text if CONTROL.match(c) and c not in "\n\t"]


def _with_key(doc: dict, where: tuple, key: str) -> dict:
    doc = copy.deepcopy(doc)
    cur = doc
    for k in where:
        cur = cur[k]
    cur[key] = 1
    return doc


@pytest.mark.parametrize("esc", ESCAPES)
@pytest.mark.parametrize("where", [(), ("case",), ("case", "params", 0), ("meta",)])
def test_a_hostile_key_is_escaped_in_the_message(tmp_path, capsys, monkeypatch, esc, where):
    from harness.cli import main as cli

    monkeypatch.setattr(cli, "resolve", lambda *a, **k: pytest.fail("paths built before the file was read"))
    f = tmp_path / "keys.json"
    f.write_text(json.dumps(_with_key(BASE_ENTRY, where, f"k{esc}")))
    assert cli.main(["replay", str(f)]) == 2
    err = capsys.readouterr().err
    assert "keys.json" in err and f"k{esc}".encode("unicode_escape").decode() in err and "unknown field" in err
    assert not _acts_on_a_terminal(err), err


@pytest.mark.parametrize("esc", ESCAPES)
def test_a_hostile_file_name_is_escaped(tmp_path, capsys, esc):
    from harness.cli.main import main

    f = tmp_path / f"name{esc}.json"
    f.write_bytes(b"")
    assert main(["replay", str(f)]) == 2
    err = capsys.readouterr().err
    assert "empty corpus file" in err and not _acts_on_a_terminal(err), err


@pytest.mark.parametrize("esc", ESCAPES)
def test_ledger_and_report_messages_are_escaped(tmp_path, esc):
    bad_ledger = _with_key(BASE_LEDGER, ("bugs", 0), f"k{esc}")
    bad_report = _with_key(BASE_REPORT, (), f"k{esc}")
    for load, doc in ((ledger.from_json, bad_ledger), (ledger.report_from_json, bad_report)):
        with pytest.raises(corpus.CorpusError) as e:
            load(doc, f"f{esc}.json")
        assert "unknown field" in str(e.value) and not _acts_on_a_terminal(str(e.value)), str(e.value)


@pytest.mark.parametrize("esc", ESCAPES)
def test_report_rows_reach_the_terminal_escaped(tmp_path, capsys, esc):
    """A row a report file carries (``gradfuzz table``), and a ledger summary in
    the gate's own reports: printed and written as text."""
    from harness.cli.main import main
    from harness.gate import report

    hostile = copy.deepcopy(BASE_REPORT)
    hostile["rows"][0].update(bug=f"b{esc}", detail=f"summary{esc} (known)")
    (tmp_path / "a.json").write_text(json.dumps(BASE_REPORT))
    (tmp_path / "b.json").write_text(json.dumps(hostile))
    assert main(["table", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    out = capsys.readouterr().out
    assert f"b{esc}".encode("unicode_escape").decode() in out and not _acts_on_a_terminal(out), out
    hostile["rows"][0]["bug"] = "b"  # the gate's rows carry ledger ids, which are [A-Za-z0-9._-] only
    rep = ledger.report_from_json({**hostile, "seconds": 1.0, "examples": {"split.stock": 3}, "counts": {},
                                   "selfcheck": []}, "b.json")
    for text in (report.terminal(rep), report.markdown(rep), report.junit(rep)):
        assert "summary\\" in text and not _acts_on_a_terminal(text), text


def test_printable_unicode_stays_readable():
    from harness.case.vocab import printable

    assert printable("Grüße, 梯度, λ → ∇ ✓") == "Grüße, 梯度, λ → ∇ ✓"
    assert printable("a\x1b[2Jb\x9bc\u202ed\re") == "a\\x1b[2Jb\\x9bc\\u202ed\\re"
    assert printable(printable("\x07\x1b")) == printable("\x07\x1b")  # idempotent
    assert printable("one\ntwo\tx\r", layout=True) == "one\ntwo\tx\\r"

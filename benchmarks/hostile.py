#!/usr/bin/env python
"""Hostile input battery: corpus files, ledgers, gate reports and CLI misuse.

Corpora travel (Redis, ``gradfuzz merge`` of copied directories, cases pasted
from bug reports), so every file gradfuzz reads is input from a stranger.
This script writes a battery of hostile files into a sandbox, runs the CLI on
each in a subprocess (a wall-clock limit, an address-space cap so a memory
bomb cannot take the shared machine down, peak RSS from ``wait4``) and prints
one table row per run: exit code, first line of the message, peak RSS and
seconds, and whether the run was *clean* (exit 2, the message names the file
and the field the file attacks).

Injection attacks are checked by their effect, not by the message: generated
repro scripts are parsed and run in the sandbox (a marker file appearing means
the payload ran), and after every ``merge`` the sandbox is searched for files
written outside ``--into`` or named like an importable module.

    python benchmarks/hostile.py                      # everything, table on stdout
    python benchmarks/hostile.py --only corpus --json out.json
    python benchmarks/hostile.py --only ledger,cli,signal,redis

Each command is bounded by ``--timeout`` seconds (default 30) and
``--mem-cap-gb`` of address space (default 4); a run that hits either is
reported as such (the goal is none over 5 s and none over 1 GB RSS).
"""

from __future__ import annotations

import argparse
import ast
import copy
import json
import math
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

DELETE = object()
PAYLOAD_MARK = "PWNED"


# --- the base files the battery mutates --------------------------------------------

def base_entry() -> dict[str, Any]:
    """A small valid corpus entry that every hostile corpus file starts from:
    a matmul, a sum over a dim, a hook on a node that needs no grad (so the
    harness never evaluates the factor), one parameter, one input."""
    return {
        "gradfuzz_corpus": 1,
        "case": {
            "version": 1,
            "dtype": "float32",
            "exact": True,
            "seed": 0,
            "params": [{"name": "w0", "shape": [3, 3], "requires_grad": True}],
            "inputs": [{"name": "x0", "shape": [2, 3], "requires_grad": False}],
            "nodes": [
                {"name": "n0", "op": "matmul", "args": [{"ref": "x0", "transpose": False, "index": None},
                                                        {"ref": "w0", "transpose": False, "index": None}],
                 "attrs": []},
                {"name": "n1", "op": "sum", "args": [{"ref": "n0", "transpose": False, "index": None}],
                 "attrs": [["dim", 1]]},
                {"name": "n2", "op": "mul", "args": [{"ref": "x0", "transpose": False, "index": None},
                                                     {"ref": "x0", "transpose": False, "index": None}],
                 "attrs": []},
            ],
            "outputs": [{"ref": "n1", "transpose": False, "index": None},
                        {"ref": "n2", "transpose": False, "index": None}],
            "hooks": [{"node": "n2", "kind": "scale", "factor": 2}],
            "retain_grad": [],
            "schedule": {"microbatches": 2, "steps": 1, "grad_init": "none", "zero_grad": "set_to_none"},
        },
        "meta": {
            "title": "hostile battery base case",
            "found_with": {"path": "split.fixed"},
            "expect": [{"path": "split.stock", "torch": "<2.13"}],
        },
    }


def base_ledger() -> dict[str, Any]:
    return {
        "gradfuzz_ledger": 1,
        "signature_scheme": 2,
        "bugs": [{
            "id": "hostile-base", "path": "split.stock", "torch": "<2.13", "summary": "a base entry",
            "upstream": "https://example.invalid/1", "cases": ["case.json"],
            "signatures": ["split.stock-value-0123456789"],
        }],
    }


def base_report() -> dict[str, Any]:
    return {"schema": 1, "torch": "2.13.0", "passed": True, "seconds": 1.0, "examples": {"split.fixed": 3},
            "counts": {}, "rows": [{"status": "known", "path": "split.stock", "detail": "d", "bug": "b",
                                    "signature": "split.stock-value-0123456789", "source": "fuzz",
                                    "case": None, "divergence": None, "upstream": ""}],
            "selfcheck": []}


def put(doc: Any, path: str, value: Any) -> Any:
    """Copy of ``doc`` with the dotted/indexed ``path`` set (or deleted)."""
    doc = copy.deepcopy(doc)
    keys = [int(k) if k.isdigit() else k for k in re.findall(r"[^.\[\]]+", path)]
    cur = doc
    for k in keys[:-1]:
        cur = cur[k]
    if value is DELETE:
        del cur[keys[-1]]
    else:
        cur[keys[-1]] = value
    return doc


def deep(n: int, leaf: str = "0") -> str:
    return "[" * n + leaf + "]" * n


def chain_case(n: int) -> dict[str, Any]:
    e = base_entry()
    nodes = [{"name": "n0", "op": "relu", "args": [{"ref": "w0", "transpose": False, "index": None}], "attrs": []}]
    for i in range(1, n):
        nodes.append({"name": f"n{i}", "op": "relu", "args": [{"ref": f"n{i - 1}", "transpose": False, "index": None}],
                      "attrs": []})
    e["case"]["nodes"] = nodes
    e["case"]["outputs"] = [{"ref": f"n{n - 1}", "transpose": False, "index": None}]
    e["case"]["hooks"] = []
    return e


def event_bomb() -> dict[str, Any]:
    """2000 alloc events, each under the per-event limit, 32 GB together."""
    e = put(base_entry(), "case.schedule", {"microbatches": 16, "steps": 8, "grad_init": "none",
                                            "zero_grad": "set_to_none",
                                            "events": [{"after": i % 120, "kind": "alloc", "sizes": [2**22]}
                                                       for i in range(2000)]})
    return e


def built_case(params: list, nodes: list, outputs: list, **schedule: Any) -> dict[str, Any]:
    """A corpus entry around the given parts: the files of issue 32 that were
    small and valid yet built far more than their elements."""
    e = base_entry()
    e["case"].update(params=params, nodes=nodes, outputs=outputs, hooks=[],
                     inputs=[{"name": "x0", "shape": [1], "requires_grad": False}])
    e["case"]["schedule"].update(microbatches=1, **schedule)
    return e


def use(ref: str, index: int | None = None) -> dict[str, Any]:
    return {"ref": ref, "transpose": False, "index": index}


def chunk_views() -> dict[str, Any]:
    """Three nodes cutting one 2**20-element parameter into 2**20 views each (2.5 GB before)."""
    return built_case([{"name": "w0", "shape": [2**20], "requires_grad": True}],
                      [{"name": f"n{i}", "op": "chunk", "args": [use("w0")], "attrs": [["chunks", 2**20]]}
                       for i in range(3)], [use(f"n{i}", 0) for i in range(3)])


def big_script() -> dict[str, Any]:
    """One 2**21-element parameter: a 27 MB repro script before."""
    return built_case([{"name": "w0", "shape": [2**20, 2], "requires_grad": True}],
                      [{"name": "n0", "op": "sum", "args": [use("w0")], "attrs": []}], [use("n0")])


# --- the batteries -------------------------------------------------------------------

@dataclass
class Item:
    name: str
    attack: str
    content: bytes
    field: str  # what a clean rejection names ("" = the file only)
    kind: str = "corpus"  # corpus | ledger | report
    commands: tuple[str, ...] = ()  # default per kind when empty
    run_script: bool = False  # run the printed/merged repro script and look for the marker
    sidecar: bytes | None = None  # a .py beside the corpus file
    valid: bool = False  # a valid file: clean is exit 0 with nothing raw on the terminal


def J(doc: Any) -> bytes:
    return json.dumps(doc, allow_nan=True).encode()


# Clear the screen, set the terminal's title, back to the line's start (issue 32, item 6).
ESC = "\x1b[2J\x1b]0;title\x07\r"
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def shown(text: str) -> str:
    """``text`` as a reader's terminal must get it: control characters as
    their escapes (written here again, not imported: the battery judges the
    harness, and --harness runs an older one)."""
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


def raw_controls(text: str) -> list[str]:
    return sorted(set(_CONTROL.findall(text)))


def with_key(doc: dict[str, Any], where: tuple[Any, ...], key: str) -> dict[str, Any]:
    """Copy of ``doc`` with ``key`` added at ``where`` (``put`` cannot spell such keys)."""
    doc = copy.deepcopy(doc)
    cur = doc
    for k in where:
        cur = cur[k]
    cur[key] = 1
    return doc


INJECT = ("1)\n    __import__('pathlib').Path('" + PAYLOAD_MARK + "_factor').touch()\n    (0")
TITLE = ('x"""\n__import__("pathlib").Path("' + PAYLOAD_MARK + '_title").touch()\n"""')
FOUND = ('split.fixed"""\n__import__("pathlib").Path("' + PAYLOAD_MARK + '_found").touch()\n"""')


def corpus_items() -> list[Item]:
    b = base_entry()
    c = lambda name, attack, doc, fld, **kw: Item(name, attack, doc if isinstance(doc, bytes) else J(doc), fld, **kw)
    items = [
        c("empty", "empty file", b"", ""),
        c("non_utf8", "non-UTF-8 bytes", b"\xff\xfe\x00{\"gradfuzz_corpus\": 1}\xc3\x28", ""),
        c("not_json", "truncated JSON", b'{"gradfuzz_corpus": 1, "case": {', ""),
        c("top_list", "top level is a list", J([b]), ""),
        c("deep_100k", "100,000-deep nesting", deep(100_000).encode(), ""),
        c("deep_meta", "20,000-deep nesting inside meta", J(put(b, "meta", {})).replace(b'"meta": {}', b'"meta": {"x": ' + deep(20_000).encode() + b"}"), ""),  # refused by nesting before parsing
        c("chain_200k", "50 MB file, 200,000-node chain", J(chain_case(200_000)), ""),  # refused by size: no field to name
        c("chain_5k", "5,000-node chain", J(chain_case(5_000)), "case.nodes"),
        c("corpus_bool", "gradfuzz_corpus: true", put(b, "gradfuzz_corpus", True), "gradfuzz_corpus"),
        c("corpus_str", 'gradfuzz_corpus: "1"', put(b, "gradfuzz_corpus", "1"), "gradfuzz_corpus"),
        c("no_case", "case missing", put(b, "case", DELETE), "case"),
        c("case_list", "case is a list", put(b, "case", []), "case"),
        c("top_unknown", "unknown top-level field", put(b, "evil", 1), "evil"),
        c("version_bool", "version: true", put(b, "case.version", True), "case.version"),
        c("version_str", 'version: "1"', put(b, "case.version", "1"), "case.version"),
        c("dtype_num", "dtype: 5", put(b, "case.dtype", 5), "case.dtype"),
        c("dtype_list", 'dtype: ["float32"]', put(b, "case.dtype", ["float32"]), "case.dtype"),
        c("exact_no", 'exact: "no"', put(b, "case.exact", "no"), "case.exact"),
        c("exact_int", "exact: 0", put(b, "case.exact", 0), "case.exact"),
        c("seed_str", 'seed: "abc"', put(b, "case.seed", "abc"), "case.seed"),
        c("seed_huge", "seed: 2**80", put(b, "case.seed", 2**80), "case.seed"),
        c("seed_neg", "seed: -1", put(b, "case.seed", -1), "case.seed"),
        c("seed_float", "seed: 1.5", put(b, "case.seed", 1.5), "case.seed"),
        c("params_obj", "params is an object", put(b, "case.params", {}), "case.params"),
        c("pname_num", "params[0].name: 5", put(b, "case.params[0].name", 5), "case.params[0].name"),
        c("pname_kw", 'params[0].name: "class" (keyword)', put(put(b, "case.params[0].name", "class"), "case.nodes[0].args[1].ref", "class"), "case.params[0].name"),
        c("shape_320gb", "param shape [200000, 200000] (160 GB fp32)", put(b, "case.params[0].shape", [200000, 200000]), "case.params[0].shape"),
        c("shape_3_6gb", "param shape [30000, 30000] (3.6 GB)", put(put(b, "case.params[0].shape", [30000, 30000]), "case.inputs[0].shape", [2, 30000]), "case.params[0].shape"),
        c("shape_bool", "shape [true, 3]", put(b, "case.params[0].shape", [True, 3]), "case.params[0].shape"),
        c("shape_2e70", "shape [2**70, 3]", put(b, "case.params[0].shape", [2**70, 3]), "case.params[0].shape"),
        c("shape_str", 'shape "33"', put(b, "case.params[0].shape", "33"), "case.params[0].shape"),
        c("shape_64d", "64-dim shape of ones", put(b, "case.params[0].shape", [1] * 64), "case.params[0].shape"),
        c("preq_false_str", 'params[0].requires_grad: "false"', put(b, "case.params[0].requires_grad", "false"), "case.params[0].requires_grad"),
        c("placement_num", "params[0].placement: 7", put(b, "case.params[0].placement", 7), "case.params[0].placement"),
        c("placement_sup", 'params[0].placement: "shard\u00b2" (a superscript digit, issue 32)', put(b, "case.params[0].placement", "shard\u00b2"), "case.params[0].placement"),
        c("placement_arabic", 'params[0].placement: "shard\u0661" (an Arabic-Indic digit, issue 32)', put(b, "case.params[0].placement", "shard\u0661"), "case.params[0].placement"),
        c("ireq_no", 'inputs[0].requires_grad: "no"', put(b, "case.inputs[0].requires_grad", "no"), "case.inputs[0].requires_grad"),
        c("ishape_float", "inputs[0].shape [2.0, 3]", put(b, "case.inputs[0].shape", [2.0, 3]), "case.inputs[0].shape"),
        c("op_list", 'nodes[0].op: ["matmul"]', put(b, "case.nodes[0].op", ["matmul"]), "case.nodes[0].op"),
        c("op_eval", 'nodes[0].op: "eval"', put(b, "case.nodes[0].op", "eval"), "case.nodes[0].op"),
        c("node_kw_class", 'node named "class" (keyword)', put(put(b, "case.nodes[0].name", "class"), "case.nodes[1].args[0].ref", "class"), "case.nodes[0].name", commands=("replay", "repro")),
        c("node_kw_none", 'node named "None"', put(put(b, "case.nodes[0].name", "None"), "case.nodes[1].args[0].ref", "None"), "case.nodes[0].name", commands=("replay", "repro")),
        c("node_dunder", 'node named "__builtins__"', J(b).replace(b'"n2"', b'"__builtins__"'), "case.nodes[2].name"),
        c("args_str", 'nodes[0].args: "x0"', put(b, "case.nodes[0].args", "x0"), "case.nodes[0].args"),
        c("ref_list", 'args[0].ref: ["x0"]', put(b, "case.nodes[0].args[0].ref", ["x0"]), "case.nodes[0].args[0].ref"),
        c("transpose_no", 'args[0].transpose: "no"', put(b, "case.nodes[0].args[0].transpose", "no"), "case.nodes[0].args[0].transpose"),
        c("index_bool", "args[0].index: true", put(b, "case.nodes[0].args[0].index", True), "case.nodes[0].args[0].index"),
        c("index_str", 'args[0].index: "0"', put(b, "case.nodes[0].args[0].index", "0"), "case.nodes[0].args[0].index"),
        c("attr_dim_str", 'attrs dim "0"', put(b, "case.nodes[1].attrs", [["dim", "0"]]), "case.nodes[1].attrs"),
        c("attr_dim_inject", "attrs dim holds source text", put(b, "case.nodes[1].attrs", [["dim", "1) + __import__('os').getpid() * (0"]]), "case.nodes[1].attrs"),
        c("attr_dim_float", "attrs dim 1e308", put(b, "case.nodes[1].attrs", [["dim", 1e308]]), "case.nodes[1].attrs"),
        c("attr_unknown", "unknown attr key", put(b, "case.nodes[1].attrs", [["evil", 1]]), "case.nodes[1].attrs"),
        c("attr_not_pair", 'attrs [["dim"]]', put(b, "case.nodes[1].attrs", [["dim"]]), "case.nodes[1].attrs"),
        c("outputs_empty", "outputs: []", put(b, "case.outputs", []), "case.outputs"),
        c("out_ref_num", "outputs[0].ref: 5", put(b, "case.outputs[0].ref", 5), "case.outputs[0].ref"),
        c("factor_inject", "hooks[0].factor: source text (node needs no grad)", put(b, "case.hooks[0].factor", INJECT), "case.hooks[0].factor", commands=("replay", "repro"), run_script=True),
        c("factor_str", 'hooks[0].factor: "2"', put(b, "case.hooks[0].factor", "2"), "case.hooks[0].factor"),
        c("factor_nan", "hooks[0].factor: NaN", put(b, "case.hooks[0].factor", math.nan), "case.hooks[0].factor"),
        c("factor_inf", "hooks[0].factor: Infinity", put(b, "case.hooks[0].factor", math.inf), "case.hooks[0].factor"),
        c("hook_kind_list", 'hooks[0].kind: ["scale"]', put(b, "case.hooks[0].kind", ["scale"]), "case.hooks[0].kind"),
        c("hook_node_num", "hooks[0].node: 5", put(b, "case.hooks[0].node", 5), "case.hooks[0].node"),
        c("retain_num", "retain_grad: [5]", put(b, "case.retain_grad", [5]), "case.retain_grad"),
        c("sched_list", "schedule: []", put(b, "case.schedule", []), "case.schedule"),
        c("mb_bool", "microbatches: true", put(b, "case.schedule.microbatches", True), "case.schedule.microbatches"),
        c("mb_huge", "microbatches: 10**9", put(b, "case.schedule.microbatches", 10**9), "case.schedule.microbatches"),
        c("steps_str", 'steps: "2"', put(b, "case.schedule.steps", "2"), "case.schedule.steps"),
        c("grad_init_num", "grad_init: 1", put(b, "case.schedule.grad_init", 1), "case.schedule.grad_init"),
        c("zero_grad_null", "zero_grad: null", put(b, "case.schedule.zero_grad", None), "case.schedule.zero_grad"),
        c("events_bomb", "2000 alloc events of 2**22 (32 GB together)", J(event_bomb()), "case.schedule.events"),
        c("event_size_huge", "event sizes [2**80]", put(b, "case.schedule.events", [{"after": 0, "kind": "alloc", "sizes": [2**80]}]), "case.schedule.events[0].sizes"),
        c("event_after_str", 'event after "0"', put(b, "case.schedule.events", [{"after": "0", "kind": "free"}]), "case.schedule.events[0].after"),
        c("event_kind_cmd", 'event kind "rm -rf /"', put(b, "case.schedule.events", [{"after": 0, "kind": "rm -rf /"}]), "case.schedule.events[0].kind"),
        c("retain_out_no", 'retain_outputs: "no"', put(b, "case.schedule.retain_outputs", "no"), "case.schedule.retain_outputs"),
        c("param_hooks_str", 'param_hooks: "hook"', put(b, "case.schedule.param_hooks", "hook"), "case.schedule.param_hooks"),
        c("clip_num", "clip: 2", put(b, "case.schedule.clip", 2), "case.schedule.clip"),
        c("max_norm_nan", "max_norm: NaN", put(put(b, "case.schedule.clip", "2"), "case.schedule.max_norm", math.nan), "case.schedule.max_norm"),
        c("lr_inf", "lr: Infinity", put(put(b, "case.schedule.optimizer", "sgd"), "case.schedule.lr", math.inf), "case.schedule.lr"),
        c("lr_str", 'lr: "0.1"', put(put(b, "case.schedule.optimizer", "sgd"), "case.schedule.lr", "0.1"), "case.schedule.lr"),
        c("optim_list", 'optimizer: ["sgd"]', put(b, "case.schedule.optimizer", ["sgd"]), "case.schedule.optimizer"),
        c("optim_impl_num", "optimizer_impl: 5", put(b, "case.schedule.optimizer_impl", 5), "case.schedule.optimizer_impl"),
        c("stages_bool", "family.pipeline.cuts: [true]", put(b, "case.family", {"pipeline": {"version": 1, "cuts": [True]}}),
          "case.family.pipeline.cuts"),
        c("stages_str", 'family.pipeline.cuts: "1"', put(b, "case.family", {"pipeline": {"version": 1, "cuts": "1"}}),
          "case.family.pipeline.cuts"),
        c("meta_list", "meta: []", put(b, "meta", []), "meta"),
        c("expect_num", "meta.expect: 5", put(b, "meta.expect", 5), "meta.expect"),
        c("expect_item_num", "meta.expect: [5]", put(b, "meta.expect", [5]), "meta.expect[0]"),
        c("expect_torch_num", "meta.expect[0].torch: 2.13", put(b, "meta.expect[0].torch", 2.13), "meta.expect[0].torch"),
        c("expect_path_list", 'meta.expect[0].path: ["split.stock"]', put(b, "meta.expect[0].path", ["split.stock"]), "meta.expect[0].path"),
        c("title_inject", 'meta.title closes the docstring (""")', put(b, "meta.title", TITLE), "meta.title", commands=("replay", "merge"), run_script=True),
        c("found_inject", "meta.found_with.path closes the docstring", put(b, "meta.found_with.path", FOUND), "meta.found_with.path", commands=("repro", "merge"), run_script=True),
        c("found_str", 'meta.found_with: "x"', put(b, "meta.found_with", "x"), "meta.found_with", commands=("repro", "merge")),
        c("sig_sitecustomize", "meta.signature ../../escape/sitecustomize", put(b, "meta.signature", "../../escape/sitecustomize"), "meta.signature", commands=("merge",)),
        c("sig_torch", 'meta.signature "torch" (shadows the module)', put(b, "meta.signature", "torch"), "meta.signature", commands=("merge",)),
        c("sig_abs", "meta.signature absolute path", put(b, "meta.signature", "/tmp/gradfuzz-hostile-abs"), "meta.signature", commands=("merge",)),
        c("sig_num", "meta.signature: 5", put(b, "meta.signature", 5), "meta.signature", commands=("merge",)),
        c("count_str", 'meta.count: "many"', put(b, "meta.count", "many"), "meta.count", commands=("replay", "merge")),
        c("counts_bad", 'meta.counts: {"w": "x"}', put(b, "meta.counts", {"w": "x"}), "meta.counts", commands=("replay", "merge")),
        c("counts_huge", "meta.counts: {w: 1e300}", put(b, "meta.counts", {"w": 1e300}), "meta.counts", commands=("replay", "merge")),
        c("flaky_no", 'meta.flaky: "no"', put(b, "meta.flaky", "no"), "meta.flaky"),
        c("title_10mb", "meta.title of 10 MB", put(b, "meta.title", "A" * 10_000_000), ""),  # refused by size
        c("chunk_views", "3 nodes of 2**20 chunk views of one parameter (issue 32)", chunk_views(), "case.nodes[0].attrs",
          commands=("replay", "repro")),
        c("big_script", "a 2**21-element parameter: 27 MB script (issue 32)", big_script(), "case.params[0].shape",
          commands=("replay", "repro")),
        c("esc_key", "a top-level key of terminal escapes (issue 32)", with_key(b, (), "k" + ESC), shown("k" + ESC)),
        c("esc_case_key", "a case key of terminal escapes", with_key(b, ("case",), "k" + ESC), "case." + shown("k" + ESC)),
        c("esc_param_key", "a parameter key of terminal escapes", with_key(b, ("case", "params", 0), "k" + ESC),
          "case.params[0]." + shown("k" + ESC)),
        c("esc_title", "meta.title of terminal escapes", put(b, "meta.title", "t" + ESC), "meta.title",
          commands=("replay", "merge")),
        c("esc_pname", "a parameter name of terminal escapes", put(b, "case.params[0].name", "w" + ESC),
          "case.params[0].name"),
        c("esc_file" + ESC, "a file name of terminal escapes", put(b, "case.seed", -1), "case.seed"),
    ]
    return items


def ledger_items() -> list[Item]:
    b = base_ledger()
    c = lambda name, attack, doc, fld: Item(name, attack, doc if isinstance(doc, bytes) else J(doc), fld, kind="ledger")
    return [
        c("L_empty", "empty file", b"", ""),
        c("L_non_utf8", "non-UTF-8 bytes", b'{"gradfuzz_ledger": 1, "bugs": [{"id": "\xff\xfe"}]}', ""),
        c("L_not_json", "truncated JSON", b'{"gradfuzz_ledger": 1, "bugs": [', ""),
        c("L_list", "top level is a list", J([b]), ""),
        c("L_deep", "100,000-deep nesting", deep(100_000).encode(), ""),
        c("L_ver_bool", "gradfuzz_ledger: true", put(b, "gradfuzz_ledger", True), "gradfuzz_ledger"),
        c("L_ver_str", 'gradfuzz_ledger: "1"', put(b, "gradfuzz_ledger", "1"), "gradfuzz_ledger"),
        c("L_bugs_num", "bugs: 5", put(b, "bugs", 5), "bugs"),
        c("L_bugs_obj", "bugs: {}", put(b, "bugs", {"a": 1}), "bugs"),
        c("L_bug_num", "bugs: [5]", put(b, "bugs", [5]), "bugs[0]"),
        c("L_torch_num", "bugs[0].torch: 2.13", put(b, "bugs[0].torch", 2.13), "bugs[0].torch"),
        c("L_torch_bad", 'bugs[0].torch: "soon"', put(b, "bugs[0].torch", "soon"), "bugs[0].torch"),
        c("L_path_num", "bugs[0].path: 5", put(b, "bugs[0].path", 5), "bugs[0].path"),
        c("L_path_list", 'bugs[0].path: ["split.stock"]', put(b, "bugs[0].path", ["split.stock"]), "bugs[0].path"),
        c("L_id_num", "bugs[0].id: 5", put(b, "bugs[0].id", 5), "bugs[0].id"),
        c("L_cases_str", 'bugs[0].cases: "case.json" (a string)', put(b, "bugs[0].cases", "case.json"), "bugs[0].cases"),
        c("L_cases_trav", "bugs[0].cases: ../../../etc/passwd", put(b, "bugs[0].cases", ["../../../../etc/passwd"]), "bugs[0].cases[0]"),
        c("L_sigs_str", 'bugs[0].signatures: "abc"', put(b, "bugs[0].signatures", "abc"), "bugs[0].signatures"),
        c("L_sigs_num", "bugs[0].signatures: [5]", put(b, "bugs[0].signatures", [5]), "bugs[0].signatures[0]"),
        c("L_sigs_trav", 'bugs[0].signatures: ["../x"]', put(b, "bugs[0].signatures", ["../x"]), "bugs[0].signatures[0]"),
        c("L_summary_null", "bugs[0].summary: null", put(b, "bugs[0].summary", None), "bugs[0].summary"),
        c("L_upstream_obj", "bugs[0].upstream: {}", put(b, "bugs[0].upstream", {"a": 1}), "bugs[0].upstream"),
        c("L_unknown", "unknown bug field", put(b, "bugs[0].evil", 1), "bugs[0].evil"),
        c("L_missing_id", "bugs[0].id missing", put(b, "bugs[0].id", DELETE), "bugs[0].id"),
        c("L_dup_id", "two bugs with one id", put(b, "bugs", b["bugs"] * 2), "bugs[1].id"),
        c("L_200k", "200,000 bugs (40 MB)", put(b, "bugs", [dict(b["bugs"][0], id=f"b{i}") for i in range(200_000)]), ""),
        c("L_esc_key", "a bug key of terminal escapes (issue 32)", with_key(b, ("bugs", 0), "k" + ESC),
          "bugs[0]." + shown("k" + ESC)),
        c("L_esc_id", "bugs[0].id of terminal escapes", put(b, "bugs[0].id", "i" + ESC), "bugs[0].id"),
        Item("L_esc_summary", "bugs[0].summary of terminal escapes (a valid ledger)", J(put(b, "bugs[0].summary", "s" + ESC)),
             "", kind="ledger", valid=True),
    ]


def report_items() -> list[Item]:
    b = base_report()
    c = lambda name, attack, doc, fld: Item(name, attack, doc if isinstance(doc, bytes) else J(doc), fld, kind="report")
    return [
        c("R_empty", "empty report", b"", ""),
        c("R_list", "report is a list", J([1]), ""),
        c("R_rows_num", "rows: 5", put(b, "rows", 5), "rows"),
        c("R_torch_num", "torch: 5", put(b, "torch", 5), "torch"),
        c("R_torch_bad", 'torch: "latest"', put(b, "torch", "latest"), "torch"),
        c("R_status_bad", 'rows[0].status: "evil"', put(b, "rows[0].status", "evil"), "rows[0].status"),
        c("R_path_missing", "rows[0].path missing", put(b, "rows[0].path", DELETE), "rows[0].path"),
        c("R_deep", "100,000-deep nesting", deep(100_000).encode(), ""),
        c("R_esc_key", "a report key of terminal escapes (issue 32)", with_key(b, (), "k" + ESC), shown("k" + ESC)),
        c("R_esc_torch", "torch: a version and terminal escapes", put(b, "torch", "2.13" + ESC), "torch"),
        Item("R_esc_row", "rows[0].bug and detail of terminal escapes (a valid report)",
             J(put(put(b, "rows[0].bug", "b" + ESC), "rows[0].detail", "d" + ESC)), "", kind="report", valid=True),
    ]


# --- running -------------------------------------------------------------------------

@dataclass
class Run:
    battery: str
    file: str
    attack: str
    command: str
    rc: int | None
    message: str
    rss_mb: float
    seconds: float
    clean: bool
    notes: list[str] = field(default_factory=list)


HARNESS_DIR: str | None = None  # --harness: run that checkout's harness (e.g. the code before a change)


def gradfuzz_exe() -> list[str]:
    # -P: the run directory is not put on the path (the env battery plants modules there)
    module = [sys.executable, *(["-P"] if sys.version_info >= (3, 11) else []), "-m", "harness"]
    if HARNESS_DIR:
        return module
    exe = shutil.which("gradfuzz")
    return [exe] if exe else module


def run_bounded(cmd: list[str], cwd: str, timeout: float, mem_cap_gb: float,
                env: dict[str, str] | None = None, term_after: float | None = None) -> tuple[int | None, str, str, float, float]:
    """(rc, stdout, stderr, peak RSS MB, seconds). rc None: killed at the time limit."""
    def limits() -> None:
        os.setsid()
        cap = int(mem_cap_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    out = tempfile.TemporaryFile()
    err = tempfile.TemporaryFile()
    start = time.monotonic()
    p = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=err, preexec_fn=limits,
                         env=_env(env))
    rc = None
    rss_kb = 0
    termed = False
    while True:
        pid, status, usage = os.wait4(p.pid, os.WNOHANG)
        if pid:
            rss_kb = usage.ru_maxrss
            rc = os.waitstatus_to_exitcode(status)
            if rc < 0:
                rc = 128 - rc  # a signal, as a shell reports it
            break
        elapsed = time.monotonic() - start
        if term_after is not None and not termed and elapsed > term_after:
            os.kill(p.pid, signal.SIGTERM)
            termed = True
        if elapsed > timeout:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _, status, usage = os.wait4(p.pid, 0)
            rss_kb = usage.ru_maxrss
            rc = None
            break
        time.sleep(0.02)
    p.returncode = 0
    seconds = time.monotonic() - start
    out.seek(0)
    err.seek(0)
    return rc, out.read().decode(errors="replace"), err.read().decode(errors="replace"), rss_kb / 1024, seconds


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ, **(extra or {}), PYTHONWARNINGS="ignore")
    if HARNESS_DIR:
        env["PYTHONPATH"] = HARNESS_DIR
    return env


def first_message(stdout: str, stderr: str) -> str:
    lines = [l for l in stderr.splitlines() if l.strip()]
    for l in lines:
        if l.startswith("gradfuzz: error") or l.startswith("gradfuzz: warning"):
            return l
    if any(l.startswith("Traceback") for l in lines):
        tail = [l for l in lines if not l.startswith(" ")]
        return "TRACEBACK " + (tail[-1] if tail else lines[-1])
    if lines:
        return lines[0]
    out = [l for l in stdout.splitlines() if l.strip()]
    return out[0] if out else ""


def verdict(item: Item, file: Path, rc: int | None, msg: str, out: str, err: str) -> tuple[bool, list[str]]:
    """Clean: exit 2 naming the file and the field (a valid file: exit 0), and
    no control character reaching the terminal raw either way."""
    raw = raw_controls(out + err)
    notes = [f"RAW CONTROL CHARACTERS {', '.join(shown(c) for c in raw)} in the output"] if raw else []
    if item.valid:
        return rc == 0 and not raw, notes
    return rc == 2 and shown(file.name) in msg and (not item.field or item.field in msg) and not raw, notes


def extract_script(stdout: str) -> str | None:
    i = stdout.find("#!/usr/bin/env python")
    return stdout[i:] if i >= 0 else None


def script_notes(text: str, where: Path, timeout: float) -> list[str]:
    """Does a generated script parse, and does running it run a payload?"""
    notes = []
    try:
        ast.parse(text)
    except SyntaxError as e:
        notes.append(f"script SyntaxError line {e.lineno}")
        return notes
    where.mkdir(parents=True, exist_ok=True)
    f = where / "repro_run.py"
    f.write_text(text)
    rc, out, err, _, _ = run_bounded([sys.executable, str(f)], str(where), timeout, 4)
    marks = sorted(p.name for p in where.iterdir() if p.name.startswith(PAYLOAD_MARK))
    if marks:
        notes.append(f"PAYLOAD RAN ({', '.join(marks)}); script rc {rc}")
    else:
        notes.append(f"script ran, no payload (rc {rc})")
    return notes


def snapshot(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def run_item(item: Item, sandbox: Path, args: argparse.Namespace) -> list[Run]:
    gf = gradfuzz_exe()
    work = sandbox / item.kind / item.name
    work.mkdir(parents=True, exist_ok=True)
    runs = []
    if item.kind == "corpus":
        src = work / "a" / "b" / "src"
        src.mkdir(parents=True)
        f = src / f"{item.name}.json"
        f.write_bytes(item.content)
        commands = item.commands or (("replay", "merge") if item.field.startswith("meta") else ("replay",))
        commands = tuple(c for c in commands if c in args.commands)
        for cmd_name in commands:
            into = work / "a" / "b" / "into"
            before = snapshot(work)
            if cmd_name == "replay":
                cmd = gf + ["replay", str(f), "--paths", args.paths]
            elif cmd_name == "repro":
                cmd = gf + ["repro", str(f), "--paths", args.paths, "--script"]
            else:
                cmd = gf + ["merge", str(src), "--into", str(into)]
            rc, out, err, rss, secs = run_bounded(cmd, str(work), args.timeout, args.mem_cap_gb)
            msg = first_message(out, err)
            notes = []
            if rc is None:
                notes.append(f"KILLED at the {args.timeout:.0f} s limit")
            if cmd_name == "merge":
                created = snapshot(work) - before
                outside = [p for p in created if not p.startswith("a/b/into/") and PAYLOAD_MARK not in p]
                if outside:
                    notes.append("WROTE OUTSIDE --into: " + ", ".join(sorted(outside)[:3]))
                shadows = [p for p in created if p.startswith("a/b/into/") and Path(p).stem in sys.stdlib_module_names | {"torch", "numpy", "harness", "sitecustomize", "usercustomize"}]
                if shadows:
                    notes.append("WROTE A MODULE NAME: " + ", ".join(shadows))
                if item.run_script and rc == 0:
                    for py in sorted(into.glob("*.py")):
                        notes += script_notes(py.read_text(), work / "run_merge", 60)
            if cmd_name == "repro" and rc in (0, 1):
                text = extract_script(out)
                if text is not None and item.run_script:
                    notes += script_notes(text, work / "run_repro", 60)
                elif text is not None:
                    try:
                        ast.parse(text)
                    except SyntaxError as e:
                        notes.append(f"script SyntaxError line {e.lineno}")
            clean, raw = verdict(item, f, rc, msg, out, err)
            runs.append(Run(item.kind, f.name, item.attack, cmd_name, rc, msg[:160], round(rss, 1), round(secs, 2),
                            clean, notes + raw))
            shutil.rmtree(into, ignore_errors=True)
    elif item.kind == "ledger":
        f = work / f"{item.name}.json"
        f.write_bytes(item.content)
        (work / "empty").mkdir(exist_ok=True)
        cmd = gf + ["gate", "--ledger", str(f), "--minutes", "0", "--no-selfcheck", "--corpus", str(work / "empty"),
                    "--paths", args.paths, "--save", str(work / "found")]
        rc, out, err, rss, secs = run_bounded(cmd, str(work), args.timeout, args.mem_cap_gb)
        msg = first_message(out, err)
        clean, raw = verdict(item, f, rc, msg, out, err)
        runs.append(Run("ledger", f.name, item.attack, "gate", rc, msg[:160], round(rss, 1), round(secs, 2), clean,
                        ([f"KILLED at the {args.timeout:.0f} s limit"] if rc is None else []) + raw))
    else:
        f = work / f"{item.name}.json"
        f.write_bytes(item.content)
        good = work / "good.json"
        good.write_text(json.dumps(base_report()))
        for cmd_name, cmd in (("table", gf + ["table", str(good), str(f)]),):
            rc, out, err, rss, secs = run_bounded(cmd, str(work), args.timeout, args.mem_cap_gb)
            msg = first_message(out, err)
            clean, raw = verdict(item, f, rc, msg, out, err)
            runs.append(Run("report", f.name, item.attack, cmd_name, rc, msg[:160], round(rss, 1), round(secs, 2),
                            clean, raw))
    return runs


def cli_runs(sandbox: Path, args: argparse.Namespace) -> list[Run]:
    """Misuse of the command line: each must be a usage error (exit 2) before any work."""
    gf = gradfuzz_exe()
    work = sandbox / "cli"
    work.mkdir(parents=True, exist_ok=True)
    ok_case = work / "ok.json"
    ok_case.write_text(json.dumps(base_entry()))
    (work / "ro").mkdir(exist_ok=True)
    os.chmod(work / "ro", 0o500)
    base = ["fuzz", "--paths", args.paths, "--db", "none", "--save", str(work / "found"), "--progress", "none"]
    cases = [
        ("--examples 0", base + ["--examples", "0"], "--examples"),
        ("--examples -5", base + ["--examples", "-5"], "--examples"),
        ("--minutes -1", base + ["--minutes", "-1"], "--minutes"),
        ("--minutes nan", base + ["--minutes", "nan"], "--minutes"),
        ("-n 999", base + ["--examples", "2", "-n", "999"], "-n"),
        ("--world-size 0", base + ["--examples", "2", "--world-size", "0"], "--world-size"),
        ("--timeout -1", base + ["--examples", "2", "--timeout", "-1"], "--timeout"),
        ("--json unwritable", base + ["--examples", "5", "--json", "/proc/gradfuzz-hostile/out.json"], "--json"),
        ("gate --minutes -1", ["gate", "--paths", args.paths, "--minutes", "-1", "--no-selfcheck", "--corpus",
                               str(work / "none"), "--ledger", str(work / "none.json")], "--minutes"),
        ("replay of an empty file", ["replay", str(work / "empty.json")], "empty.json"),
        ("replay a missing file", ["replay", str(work / "missing.json")], "missing.json"),
    ]
    (work / "empty.json").write_bytes(b"")
    runs = []
    for what, cmd, fld in cases:
        rc, out, err, rss, secs = run_bounded(gf + cmd, str(work), args.timeout, args.mem_cap_gb)
        msg = first_message(out, err)
        if rc == 0 and not msg:
            msg = (out.strip().splitlines() or [""])[-1]
        runs.append(Run("cli", what, what, cmd[0], rc, msg[:160], round(rss, 1), round(secs, 2),
                        rc == 2 and fld in msg or (what.startswith("-n") and rc in (0, 1) and "capped" in (out + err))))
    os.chmod(work / "ro", 0o700)
    return runs


def signal_runs(sandbox: Path, args: argparse.Namespace) -> list[Run]:
    """SIGTERM in the middle of a fuzz run: exit 143, summary, --json written, corpus whole."""
    gf = gradfuzz_exe()
    runs = []
    for sig_name, sig in (("SIGTERM", signal.SIGTERM), ("SIGINT", signal.SIGINT)):
        work = sandbox / "signal" / sig_name
        work.mkdir(parents=True, exist_ok=True)
        out_json = work / "run.json"
        cmd = gf + ["fuzz", "--paths", "split.stock", "--minutes", "2", "--db", "none", "--save", str(work / "found"),
                    "--json", str(out_json), "--progress", "plain", "--seed", "1"]
        # send the signal 25 s in (torch import and the first examples)
        rc, out, err, rss, secs = _run_with_signal(cmd, str(work), sig, 25.0, args)
        notes = [f"--json written: {out_json.exists()}"]
        bad = []
        for f in (work / "found").glob("*.json") if (work / "found").exists() else []:
            try:
                json.loads(f.read_text())
            except ValueError:
                bad.append(f.name)
        n = len(list((work / "found").glob("*.json"))) if (work / "found").exists() else 0
        notes.append(f"corpus files {n}, unreadable {len(bad)}")
        notes.append("summary printed: " + str("gradfuzz:" in out))
        want = 143 if sig == signal.SIGTERM else 130
        runs.append(Run("signal", sig_name, f"{sig_name} during fuzz", "fuzz", rc, first_message(out, err)[:160],
                        round(rss, 1), round(secs, 2), rc == want and out_json.exists() and not bad, notes))
    return runs


def _run_with_signal(cmd, cwd, sig, after, args):
    out = tempfile.TemporaryFile()
    err = tempfile.TemporaryFile()
    start = time.monotonic()
    p = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=err, start_new_session=True, env=_env())
    time.sleep(after)
    p.send_signal(sig)
    try:
        _, status, usage = os.wait4(p.pid, 0) if _wait(p, 60) else (0, 0, None)
    except ChildProcessError:
        status, usage = 0, None
    rc = p.returncode if p.returncode is not None else os.waitstatus_to_exitcode(status)
    if rc is not None and rc < 0:
        rc = 128 - rc
    out.seek(0)
    err.seek(0)
    usage = usage or getattr(p, "_usage", None)
    rss = usage.ru_maxrss / 1024 if usage else 0.0
    return rc, out.read().decode(errors="replace"), err.read().decode(errors="replace"), rss, time.monotonic() - start


def _wait(p: subprocess.Popen, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid, status, usage = os.wait4(p.pid, os.WNOHANG)
        if pid:
            p.returncode = os.waitstatus_to_exitcode(status)
            p._usage = usage  # type: ignore[attr-defined]
            return False
        time.sleep(0.05)
    os.killpg(p.pid, signal.SIGKILL)
    return True


def redis_runs(sandbox: Path, args: argparse.Namespace) -> list[Run]:
    """A hostile signature and a hostile case through an unauthenticated Redis finding log."""
    if not shutil.which("redis-server"):
        return [Run("redis", "-", "redis-server not installed", "merge", None, "", 0, 0, False)]
    try:
        import redis
    except ImportError:
        return [Run("redis", "-", "redis package not installed", "merge", None, "", 0, 0, False)]
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    work = sandbox / "redis"
    work.mkdir(parents=True, exist_ok=True)
    server = subprocess.Popen(["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                               "--appendonly", "no", "--dir", str(work)], stdout=subprocess.DEVNULL)
    runs = []
    try:
        client = redis.Redis(port=port)
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                time.sleep(0.05)
        b = base_entry()
        attacks = [
            ("redis_sig_escape", "Redis item signature ../escape/torch", {"signature": "../escape/torch", "entry": {"case": b["case"], "meta": b["meta"]}, "script": "print('payload')\n"}, "signature"),
            ("redis_sig_torch", 'Redis item signature "torch"', {"signature": "torch", "entry": {"case": b["case"], "meta": b["meta"]}, "script": "print('payload')\n"}, "signature"),
            ("redis_factor", "Redis item with an injected hook factor", {"signature": "split.fixed-value-0123456789", "entry": {"case": put(b, "case.hooks[0].factor", INJECT)["case"], "meta": b["meta"]}, "script": None}, "factor"),
            ("redis_not_json", "Redis item that is not JSON", b"\xff{", ""),
            ("redis_entry_list", "Redis item entry: []", {"signature": "split.fixed-value-0123456789", "entry": [], "script": None}, "entry"),
            ("redis_script_num", "Redis item script: 5", {"signature": "split.fixed-value-0123456789", "entry": {"case": b["case"], "meta": b["meta"]}, "script": 5}, "script"),
            ("redis_huge", "Redis items of 5 MB each (issue 32: read before measured)", b"{" + b" " * 5_000_000 + b"}", "bytes"),
        ]
        for name, what, item, fld in attacks:
            client.delete("gradfuzz:findings")
            client.rpush("gradfuzz:findings", item if isinstance(item, bytes) else json.dumps(item))
            d = work / name
            into = d / "a" / "into"
            into.mkdir(parents=True)
            before = snapshot(d)
            rc, out, err, rss, secs = run_bounded(gradfuzz_exe() + ["merge", f"redis://127.0.0.1:{port}/0", "--into", str(into)],
                                                  str(d), args.timeout, args.mem_cap_gb)
            created = snapshot(d) - before
            notes = []
            outside = [p for p in created if not p.startswith("a/into/")]
            if outside:
                notes.append("WROTE OUTSIDE --into: " + ", ".join(sorted(outside)))
            shadows = [p for p in created if Path(p).stem in {"torch", "sitecustomize"}]
            if shadows:
                notes.append("WROTE A MODULE NAME: " + ", ".join(shadows))
            if name == "redis_factor" and rc == 0:
                for py in into.glob("*.py"):
                    notes += script_notes(py.read_text(), d / "run", 60)
            msg = first_message(out, err)
            runs.append(Run("redis", name, what, "merge", rc, msg[:160], round(rss, 1), round(secs, 2),
                            rc == 2 and "gradfuzz:findings" in msg and fld in msg, notes))
    finally:
        server.terminate()
        server.wait()
    return runs


def env_runs(sandbox: Path, args: argparse.Namespace) -> list[Run]:
    """Modules planted in the directory gradfuzz runs from (a checkout under
    review): none may run in gradfuzz's workers (issue 32: the compile and
    graphed workers put it first on their path)."""
    runs = []
    for paths in ("compile.aot_eager", "split.fixed"):
        work = sandbox / "env" / paths
        work.mkdir(parents=True, exist_ok=True)
        for module in ("sitecustomize", "usercustomize", "torch", "harness"):
            (work / f"{module}.py").write_text(f"open({str(work / PAYLOAD_MARK)!r} + '_{module}', 'w').close()\n")
        case = work / "case.json"
        case.write_text(json.dumps(base_entry()))
        rc, out, err, rss, secs = run_bounded(gradfuzz_exe() + ["replay", str(case), "--paths", paths], str(work),
                                              args.timeout, args.mem_cap_gb)
        marks = sorted(p.name for p in work.iterdir() if p.name.startswith(PAYLOAD_MARK))
        notes = [f"PAYLOAD RAN ({', '.join(marks)})"] if marks else ["nothing planted ran"]
        runs.append(Run("env", f"planted modules, {paths}", "sitecustomize/torch/harness .py in the run directory",
                        "replay", rc, first_message(out, err)[:160], round(rss, 1), round(secs, 2),
                        rc == 0 and not marks, notes))
    return runs


def tree_runs(sandbox: Path, args: argparse.Namespace) -> list[Run]:
    """Corpus directories that are not plain trees of files (issue 32): a FIFO
    named *.json hung replay and merge, 10,000 nested folders ended in a
    RecursionError."""
    runs = []
    fifo = sandbox / "tree" / "fifo"
    fifo.mkdir(parents=True, exist_ok=True)
    (fifo / "ok.json").write_text(json.dumps(base_entry()))
    os.mkfifo(fifo / "pipe.json")
    deepest = sandbox / "tree" / "deep"
    here = deepest
    deepest.mkdir(exist_ok=True)
    for _ in range(1_500):  # deeper than rglob's recursion goes; a path still under PATH_MAX
        here = here / "d"
        here.mkdir(exist_ok=True)
    (here / "x.json").write_text(json.dumps(base_entry()))
    for name, target, cmd, fld in (("fifo", fifo, "replay", "pipe.json"), ("fifo", fifo, "merge", "pipe.json"),
                                   ("deep tree", deepest, "replay", "folders below")):
        argv = (["replay", str(target), "--paths", args.paths] if cmd == "replay"
                else ["merge", str(target), "--into", str(sandbox / "tree" / "into")])
        rc, out, err, rss, secs = run_bounded(gradfuzz_exe() + argv, str(sandbox / "tree"), args.timeout, args.mem_cap_gb)
        msg = first_message(out, err)
        runs.append(Run("tree", name, f"a {name} in a corpus directory", cmd, rc, msg[:160], round(rss, 1),
                        round(secs, 2), rc == 2 and fld in msg))
    return runs


def table(runs: list[Run]) -> str:
    head = "| battery | file | attack | cmd | rc | clean | RSS MB | s | message | notes |"
    rows = [head, "|" + " --- |" * 10]
    for r in runs:
        msg = shown(r.message).replace("|", "\\|")
        rows.append(f"| {r.battery} | {shown(r.file)} | {r.attack.replace('|', '/')} | {r.command} | {r.rc} | "
                    f"{'yes' if r.clean else 'NO'} | {r.rss_mb:.0f} | {r.seconds:.1f} | {msg} | {'; '.join(r.notes)} |")
    return "\n".join(rows)


def summary(runs: list[Run]) -> str:
    lines = []
    for battery in dict.fromkeys(r.battery for r in runs):
        rs = [r for r in runs if r.battery == battery]
        files = {r.file for r in rs}
        lines.append(
            f"{battery}: {len(files)} inputs, {len(rs)} runs: clean {sum(r.clean for r in rs)}, "
            f"exit 2 {sum(r.rc == 2 for r in rs)}, exit 0 {sum(r.rc == 0 for r in rs)}, exit 1 {sum(r.rc == 1 for r in rs)}, "
            f"traceback {sum(r.message.startswith('TRACEBACK') for r in rs)}, killed/signal "
            f"{sum(r.rc is None or (r.rc or 0) > 128 for r in rs)}, over 1 GB {sum(r.rss_mb > 1024 for r in rs)}, "
            f"over 5 s {sum(r.seconds > 5 for r in rs)}, max RSS {max((r.rss_mb for r in rs), default=0):.0f} MB, "
            f"max {max((r.seconds for r in rs), default=0):.1f} s, "
            f"payload ran {sum(any('PAYLOAD RAN' in n for n in r.notes) for r in rs)}, "
            f"raw escapes {sum(any('RAW CONTROL' in n for n in r.notes) for r in rs)}, "
            f"wrote outside/module {sum(any('WROTE' in n for n in r.notes) for r in rs)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="corpus,ledger,report,cli,redis,signal,env,tree",
                    help="comma-separated batteries: corpus, ledger, report, cli, redis, signal, env, tree")
    ap.add_argument("--commands", default="replay,repro,merge", help="corpus commands to run")
    ap.add_argument("--match", default="", help="only inputs whose name contains this")
    ap.add_argument("--paths", default="split.fixed", help="paths for replay/repro/gate (default split.fixed)")
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--mem-cap-gb", type=float, default=4.0)
    ap.add_argument("--json", help="write the runs as JSON")
    ap.add_argument("--harness", metavar="DIR", help="run the harness of this checkout (PYTHONPATH=DIR python -m harness)")
    ap.add_argument("--sandbox", help="keep the hostile files here (default: a temporary directory, removed)")
    args = ap.parse_args(argv)
    args.commands = tuple(args.commands.split(","))
    global HARNESS_DIR
    HARNESS_DIR = os.path.abspath(args.harness) if args.harness else None
    only = args.only.split(",")
    sandbox = Path(args.sandbox or tempfile.mkdtemp(prefix="gradfuzz-hostile-"))
    sandbox.mkdir(parents=True, exist_ok=True)
    runs: list[Run] = []
    items = ((corpus_items() if "corpus" in only else []) + (ledger_items() if "ledger" in only else [])
             + (report_items() if "report" in only else []))
    items = [i for i in items if args.match in i.name]
    print(f"hostile: {sum(i.kind == 'corpus' for i in items)} corpus files, {sum(i.kind == 'ledger' for i in items)} "
          f"ledgers, {sum(i.kind == 'report' for i in items)} reports in {sandbox}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    try:
        for i, item in enumerate(items):
            new = run_item(item, sandbox, args)
            for r in new:
                print(f"[{i + 1}/{len(items)} {time.monotonic() - t0:.0f}s] {shown(r.file)} {r.command}: rc {r.rc} "
                      f"{r.rss_mb:.0f} MB {r.seconds:.1f}s {'clean' if r.clean else 'NOT CLEAN'} {shown(r.message[:100])} "
                      f"{'; '.join(r.notes)}", file=sys.stderr, flush=True)
            runs += new
        for battery, fn in (("cli", cli_runs), ("redis", redis_runs), ("signal", signal_runs), ("env", env_runs),
                            ("tree", tree_runs)):
            if battery in only and not args.match:
                new = fn(sandbox, args)
                for r in new:
                    print(f"[{battery}] {r.file}: rc {r.rc} {r.seconds:.1f}s {shown(r.message[:100])} {'; '.join(r.notes)}",
                          file=sys.stderr, flush=True)
                runs += new
    finally:
        if not args.sandbox:
            subprocess.run(["rm", "-rf", str(sandbox)], check=False)  # rmtree recurses: the deep tree is too deep
    print(table(runs))
    print()
    print(summary(runs))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in runs], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

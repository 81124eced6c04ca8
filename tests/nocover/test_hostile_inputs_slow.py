"""The loader fuzzing of tests/cover/test_hostile_inputs.py, run long."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from tests.cover.test_hostile_inputs import (
    BASE_ENTRY, BASE_LEDGER, BASE_REPORT, check_corpus, check_ledger, check_report, json_values, mutated,
)

LONG = settings(max_examples=3000, deadline=2000, suppress_health_check=list(HealthCheck), database=None)


@pytest.mark.slow
@LONG
@given(mutated(BASE_ENTRY) | json_values)
def test_corpus_loader_long(data):
    check_corpus(data)


@pytest.mark.slow
@LONG
@given(mutated(BASE_LEDGER) | json_values)
def test_ledger_loader_long(data):
    check_ledger(data)


@pytest.mark.slow
@LONG
@given(mutated(BASE_REPORT) | json_values)
def test_report_loader_long(data):
    check_report(data)


@pytest.mark.slow
@LONG
@given(st.binary(max_size=400) | st.binary(max_size=80).map(lambda b: json.dumps(BASE_ENTRY).encode()[:600] + b))
def test_corpus_loader_bytes_long(tmp_path_factory, raw):
    from harness.artifacts import corpus

    f = tmp_path_factory.mktemp("b") / "bytes.json"
    f.write_bytes(raw)
    try:
        corpus.load(str(f))
    except corpus.CorpusError as err:
        assert str(f) in str(err)

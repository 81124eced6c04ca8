"""``benchmarks/second_bug.py``'s own rules, on eager.accumulate and no gate run.

A second bug that changes nothing the path shows must not be charged to the
gate as a miss, and one that does must never be hidden; a wrapped misuse path
must keep signing its findings by the use.
"""

from __future__ import annotations

from types import SimpleNamespace

from harness.observation import Failure
from harness.paths import resolve
from tests.helpers import benchmark_module, nested

sb = benchmark_module("second_bug")


class Raising:
    """eager.accumulate with a known bug of its own: it raises at backward 0."""

    def __init__(self, inner) -> None:
        self.inner, self.name, self.contract = inner, inner.name, inner.contract

    def availability(self):
        return self.inner.availability()

    def supports(self, case):
        return self.inner.supports(case)

    def run(self, case):
        obs = self.inner.run(case)
        obs.failure, obs.steps = Failure(0, "RuntimeError", "known message"), []
        return obs


def _eager():
    return next(p for p in resolve(["eager.accumulate"]) if p.name == "eager.accumulate")


def _row_at(path: str, case, status: str):
    return SimpleNamespace(path=path, case=case.to_json(), status=status,
                           divergence={"kind": "error", "param": None, "microbatch": 0, "shape": "s"})


def test_a_raise_the_known_bug_already_makes_is_hidden_only_at_the_controls_status():
    case = nested(microbatches=2)
    same = sb.Injected(Raising(_eager()), sb.Raise("RuntimeError", "known message", 0))
    row = sb.Row("signature", "x", ("eager.accumulate",), (), same.bug)
    r = _row_at("eager.accumulate", case, "known_signature_only")
    control = {sb._key(r): {"known_signature_only"}}
    assert sb._hidden(r, row, control, [same], {})
    # A check that met the second bug changes the status: that verdict is the second bug's.
    assert not sb._hidden(_row_at("eager.accumulate", case, "resembles"), row, control, [same], {})


def test_a_raise_that_changes_what_the_path_shows_is_never_hidden():
    case = nested(microbatches=2)
    other = sb.Injected(Raising(_eager()), sb.Raise("RuntimeError", "another message", 0))
    row = sb.Row("signature", "x", ("eager.accumulate",), (), other.bug)
    r = _row_at("eager.accumulate", case, "known_signature_only")
    assert not sb._hidden(r, row, {sb._key(r): {"known_signature_only"}}, [other], {})


def test_the_wrapper_keeps_what_classifies_the_path():
    inner = SimpleNamespace(name="stack.zero1.misuse", contract=None, finding_class="misuse",
                            use=lambda case: "zero_grad", world_size=2, workarounds=("documented-drive",))
    wrapped = sb.Injected(inner, sb.Recount(("w0",), 1))
    assert wrapped.finding_class == "misuse" and wrapped.use(None) == "zero_grad"
    assert wrapped.world_size == 2 and wrapped.workarounds == ("documented-drive",)
    assert not hasattr(wrapped, "device")

import pytest

from harness.paths import Options, UsageError, resolve
from harness.engine.runner import check, fuzz
from harness.case.spec import Case, Hook, Input, Node, Param, Use
from tests.helpers import nested


def test_family_names_expand_and_unknown_names_are_usage_errors():
    assert [p.name for p in resolve("split")] == ["split.stock", "split.twin", "split.fixed"]
    with pytest.raises(UsageError, match=r"unknown path 'splitt'.*known paths: .*split\.fixed"):
        resolve("splitt")


def test_every_builtin_family_is_a_folder_that_loads_here():
    """A built-in family that stopped importing would turn "unavailable" and
    a gate would pass without it: here, where all of them import, none may."""
    import harness.paths as registry

    fams = registry.families()
    assert [f.name for f in fams] == [line.split("=")[0].strip() for line in registry.BUILTIN]
    assert not [p.name for p in resolve(None) if isinstance(p, registry.Unloadable)]


def test_a_family_that_does_not_import_is_listed_unavailable_with_the_reason(monkeypatch):
    import harness.paths as registry

    monkeypatch.setattr(registry, "BUILTIN", registry.BUILTIN + ("ghost = no_such_family_xyz:FAMILY",))
    (ghost,) = resolve("ghost")
    why = ghost.availability()
    assert ghost.name == "ghost.unavailable" and not why.ok
    assert "no_such_family_xyz" in why.reason and "ModuleNotFoundError" in why.reason
    assert ghost.supports(nested()) == why.reason  # never run, so never passed


def test_split_impl_option_points_split_stock_at_a_fork():
    (path,) = resolve("split.stock", Options(impls=(("split_impl", "harness.paths.split.canaries:double_count_nested"),)))
    assert path.availability().ok
    assert check(nested(), path), "the fork double counts x @ w @ w"
    # The user's own flag that cannot be honoured is a setup error, never an "unavailable" path the gate passes.
    with pytest.raises(UsageError, match=r"--split-impl 'no_such_module_xyz' does not load: .*cannot import"):
        resolve("split.stock", Options(impls=(("split_impl", "no_such_module_xyz"),)))


@pytest.mark.parametrize("exact", [True, False])
def test_split_fixed_agrees_with_the_oracle(exact):
    result = fuzz(resolve("split.fixed"), examples=250, seed=3, exact=exact, progress=lambda s: None)
    assert result.paths["split.fixed"].run == 250
    assert not result.divergences, result.divergences[0].detail


def test_stock_contract_is_declared_and_counted():
    (stock,) = resolve("split.stock")
    no_grad_input = Case(
        params=(Param("w0", (2, 2)),), inputs=(Input("x0", (2, 2), requires_grad=False),),
        nodes=(Node("n0", "matmul", (Use("x0"), Use("w0"))),), outputs=(Use("n0"),),
    )
    assert "first stage" in stock.supports(no_grad_input)
    view_out = Case(
        params=(Param("w0", (2, 2)),), inputs=(Input("x0", (2, 2), requires_grad=True),),
        nodes=(Node("n0", "matmul", (Use("x0"), Use("w0"))),), outputs=(Use("n0", transpose=True),),
    )
    assert "view" in stock.supports(view_out)
    assert resolve("split.fixed")[0].supports(view_out) is None
    assert not check(view_out, resolve("split.fixed")[0])


def test_mutation_of_a_held_grad_is_reported():
    """A path that writes into a grad the user already holds, without that
    grad being the .grad it accumulates into, is a mutation finding."""
    import torch

    from harness.materialize.schedule import Observe, run_schedule
    from harness.paths.base import Contract

    class Scribbler:
        name, contract = "scribbler", Contract()

        def run(self, case):
            def backward(outs, cots, inputs, params):
                grads = torch.autograd.grad(outs, list(params.values()) + [inputs["x0"]], cots)
                for p, g in zip(params.values(), grads):
                    p.grad = g if p.grad is None else p.grad + g
                cots[0].mul_(0)  # writes into the caller's grad output
                return {"x0": grads[-1]}

            # it hands x0's grad back without filling x0.grad, as a pipeline stage does
            return run_schedule(case, self.name, backward, observe=Observe(leaf_input_grads=False))

    from harness.compare.values import compare
    from oracles.eager import observe

    case = nested(microbatches=2)
    divs = compare(case, observe(case), Scribbler().run(case), retained_grads=Scribbler.contract.retained_grads)
    assert [d.kind for d in divs] == ["mutation", "mutation"]
    assert "grad output 0 of backward 0" in divs[0].detail


def test_hooks_scale_the_oracle_and_eager_alike():
    case = Case(
        params=(Param("w0", (2, 2)),), inputs=(Input("x0", (2, 2), requires_grad=True),),
        nodes=(Node("n0", "matmul", (Use("x0"), Use("w0"))),), outputs=(Use("n0"),),
        hooks=(Hook("n0", "scale", 2),),
    )
    assert not check(case, resolve("eager.accumulate")[0])
    assert not check(case, resolve("split.fixed")[0])


class _Hangs:
    """A path whose every case with two or more nodes hangs (a timeout, as a
    pool reports one), without the wait: the engine's cost is its calls."""

    name = "hangs"

    def __init__(self) -> None:
        from harness.paths.base import Contract

        self.contract, self.calls = Contract(), 0

    def availability(self):
        from harness.paths.base import Availability

        return Availability(True)

    def supports(self, case):
        return None

    def run(self, case):
        from oracles.eager import observe
        from harness.observation import Violation

        self.calls += 1
        obs = observe(case)
        obs.path = self.name
        if len(case.nodes) >= 2:
            obs.violations.append(Violation("timeout", -1, "process group", "the case hung", key="timeout"))
        return obs

    def repro(self, case):
        from harness.paths.engine_rules import replay_only

        return replay_only(self.name)


def test_a_hang_is_found_once_and_not_shrunk():
    """Every shrink step of a hang costs the path's whole timeout and a
    restart (62 s a step on deepspeed.zero2.misuse; Hypothesis allows 500
    shrinks): the engine keeps the first hanging case, confirms it once and
    goes on. The finding is the same timeout signature."""
    from harness.engine.result import Result
    from harness.engine.runner import fuzz_path

    path, result = _Hangs(), Result()
    fuzz_path(path, examples=40, deadline=None, seed=0, result=result, save_dir=None)
    hangs = [d for d in result.divergences if d.kind == "timeout"]
    assert hangs and len({d.signature for d in hangs}) == 1, result.divergences
    assert path.calls <= 40 + 2 * len(hangs) + 2, path.calls  # the examples, a confirmation each, nothing shrunk


class _Wrong(_Hangs):
    """A path whose every case with two or more nodes gets a wrong grad."""

    name = "wrong"

    def run(self, case):
        obs = super().run(case)
        for v in obs.violations:
            v.kind, v.key = "value", "value"
        return obs


def test_a_first_hit_the_ledger_settles_is_kept_as_drawn():
    """The gate keeps a first hit whose signature the ledger already places
    on its path as drawn (every shrink step of a compile path compiles); any
    other hit still shrinks, and both find the same signatures in the same
    examples."""
    from harness.engine import session

    def run(settled):
        path = _Wrong()
        result = session.fuzz([path], examples=40, seed=0, settled=settled).result
        return path.calls, result

    signatures = []
    calls_kept, kept = run(lambda path, signature: signatures.append((path, signature)) is None)
    calls_shrunk, shrunk = run(None)
    assert {d.signature for d in kept.divergences} == {d.signature for d in shrunk.divergences} != set()
    assert {p for p, _ in signatures} == {"wrong"}
    assert kept.paths["wrong"].examples == shrunk.paths["wrong"].examples
    assert calls_kept <= 40 + 2 * len(kept.divergences) + 2 < calls_shrunk, (calls_kept, calls_shrunk)

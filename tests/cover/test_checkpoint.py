"""Activation checkpointing paths: regions, the fixed recomputation, stock
contracts, hook-fire counting and the RNG canary."""

from dataclasses import replace

import pytest
import torch

from harness.paths import Availability, Contract, resolve, run_schedule
from harness.paths.checkpoint.data import Regions
from harness.paths.checkpoint.paths import CheckpointPath, forgets_rng as _forgets_rng, regions
from harness.engine.check import check
from harness.engine.result import Result
from harness.engine.runner import fuzz_path
from harness.case.spec import Case, Hook, Input, Node, Param, Schedule, Use
from oracles.checkpoint_fixed import RecomputeMismatch, _Region, checkpoint
from oracles.eager import observe
from tests.helpers import nested


def busy(x_grad: bool = True, param_hooks: tuple[str, ...] = ("hook", "post_accumulate")) -> Case:
    """Everything the issue lists in one small module: w0 tied inside and
    outside the first region (and transposed), dropout and an in-place op in
    the region, a scaling tensor hook and retain_grad inside it, a parameter
    used only inside, two microbatches and parameter hooks."""
    return Case(
        params=(Param("w0", (3, 3)), Param("g1", (3,))),
        inputs=(Input("x0", (2, 3), requires_grad=x_grad),),
        nodes=(
            Node("n0", "matmul", (Use("x0"), Use("w0"))),
            Node("n1", "dropout", (Use("n0"),)),
            Node("n2", "mul_", (Use("n1"), Use("g1"))),
            Node("n3", "relu_", (Use("n2"),)),
            Node("n4", "matmul", (Use("n3"), Use("w0", transpose=True))),
        ),
        outputs=(Use("n4"),),
        schedule=Schedule(microbatches=2, param_hooks=param_hooks),
        hooks=(Hook("n2", "scale", 2),),
        retain_grad=("n1",),
        seed=3,
    ).with_data("checkpoint", Regions((4,)))


def test_regions_take_what_they_use_and_return_what_is_used_later():
    r0, r1 = regions(busy())
    assert (r0.start, r0.end, r0.recomputed, r1.recomputed) == (0, 4, True, False)
    assert r0.inputs == (("x0", None),) and r0.outputs == (("n3", None),)
    assert r1.inputs == (("n3", None),) and r1.outputs == (("n4", None),)


def test_fixed_recomputation_restores_rng_and_counts_each_use_once():
    w = torch.randn(3, 3, requires_grad=True)
    x = torch.randn(2, 3, requires_grad=True)

    def region(x):
        return torch.nn.functional.dropout(x @ w, 0.5) @ w

    fired = []
    w.register_hook(lambda g: fired.append(1))
    torch.manual_seed(0)
    ((region(x) @ w).sum()).backward()
    want, want_x = w.grad.clone(), x.grad.clone()
    w.grad = x.grad = None
    torch.manual_seed(0)
    ((checkpoint(region, x) @ w).sum()).backward()
    assert torch.equal(w.grad, want) and torch.equal(x.grad, want_x)
    assert len(fired) == 2  # once per backward, as in eager


def test_fixed_recomputation_names_a_nondeterministic_region():
    x = torch.randn(3, requires_grad=True)
    calls = []

    def region(x):
        calls.append(1)
        return x.exp() if len(calls) == 1 else x * 2  # saves its result the first time only

    with pytest.raises(RecomputeMismatch, match="saved 1 tensors in forward but 0"):
        checkpoint(region, x).sum().backward()


@pytest.mark.parametrize("name", ["checkpoint.fixed", "checkpoint.nonreentrant.stock", "checkpoint.sequential.stock"])
def test_paths_agree_on_the_busy_case(name):
    case = busy()
    path = resolve(name)[0]
    assert path.supports(case) is None
    assert check(case, path) == []


def test_reentrant_contract_says_why():
    p = resolve("checkpoint.reentrant.stock")[0]
    assert "none of its inputs requires grad" in p.supports(busy(x_grad=False))
    assert "retain_grad" in p.supports(busy())
    assert "#81296" in p.supports(replace(busy(), retain_grad=()))
    assert p.supports(replace(busy(), retain_grad=(), schedule=Schedule(microbatches=2))) is None
    assert "preserve_rng_state=False" in resolve("checkpoint.nonreentrant.lax.stock")[0].supports(busy())
    assert "allow_cache_entry_mutation" in resolve("checkpoint.selective.inverse.stock")[0].supports(busy())


def test_a_hook_that_fires_twice_is_its_own_finding():
    """Reentrant checkpoint on the case its contract leaves out: w0's hooks
    fire in the region's inner backward and again outside it."""
    case = replace(busy(), retain_grad=())
    found = check(case, resolve("checkpoint.reentrant.stock")[0])
    hooks = [d for d in found if d.kind == "hook"]
    assert {d.param for d in hooks} == {"w0"}, found
    assert any("register_hook hook on w0 fired 2 times in backward 0; autograd fires it once per backward" in d.detail
               for d in hooks)


class _RunsTheGraphTwice:
    """Machinery that walks the graph once for a look at the grads, then
    backward for real: every tensor hook fires twice, values stay right."""

    name = "test.twice"
    contract = Contract()

    def availability(self):
        return Availability(True)

    def supports(self, case):
        return None

    def run(self, case):
        def backward(outs, cots, inputs, params):
            live = [(o, c) for o, c in zip(outs, cots) if o.requires_grad]
            torch.autograd.grad([o for o, _ in live], list(params.values()), [c for _, c in live], retain_graph=True)
            torch.autograd.backward([o for o, _ in live], [c for _, c in live])
            return {n: t.grad for n, t in inputs.items()}

        return run_schedule(case, self.name, backward)


def test_tensor_hook_fires_are_counted_and_compared_with_eager():
    case = replace(nested(microbatches=2), hooks=(Hook("n0", "observe", 1),))
    oracle = observe(case)
    assert [s.fired for s in oracle.steps] == [{"n0 tensor_hook": 1}] * 2
    found = check(case, _RunsTheGraphTwice())
    assert [d.detail for d in found] == [
        "the tensor hook on n0 fired 2 times in backward 0; eager autograd fires it 1 time "
        "(a hook that runs twice applies its effect twice)"]
    assert check(case, resolve("eager.accumulate")[0]) == []
    # A split backward runs the shared graph once per pass: held to parameter hooks only.
    assert not [d for d in check(case, resolve("split.fixed")[0]) if d.kind == "hook"]


def test_canary_forgets_rng_on_a_dropout_region():
    canary = CheckpointPath("canary.checkpoint_forgets_rng", _forgets_rng)
    found = check(busy(), canary)
    assert any(d.kind == "value" for d in found)


@pytest.mark.parametrize("exact", [True, False])
def test_fixed_is_clean_over_a_small_budget(exact):
    result = Result()
    fuzz_path(resolve("checkpoint.fixed")[0], examples=15, deadline=None, seed=5, result=result,
              save_dir=None, exact=exact)
    assert result.paths["checkpoint.fixed"].run > 0
    assert result.divergences == [], result.divergences[0].detail


def test_canary_is_in_the_selfcheck_set_against_the_fixed_path():
    """The cold-start catch itself (selfcheck's run_canary, 5 seeds) is
    tests/nocover/test_checkpoint_slow.py: shrinking a caught case costs
    minutes on this machine, more than the default suite may spend."""
    from harness.canaries import all_canaries

    canary = next(c for c in all_canaries() if c.name == "checkpoint_forgets_rng")
    assert canary.base == "checkpoint.fixed" and canary.make().name == "canary.checkpoint_forgets_rng"


def test_where_plain_backward_already_diverges_the_difference_is_not_the_checkpoints():
    """The contract never runs the oracle: the engine runs eager.accumulate
    (``judged_against``) only when a checkpoint path diverges, with the case's
    own tolerance, and drops the divergence when eager has it too."""
    from harness.artifacts import corpus
    from harness.engine.check import CaseCheck

    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    case = corpus.load(os.path.join(root, "cases", "eager", "accumulategrad_stack_alias.json")).case
    fixed = resolve("checkpoint.fixed")[0]
    assert fixed.supports(case) is None and fixed.contract.judged_against == "eager.accumulate"
    assert CaseCheck(case).run(resolve("eager.accumulate")[0]), "eager itself diverges on this case"
    assert CaseCheck(case).run(fixed) == []

    class Alone:  # the same path, judged on its own
        name, contract = fixed.name, replace(fixed.contract, judged_against="")
        supports, run, availability = fixed.supports, fixed.run, fixed.availability

    assert CaseCheck(case).run(Alone()), "without the base, eager's bug shows through the checkpoint path"


# --- recomputation counts, hook fires and the RNG state ------------------


def _wrap(region_cls):
    """A checkpoint built like the fixed one around another ``_Region``: one line changed."""

    def wrap(fn, args):
        region = region_cls(fn, tuple(args), True)
        with torch.autograd.graph.saved_tensors_hooks(region.pack, region.unpack):
            return fn(*args)

    return wrap


class _NoCache(_Region):
    """Forgets to keep the rerun: every saved tensor the backward reads reruns the region."""

    def unpack(self, i):
        return self._rerun()[i]


class _NoFork(_Region):
    """Restores the RNG state for the rerun but never hands the caller's state back."""

    def _rerun(self):
        saved = []
        torch.set_rng_state(self.cpu_state)
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            self.fn(*self.args)
        return saved


class _ProbesTheRerun(_Region):
    """Differentiates the rerun too (a check of it): the hooks the rerun registered fire."""

    def _rerun(self):
        outs, fn = [], self.fn
        self.fn = lambda *a: outs.append(fn(*a)) or outs[-1]
        try:
            saved = super()._rerun()
        finally:
            self.fn = fn
        got = [o for o in outs[0] if o.requires_grad]
        args = [a for a in self.args if a.requires_grad]
        torch.autograd.grad(got, args, [torch.ones_like(o) for o in got], allow_unused=True)
        return saved


def _plain(fn, args):
    """No checkpoint at all: the region keeps its activations."""
    return fn(*args)


def _quiet(case):
    """busy() without retain_grad or parameter hooks: the planted bugs alone show."""
    return replace(case, retain_grad=(), schedule=replace(case.schedule, param_hooks=()))


def test_the_fixed_recomputation_runs_each_region_once_per_forward_and_once_per_backward():
    obs = resolve("checkpoint.fixed")[0].run(busy())
    assert [s.recomputed for s in obs.steps] == [{"n0..n3 forward": 1, "n0..n3 backward": 1}] * 2
    assert obs.steps[0].rng is not None and obs.steps[0].rng == observe(busy()).steps[0].rng
    # No random op: no RNG state is recorded (nothing seeds the generator).
    plain = replace(busy(), nodes=tuple(n if n.op != "dropout" else Node("n1", "relu", n.args) for n in busy().nodes))
    assert all(s.rng is None for s in resolve("checkpoint.fixed")[0].run(plain).steps)


def test_a_region_recomputed_per_saved_tensor_is_a_finding():
    found = check(_quiet(busy()), CheckpointPath("test.no_cache", _wrap(_NoCache)))
    assert [(d.kind, d.param) for d in found] == [("recompute", "n0..n3")], found
    # One rerun per saved tensor read: x0 and w0 (matmul), the mask, n1 and g1 (mul_), relu_'s result.
    assert "recomputed 6 times during backward 0" in found[0].detail and found[0].ratio == 6


def test_a_region_never_recomputed_is_a_finding_and_one_that_saved_nothing_is_not():
    found = check(_quiet(busy()), CheckpointPath("test.plain", _plain))
    assert [(d.kind, d.param) for d in found] == [("recompute", "n0..n3")], found
    assert "not recomputed during backward 0" in found[0].detail and "n0, n1, n2, n3" in found[0].detail
    # x0 + x0 in a region saves nothing: no rerun is needed, and reentrant's rerun of it is allowed.
    adds = Case(params=(Param("w0", (3, 3)),), inputs=(Input("x0", (2, 3), requires_grad=True),),
                nodes=(Node("n0", "add", (Use("x0"), Use("x0"))), Node("n1", "matmul", (Use("n0"), Use("w0")))),
                outputs=(Use("n1"),)).with_data("checkpoint", Regions((1,)))
    for name in ("checkpoint.fixed", "checkpoint.reentrant.stock"):
        obs = resolve(name)[0].run(adds)
        assert obs.steps[0].recomputed["n0 backward"] == (name == "checkpoint.reentrant.stock"), name
        assert check(adds, resolve(name)[0]) == [], name
    assert check(adds, CheckpointPath("test.plain", _plain)) == []


def test_a_recomputation_that_fires_the_users_hooks_again_is_a_finding():
    found = check(_quiet(busy()), CheckpointPath("test.probes", _wrap(_ProbesTheRerun)))
    assert [(d.kind, d.param) for d in found] == [("hook", "n2")], found
    assert "fired 2 times in backward 0; eager autograd fires it 1 time" in found[0].detail


def test_a_hook_fired_fewer_times_counts_on_a_recomputing_path_only():
    from harness.compare.values import compare

    case = _quiet(busy())
    oracle = observe(case)
    obs = resolve("checkpoint.fixed")[0].run(case)
    assert compare(case, oracle, obs) == []
    obs.steps[1].fired = {}
    found = compare(case, oracle, obs)
    assert [(d.kind, d.param, d.microbatch) for d in found] == [("hook", "n2", 1)], found
    assert "fired 0 times in backward 1; eager autograd fires it 1 time" in found[0].detail
    for s in obs.steps:
        s.recomputed = None  # a graph wrapper may skip a Python hook: values tell
    assert compare(case, oracle, obs) == []


def test_an_rng_state_left_where_the_recomputation_put_it_is_a_finding():
    """_NoFork reproduces the region's mask (grads stay right) but leaves the
    generator after the region's draws, not after the dropout that follows it."""
    base = _quiet(busy())
    case = replace(base, nodes=base.nodes + (Node("n5", "dropout", (Use("n4"),)),), outputs=(Use("n5"),))
    found = check(case, CheckpointPath("test.no_fork", _wrap(_NoFork)))
    assert [(d.kind, d.microbatch) for d in found] == [("rng", 0)], found
    assert "RNG state after backward 0 differs from eager's" in found[0].detail
    assert check(case, resolve("checkpoint.fixed")[0]) == []
    # The canary's missing restore redraws the mask and moves the generator: both show.
    kinds = {d.kind for d in check(case, CheckpointPath("canary", _forgets_rng))}
    assert kinds == {"value", "rng"}, kinds


def test_sequential_counts_the_segments_torch_checkpoints():
    """checkpoint_sequential with 3 segments over 5 blocks: 1 block each for
    the first two, the last 3 blocks run plainly."""
    case = busy()  # one cut: 3 segments
    obs = resolve("checkpoint.sequential.stock")[0].run(case)
    assert obs.failure is None
    assert obs.steps[0].recomputed == {"n0 forward": 1, "n0 backward": 1, "n1 forward": 1, "n1 backward": 1}


def test_a_region_run_twice_in_the_forward_is_a_finding():
    """A wrapper that runs the region once to look (say, for shapes) and once under checkpoint."""

    def looks_first(fn, args):
        with torch.no_grad():
            fn(*args)
        return checkpoint(fn, *args)

    found = check(_quiet(busy()), CheckpointPath("test.looks_first", looks_first))
    assert any(d.kind == "recompute" and "ran its forward 2 times in forward 0" in d.detail for d in found), found
    assert any(d.kind == "rng" for d in found), found  # its dropout drew twice

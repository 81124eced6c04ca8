"""The ``func`` family: torch.func's transforms held to the oracle, its
canaries caught, its refusals named, its standalone scripts run, and the
custom autograd Functions the transforms need (``setup_context``) unchanged
for plain autograd."""

from __future__ import annotations

import dataclasses
import runpy

import pytest
import torch

from harness.artifacts.repro import script
from harness.case.functions import LayoutMatmul, Pair, PassThrough
from harness.case.spec import Case, Event, Hook, Input, Node, Param, Schedule, Use
from harness.engine.check import check
from harness.engine.runner import fuzz
from harness.gate.selfcheck import run_canary
from harness.paths import resolve
from harness.paths.func.canaries import canaries
from tests.helpers import nested

NAMES = ["func.grad", "func.vjp", "func.vmap", "func.eager"]


def _paths(*names: str) -> list:
    return [p for n in names for p in resolve(n)]


def test_the_family_lists_its_paths_and_they_are_available():
    assert [p.name for p in resolve("func")] == NAMES
    assert all(p.availability().ok for p in resolve("func"))


@pytest.mark.parametrize("exact", [True, False])
def test_grad_vjp_and_their_twin_agree_with_the_oracle(exact):
    names = ("func.grad", "func.vjp", "func.eager")
    result = fuzz(_paths(*names), examples=200, seed=0, exact=exact, progress=lambda s: None)
    assert not result.divergences, result.divergences[0].detail
    assert all(result.paths[n].run == 200 for n in names), {n: result.paths[n].run for n in names}


def test_vmap_agrees_with_the_oracle():
    """Exact mode: every value is an integer, any difference at all is wrong."""
    result = fuzz(_paths("func.vmap"), examples=200, seed=0, exact=True, progress=lambda s: None)
    assert not result.divergences, result.divergences[0].detail
    assert result.paths["func.vmap"].run == 200


@pytest.mark.parametrize("canary", canaries(), ids=lambda c: c.name)
def test_each_canary_is_caught_against_its_good_path(canary):
    got = run_canary(canary, seed=0)
    assert got.state == "caught", got.detail
    assert got.examples is not None and got.examples <= 50, got.examples


def _unused(**schedule) -> Case:
    """``x0 @ w0`` beside a trainable ``u1`` no output reaches and a frozen
    ``f2`` used: eager leaves ``u1.grad`` and ``f2.grad`` None."""
    return Case(params=(Param("w0", (3, 3)), Param("u1", (3, 3)), Param("f2", (3, 3), requires_grad=False)),
                inputs=(Input("x0", (2, 3), requires_grad=True), Input("x1", (2, 3))),
                nodes=(Node("n0", "matmul", (Use("x0"), Use("w0"))), Node("n1", "matmul", (Use("x1"), Use("f2"))),
                       Node("n2", "add", (Use("n0"), Use("n1")))),
                outputs=(Use("n2"), Use("n1")), schedule=Schedule(microbatches=2, **schedule))


@pytest.mark.parametrize("name", NAMES)
def test_a_grad_eager_leaves_none_stays_none(name):
    (path,) = resolve(name)
    case = _unused(grad_init="none", steps=2, zero_grad="set_to_none")
    obs = path.run(case)
    assert obs.failure is None and all(s.grads["u1"] is None and s.grads["f2"] is None for s in obs.steps)
    assert all(s.grads["w0"] is not None for s in obs.steps) and not check(case, path)


def _with(case: Case, **fields) -> Case:
    return dataclasses.replace(case, **fields)


def test_refusals_name_their_reasons():
    grad, vjp, vmap, twin = resolve("func")
    base = nested(microbatches=2)
    retained = _with(base, retain_grad=("n0",))
    hooked = _with(base, hooks=(Hook("n0", "scale", 2),))
    param_hooks = _with(base, schedule=Schedule(microbatches=2, param_hooks=("hook",)))
    lifetime = _with(base, schedule=Schedule(microbatches=2, events=(Event(0, "empty_cache"),)))
    for path in (grad, vjp, vmap, twin):
        assert "retain_grad" in path.supports(retained)
        assert "parameter hooks" in path.supports(param_hooks)
        assert "buffer-lifetime" in path.supports(lifetime)
    assert grad.supports(hooked) is None and vjp.supports(hooked) is None and twin.supports(hooked) is None
    assert "tensor hooks" in vmap.supports(hooked)
    # mul_ writing an input-dependent value into a tensor computed from parameters only.
    shared = Case(params=(Param("w0", (2, 3)),), inputs=(Input("x0", (2, 3), requires_grad=True),),
                  nodes=(Node("n0", "mul_", (Use("w0"), Use("x0"))),), outputs=(Use("n0"),),
                  schedule=Schedule(microbatches=2))
    assert "mul_ writes an input-dependent value into w0" in vmap.supports(shared)
    assert grad.supports(shared) is None and not check(shared, grad)
    flipped = _with(shared, nodes=(Node("n0", "mul_", (Use("x0"), Use("w0"))),))
    assert vmap.supports(flipped) is None and not check(flipped, vmap)


def test_tensor_hooks_fire_once_inside_grad_and_vjp():
    case = _with(nested(microbatches=2), hooks=(Hook("n0", "scale", 3),))
    for path in _paths("func.grad", "func.vjp", "func.eager"):
        obs = path.run(case)
        assert all(s.fired.get("n0 tensor_hook") == 1 for s in obs.steps), (path.name, [s.fired for s in obs.steps])
        assert not check(case, path), path.name


def _dropout_case() -> Case:
    return Case(params=(Param("w0", (3, 3)), Param("u1", (3, 3))), inputs=(Input("x0", (2, 3), requires_grad=True),),
                nodes=(Node("n0", "matmul", (Use("x0"), Use("w0"))), Node("d0", "dropout", (Use("n0"),)),
                       Node("n1", "pair", (Use("d0"), Use("x0"))), Node("n2", "passthrough", (Use("n1", index=0),)),
                       Node("n3", "layout_matmul", (Use("n2"), Use("w0")), (("layout", "buffer_view"),))),
                outputs=(Use("n3"), Use("n1", index=1)),
                schedule=Schedule(microbatches=3, steps=2, grad_init="prefilled", zero_grad="zeros"))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("case", [nested(microbatches=2), _unused(steps=2, zero_grad="zeros"), _dropout_case()],
                         ids=["nested", "unused", "dropout"])
def test_the_standalone_script_runs_the_path_and_agrees(name, case, tmp_path):
    (path,) = resolve(name)
    assert not check(case, path)
    file = tmp_path / "repro.py"
    file.write_text(script(case, name, path.repro(case)))
    assert runpy.run_path(str(file), run_name="gradfuzz_repro")["main"]() == 0


def _layout_grads(layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.arange(12.0).reshape(3, 4).requires_grad_()
    b = torch.arange(8.0).reshape(4, 2).requires_grad_()
    out = LayoutMatmul.apply(a, b, layout)
    return torch.autograd.grad(out, (a, b), torch.ones_like(out))


def test_layout_matmul_keeps_its_grad_layouts_for_plain_autograd():
    """The ``setup_context`` form returns what ``forward(ctx, ...)`` did: the
    same values, strides and storage offsets."""
    plain = _layout_grads("contiguous")
    (ta, tb), (va, vb) = _layout_grads("transposed"), _layout_grads("buffer_view")
    assert ta.stride() == (1, 3) and tb.stride() == (1, 4)
    assert va.stride() == (4, 1) and va.storage_offset() == 12 and vb.storage_offset() == 8
    assert va._base is not None and va._base.shape == (2, 3, 4)
    for got in ((ta, tb), (va, vb)):
        assert all(torch.equal(g, p) for g, p in zip(got, plain))


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "buffer_view"])
def test_the_custom_functions_run_under_every_transform(layout):
    torch.manual_seed(0)
    w, xs = torch.randn(4, 4), torch.randn(3, 2, 4)

    def loss(w, x):
        p, s = Pair.apply(PassThrough.apply(x), x)
        return (LayoutMatmul.apply(p + s, w, layout) ** 2).sum()

    def eager(x):
        w_ = w.clone().requires_grad_()
        loss(w_, x).backward()
        return w_.grad

    want = torch.stack([eager(x) for x in xs])
    assert torch.allclose(torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(w, xs), want)
    _, fn = torch.func.vjp(lambda w: loss(w, xs[0]), w)
    assert torch.allclose(fn(torch.tensor(1.0))[0], want[0])

"""The model-part ops against finite differences, their magnitude
bounds against the ops themselves, and exact mode where an op allows it."""

import pytest
import torch

from harness.case.ops import OPS

B, D, V = 3, 4, 5
# Each new op: its arguments (shape, and whether a grad is checked for it) and attributes.
CASES = {
    "gelu": ([(B, D)], {}),
    "silu": ([(B, D)], {}),
    "softmax": ([(B, D)], {}),
    "log_softmax": ([(B, D)], {}),
    "layer_norm": ([(B, D), (D,)], {}),
    "rms_norm": ([(B, D), (D,)], {}),
    "embedding": ([(V, D)], {"idx": (0, 3, 3), "padding_idx": None}),
    "embedding_pad": ([(V, D)], {"idx": (0, 3, 1), "padding_idx": 3}),
    "cross_entropy": ([(B, V)], {"target": (4, 0, 4)}),
    "sdpa": ([(B, D), (B, D), (B, D)], {"causal": 0}),
    "sdpa_causal": ([(B, D), (B, D), (B, 2)], {"causal": 1}),
    "add_": ([(B, D), (D,)], {}),
    "expand": ([(1, D)], {"shape": (B, D)}),
    "index_select": ([(B, D)], {"dim": 1, "idx": (3, 0, 0)}),
    "gather": ([(B, D)], {"dim": 1, "seed": 7}),
    "scatter_add": ([(B, D), (B, D)], {"dim": 0, "seed": 8}),
    "index_add": ([(B, D), (2, D)], {"idx": (2, 2)}),
}


def _op(name: str):
    return OPS[name.removesuffix("_pad").removesuffix("_causal")]


def _args(name: str, gen: torch.Generator, dtype=torch.float64, integers: bool = False) -> list[torch.Tensor]:
    shapes, _ = CASES[name]
    if integers:
        return [torch.randint(-3, 4, s, generator=gen).to(dtype).requires_grad_() for s in shapes]
    return [torch.randn(s, generator=gen, dtype=dtype).requires_grad_() for s in shapes]


@pytest.mark.parametrize("name", CASES)
def test_autograd_agrees_with_finite_differences(name):
    op, attrs = _op(name), CASES[name][1]
    args = _args(name, torch.Generator().manual_seed(0))
    fn = lambda *t: op.run(list(t), attrs)  # noqa: E731
    pad = attrs.get("padding_idx")
    if pad is not None:  # documented: the padding row is read but gets no grad: hold it at a constant
        row = args[0][pad:pad + 1].detach().clone()

        def fn(e):
            return op.run([torch.cat([e[:pad], row, e[pad + 1:]])], attrs)
    assert torch.autograd.gradcheck(fn, tuple(args), eps=1e-6, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("seed", range(5))
def test_bound_dominates_value_and_grads_term_by_term(name, seed):
    op, attrs = _op(name), CASES[name][1]
    gen = torch.Generator().manual_seed(seed)
    args = [a * 3 for a in _args(name, gen)]
    args = [a.detach().requires_grad_() for a in args]
    out = op.run(args, attrs)
    dy = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad(out, args, dy, allow_unused=True)
    abs_args = [a.detach().abs().requires_grad_() for a in args]
    bound = (op.bound or op.run)(abs_args, attrs)
    bgrads = torch.autograd.grad(bound, abs_args, dy.abs(), allow_unused=True)
    assert (out.detach().abs() <= bound.detach() * (1 + 1e-9) + 1e-12).all(), name
    for g, b in zip(grads, bgrads):
        if g is not None:
            assert b is not None and (g.abs() <= b * (1 + 1e-9) + 1e-12).all(), name


@pytest.mark.parametrize("name", [n for n in CASES if _op(n).exact])
def test_exact_ops_are_exact_in_float32_on_small_integers(name):
    op, attrs = _op(name), CASES[name][1]
    a64 = _args(name, torch.Generator().manual_seed(1), integers=True)
    a32 = [a.detach().float().requires_grad_() for a in a64]
    o64, o32 = op.run(a64, attrs), op.run(a32, attrs)
    dy = torch.randint(-3, 4, o64.shape, generator=torch.Generator().manual_seed(2)).double()
    assert torch.equal(o32.double(), o64)
    g64 = torch.autograd.grad(o64, a64, dy, allow_unused=True)
    g32 = torch.autograd.grad(o32, a32, dy.float(), allow_unused=True)
    for x, y in zip(g64, g32):
        assert (x is None) == (y is None) and (x is None or torch.equal(y.double(), x))


def test_padding_row_gets_no_grad():
    e = torch.randn(V, D, dtype=torch.float64, requires_grad=True)
    OPS["embedding"].run([e], CASES["embedding_pad"][1]).sum().backward()
    assert torch.equal(e.grad[3], torch.zeros(D, dtype=torch.float64))
    assert torch.equal(e.grad[0], torch.ones(D, dtype=torch.float64))


@pytest.mark.parametrize("block", ["embed", "head", "norm", "attention", "mlp", "index", "expand"])
@pytest.mark.parametrize("exact", [True, False])
def test_each_model_block_builds_valid_round_tripping_cases(block, exact):
    from harness.case.spec import Case, Schedule
    from harness.generate import interpret

    made = set()
    for variant in range(4):
        case = interpret([(block, 0, variant), (block, 1, variant)], dim=3, batch=2, x_grad=True, exact=exact,
                         out_kind=0, schedule=Schedule(), seed=1)
        assert Case.loads(case.dumps()) == case
        made |= {n.op for n in case.nodes}
    want = {"embed": {"embedding"}, "head": {"matmul"} | (set() if exact else {"cross_entropy", "softmax"}),
            "norm": set() if exact else {"layer_norm", "rms_norm"},
            "attention": set() if exact else {"sdpa", "layer_norm"}, "mlp": set() if exact else {"silu", "gelu"},
            "index": {"index_select", "gather", "scatter_add", "index_add"}, "expand": {"expand"}}[block]
    assert want <= made, (block, made)

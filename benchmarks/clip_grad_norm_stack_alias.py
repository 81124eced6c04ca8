"""clip_grad_norm_ scales two parameters' grads twice when AccumulateGrad made them alias.

Torch only:  python benchmarks/clip_grad_norm_stack_alias.py

After ``x @ torch.stack([w0, w1]).sum(0) @ w2`` the grads of w0 and w1 are two
views of one buffer (sum(0)'s backward expands, stack's unbinds), and
AccumulateGrad adopts both as ``.grad`` (the steal of pytorch#34082, ledger
``accumulategrad-steals-views``). clip_grad_norm_ computes the right total norm,
then multiplies every grad in place (_foreach_mul_): the shared buffer is
multiplied twice, so w0.grad and w1.grad come out clip_coef times too small
(coef**2 instead of coef); w2's is right. One backward is enough. The same
through torch.compile(backend="aot_eager"), whose compiled backward returns the
same views (gradfuzz: compile.aot_eager-value-a326c72566, issue 33's
compile.aot_eager-value-3020ddcc0e; eager.accumulate-value-f644a2c4ee).
Inductor returns fresh grads and agrees.

Workaround (ledger ``clone-grads``): a hook on each parameter returning a clone
of its grad, so AccumulateGrad never adopts a shared view.
Exit 1 when the bug shows.
"""
import sys

import torch


def run(backend: str | None, clone: bool) -> tuple[list[torch.Tensor], list[torch.Tensor], bool]:
    torch.manual_seed(0)
    x = torch.randn(2, 3)
    ws = [torch.randn(3, 3, requires_grad=True) for _ in range(3)]
    if clone:
        for w in ws:
            w.register_hook(torch.clone)

    def f(x, w0, w1, w2):
        return x @ torch.stack([w0, w1]).sum(0) @ w2

    fn = f if backend is None else torch.compile(f, backend=backend, dynamic=False)
    fn(x, *ws).sum().backward()
    aliased = ws[0].grad.data_ptr() == ws[1].grad.data_ptr()
    raw = [w.grad.clone() for w in ws]
    torch.nn.utils.clip_grad_norm_(ws, max_norm=1.0)
    return raw, [w.grad for w in ws], aliased


def ratios(raw, got):
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in raw]))
    coef = float(1.0 / (norm + 1e-6))
    want = [g * coef for g in raw]
    return coef, [float((a * e).sum() / (e * e).sum()) for a, e in zip(got, want)]


bad = False
print(f"torch {torch.__version__}")
for backend in (None, "aot_eager", "inductor"):
    for clone in (False, True):
        raw, got, aliased = run(backend, clone)
        coef, r = ratios(raw, got)
        wrong = any(abs(x - 1) > 1e-4 for x in r)
        bad |= wrong and not clone
        print(f"  {backend or 'eager':9s} clone-grads={clone!s:5s}: w0.grad is w1.grad's storage: {aliased!s:5s} "
              f"clip coef {coef:.4g}; clipped actual/expected w0 {r[0]:.4g} w1 {r[1]:.4g} w2 {r[2]:.4g}"
              + ("  WRONG" if wrong else ""))
print("BUG: clipped grads of aliased parameters scaled twice" if bad else "agrees")
sys.exit(1 if bad else 0)

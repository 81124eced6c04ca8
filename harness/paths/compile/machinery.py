"""A compile flavour as a standalone script calls it (``harness.repro``):
``torch.compile`` with the flavour's settings, so a finding reproduces
without gradfuzz."""

from __future__ import annotations

from harness.paths.base import Repro
from harness.paths.compile.flavors import Flavor


def machinery(f: Flavor, backend: str) -> Repro:
    """The case's forward through ``torch.compile`` as ``f`` calls it, with
    ``backend`` (a named one: a callable backend has no standalone form)."""
    make = f"torch.compile({{fn}}, backend={backend!r}, dynamic={f.dynamic})"
    lines = [f"DEVICE = {f.device!r}", ""]
    if backend == "inductor":
        lines += ["# Inductor draws torch.rand from its own generator unless told to fall back to eager's",
                  "import torch._inductor.config", "", "torch._inductor.config.fallback_random = True", ""]
    if f.compiled_autograd:
        lines += ["# compiled autograd, switched on as documented: backward called inside a compiled function",
                  "torch._dynamo.config.compiled_autograd = True", "",
                  "", "def _backward_body(outs, cots):", "    torch.autograd.backward(outs, cots)", "", "",
                  f"_compiled_backward = {make.format(fn='_backward_body')}"]
    # Seeded inside a compiled function, Inductor (fallback_random) differentiated another
    # dropout mask than its forward drew: the RNG is seeded before the call, as gradfuzz does.
    lines += ["# A forward that draws random masks is compiled unseeded; the RNG is seeded before each call.",
              "_SEEDED = 'RNG_SEED' in globals()", "", "",
              "def _unseeded(v):", "    return forward(v, seeded=False)", "", "",
              "def _seed():", "    if _SEEDED:", "        torch.manual_seed(RNG_SEED)", "", ""]
    lines.append(f"_compiled = {make.format(fn='(_unseeded if _SEEDED else forward)')}" if f.compile_forward
                 else "_compiled = forward")
    lines.append("_warmed = []")
    lines += ["", "", "def machinery_forward(v):",
              f'    """The forward under test: {f.describe()}."""']
    if f.other_size_first:
        lines += [
            "    if not _warmed:  # one forward and backward at batch size + 1 on copies: the artifact is compiled for it",
            "        _warmed.append(True)",
            "        w = {n: torch.nn.Parameter(t.detach().clone(), requires_grad=t.requires_grad) if n in PARAMS",
            "             else (torch.cat([t.detach(), t.detach()[:1]]) if t.dim() >= 2 else t.detach().clone()).requires_grad_(t.requires_grad)",
            "             for n, t in v.items()}",
            "        try:",
            "            _seed()",
            "            outs = [o for o in _compiled(w) if o.requires_grad]",
            "        except RuntimeError:  # the other size does not fit this module's shapes",
            "            outs = []",
            "        if outs:",
            "            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])",
        ]
    lines += ["    _seed()", "    return list(_compiled(v))"]
    call = "_compiled_backward(" if f.compiled_autograd else "torch.autograd.backward("
    body = (
        "    live = [(o, c) for o, c in zip(outs, cots) if o.requires_grad]\n"
        "    if live:\n"
        f"        {call}[o for o, _ in live], [c for _, c in live])\n"
    )
    return Repro(backward=body, forward="\n".join(lines) + "\n")

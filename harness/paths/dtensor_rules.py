"""Contract rules for every family whose forward runs on DTensors (the 1-D
DTensor paths and the 2-D mesh): what DTensor itself refuses or cannot
express, each written once with its reason, so the families refuse alike and
a torch that lifts a restriction lifts it for all of them."""

from __future__ import annotations

import torch
from packaging.version import Version

from harness.case.spec import Case

# Before 2.13 DTensor refuses any in-place op that changes a placement.
REFUSES_INPLACE_REDISTRIBUTION = Version(torch.__version__.split("+")[0]) < Version("2.13")


def inplace_ops(case: Case) -> list[str]:
    return sorted({n.op for n in case.nodes if n.op.endswith("_")})


def refusal(case: Case) -> str | None:
    """Why a case whose forward runs on DTensors is outside what DTensor takes
    (mixed operands, in-place placement changes on an older torch); None:
    these rules let it through."""
    from harness.case import opinfo
    from harness.case.ops import OPS

    plain = sorted({n.op for n in case.nodes if OPS[n.op].plain_tensors})
    if plain:
        return (f"{', '.join(plain)} build(s) a plain index or mask tensor inside the forward: DTensor refuses "
                f"mixed operands (the forward runs on DTensors)")
    if why := opinfo.mesh_refusal(case):
        return why
    inplace = inplace_ops(case)
    if inplace and REFUSES_INPLACE_REDISTRIBUTION:
        return (f"{', '.join(inplace)} in place on a DTensor: this torch's DTensor refuses in-place ops that change "
                f"a placement ('in-place operations that require placement changes are not supported'); 2.13 "
                f"takes them")
    if any(n.op == "sdpa" for n in case.nodes):
        # On every backend: on CUDA too, shapes the fused kernels do not take (fp32, causal, tiny heads)
        # fall back to the math kernel, and one rule keeps the cases drawn the same under gloo and NCCL.
        return ("scaled_dot_product_attention falls back to the math kernel (always on CPU, on CUDA for shapes "
                "the fused kernels do not take), which builds a plain attention bias: DTensor refuses mixed "
                "operands")
    if any(n.op == "layout_matmul" and n.attr("layout") == "buffer_view" for n in case.nodes):
        return "a buffer_view grad copies a DTensor into a plain buffer (DTensor refuses mixed operands)"
    return None


def uneven_view(case: Case, sharded: list[str]) -> str | None:
    """A reshape beside sharded parameters: DTensor refuses views that would
    shard a dim unevenly."""
    if sharded and any(n.op == "reshape" for n in case.nodes):
        return ("a reshape with sharded parameters: DTensor refuses views that would shard a dim unevenly "
                "(\"Please redistribute the tensor before this operation\", pytorch/pytorch#143372)")
    return None

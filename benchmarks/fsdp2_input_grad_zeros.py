"""FSDP2 gives a forward input that requires grad but reaches no output a zero
``.grad``; eager leaves it None.

Torch only, two ranks on gloo (spawned here, no torchrun):

    python benchmarks/fsdp2_input_grad_zeros.py

The module is ``forward(x0, x1) = x0 @ w0``: x1 requires grad and is never
read. Eager autograd never reaches x1, so ``x1.grad`` stays None. Under
``fully_shard`` the root's pre-forward passes every input that requires grad
through ``RegisterPostBackwardFunction`` (torch/distributed/fsdp/_fully_shard/
_fsdp_param_group.py, ``_register_post_backward_hook``), an identity
``autograd.Function`` whose backward returns its incoming grads. Custom
Functions materialize grads by default (``ctx.set_materialize_grads``, default
True: an output nobody used is handed to backward as zeros), so once x0's
grad reaches that Function's backward, x1's output grad is a zero tensor and
AccumulateGrad stores it. The third check patches that one Function to
``set_materialize_grads(False)`` and x1.grad is None again: the zeros are
torch's, not this script's.

Why it matters: an optimizer steps a parameter-like tensor whose grad is a
zero tensor and skips one whose grad is None. The last check puts x1 in an
AdamW with weight decay: eager leaves x1 alone, FSDP2 decays it.

gradfuzz: fsdp2.stock-value-84e42fbd42, ledger entry
fsdp2-unused-input-gets-zero-grad, cases/split/unused_input_requires_grad_raises.json.
Upstream: the fix was landed and backed out: pytorch/pytorch#133498
("[FSDP2] Set ctx.set_materialize_grads(False) for post-backward", Aug 2024)
and #135059 (its back-out, Sep 2024, over a model-quality difference in an
internal model). nn.Module.register_full_backward_hook's BackwardHookFunction
does the same to an unused input (printed as a control, no process group).
Prints one line per check; exit 1 when the bug shows.
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w0 = nn.Parameter(torch.arange(9.0).reshape(3, 3) / 8)

    def forward(self, x0: torch.Tensor, x1: torch.Tensor) -> torch.Tensor:
        return x0 @ self.w0  # x1 is never read


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    x0 = torch.arange(6.0).reshape(2, 3).requires_grad_()
    x1 = torch.ones(2, 3).requires_grad_()
    return x0, x1


def grad_of(t: torch.Tensor) -> str:
    return "None" if t.grad is None else f"a tensor, max |.| = {t.grad.abs().max().item():g}"


def run(rank: int, world: int, port: int, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as pg

    mesh = init_device_mesh("cpu", (world,))
    out = {}

    x0, x1 = inputs()
    Net()(x0, x1).sum().backward()
    out["eager"] = grad_of(x1)

    def sharded_backward() -> tuple[torch.Tensor, torch.Tensor]:
        model = fully_shard(Net(), mesh=mesh)
        x0, x1 = inputs()
        model(x0, x1).sum().backward()
        return x0, x1

    _, x1 = sharded_backward()
    out["fully_shard"] = grad_of(x1)

    # The mechanism: the same run with RegisterPostBackwardFunction told not to materialize grads.
    # 2.13 sets ctx up in setup_context, 2.11 in forward(ctx, ...): patch whichever holds ctx.
    fn = pg.RegisterPostBackwardFunction
    where = "setup_context" if "setup_context" in fn.__dict__ else "forward"
    original = fn.__dict__[where]

    def no_materialize(ctx, *rest):
        result = original.__func__(ctx, *rest)
        ctx.set_materialize_grads(False)
        return result

    setattr(fn, where, staticmethod(no_materialize))
    try:
        _, x1 = sharded_backward()
        out["fully_shard, RegisterPostBackwardFunction with set_materialize_grads(False)"] = grad_of(x1)
    finally:
        setattr(fn, where, original)

    # The consequence: AdamW with weight decay steps x1 only where its grad is a tensor.
    def after_adamw(x0: torch.Tensor, x1: torch.Tensor) -> str:
        before = x1.detach().clone()
        torch.optim.AdamW([x0, x1], lr=0.1, weight_decay=0.5).step()
        return "unchanged" if torch.equal(before, x1.detach()) else f"changed to {x1[0, 0].item():g} (was 1)"

    x0, x1 = inputs()
    Net()(x0, x1).sum().backward()
    out["AdamW(weight_decay=0.5) on x1, eager"] = after_adamw(x0, x1)
    out["AdamW(weight_decay=0.5) on x1, fully_shard"] = after_adamw(*sharded_backward())
    if rank == 0:
        q.put(out)
    dist.destroy_process_group()


def full_backward_hook_control() -> str:
    """The same shape of wrapper in torch.nn, without FSDP: a module full backward hook."""
    m = Net()
    m.register_full_backward_hook(lambda *a: None)
    x0, x1 = inputs()
    m(x0, x1).sum().backward()
    return grad_of(x1)


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    mp.spawn(run, args=(2, 29000 + os.getpid() % 1000, q), nprocs=2)
    out = q.get()
    print(f"torch {torch.__version__}, 2 ranks on gloo; forward(x0, x1) = x0 @ w0, x1 requires grad, unused")
    for k, v in out.items():
        print(f"  x1.grad, {k}: {v}" if not k.startswith("AdamW") else f"  {k}: {v}")
    print(f"  control, no FSDP: x1.grad under nn.Module.register_full_backward_hook: {full_backward_hook_control()}")
    bug = out["eager"] == "None" and out["fully_shard"] != "None"
    print("BUG: fully_shard gives an unused input a zero .grad where eager leaves None" if bug else "agrees")
    sys.exit(1 if bug else 0)

"""Inductor (CPU, torch 2.13) drops the gradient that flows through a gather
h.reshape(-1)[ix] when the same graph also looks up an embedding: the input
grad comes back as the grad output alone. Eager and aot_eager keep it; 2.11.0
and 2.14.1 agree with eager."""
import torch

torch.manual_seed(0)
s = torch.rand(20, 20) * 16 - 8
e0 = torch.randn(4, 3, requires_grad=True)


def forward(h, e0, embed):
    ix = torch.arange(400) % h.numel()
    x = s + 0.0625 * torch.tanh(h.reshape(-1)[ix].reshape(20, 20))
    out = h + (x * x).reshape(-1)[:396].reshape(-1, h.numel()).sum(0).reshape(h.shape)
    return out + torch.nn.functional.embedding(torch.tensor([0, 2]), e0) if embed else out


h0, g = torch.randn(2, 3), torch.randn(2, 3)
print("torch", torch.__version__)
for embed in (True, False):
    grads = {}
    for backend in ("eager", "aot_eager", "inductor"):
        torch._dynamo.reset()
        f = forward if backend == "eager" else torch.compile(forward, backend=backend, dynamic=False)
        h = h0.clone().requires_grad_()
        (grads[backend],) = torch.autograd.grad(f(h, e0, embed), [h], g)
    for backend in ("aot_eager", "inductor"):
        off = (grads[backend] - grads["eager"]).abs().max().item()
        print(f"embedding in the graph: {embed}; {backend} input grad vs eager: max |diff| {off:.3g}"
              + ("   <-- the gather's part is missing" if off > 1e-3 else ""))

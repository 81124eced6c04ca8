"""torch.func.vmap over grad of scatter_reduce(..., "prod", include_self=False)."""
import torch

torch.manual_seed(0)
x = torch.rand(3, 10, 5, dtype=torch.float64) + 0.5
index = torch.randint(0, 10, (5, 5))
src = torch.rand(5, 5, dtype=torch.float64) + 0.5


def loss(xi):
    return xi.scatter_reduce(0, index, src, "prod", include_self=False).sum()


print("torch", torch.__version__)
ref = torch.stack([torch.func.grad(loss)(xi) for xi in x])
print("grad per sample: ok")
try:
    got = torch.func.vmap(torch.func.grad(loss))(x)
    print("agrees" if torch.allclose(got, ref) else "DIVERGES")
except RuntimeError as e:
    print("vmap(grad): RuntimeError:", str(e)[:150])

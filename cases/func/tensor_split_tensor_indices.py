"""torch.func over torch.tensor_split with a tensor of split indices."""
import torch

x = torch.randn(3, 5, 5, 5, dtype=torch.float64)


def loss(xi):
    idx = torch.tensor([1, 2, 3])  # made inside the function, as a module building its indices would
    return sum(p.sum() * (k + 1) for k, p in enumerate(torch.tensor_split(xi, idx)))


def loss_list(xi):
    return sum(p.sum() * (k + 1) for k, p in enumerate(torch.tensor_split(xi, [1, 2, 3])))


def attempt(what, fn):
    try:
        out = fn()
        print(f"{what}: ok", tuple(out.shape))
        return out
    except RuntimeError as e:
        print(f"{what}: RuntimeError: {str(e)[:100]}")


print("torch", torch.__version__)
ref = torch.stack([torch.autograd.functional.jacobian(loss, xi) for xi in x])
attempt("grad, tensor indices", lambda: torch.stack([torch.func.grad(loss)(xi) for xi in x]))
attempt("vmap(grad), list indices", lambda: torch.func.vmap(torch.func.grad(loss_list))(x))
attempt("vmap forward, tensor indices", lambda: torch.func.vmap(loss)(x))
got = attempt("vmap(grad), tensor indices", lambda: torch.func.vmap(torch.func.grad(loss))(x))
print("DIVERGES" if got is None or not torch.allclose(got, ref) else "agrees")

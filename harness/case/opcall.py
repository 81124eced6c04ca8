"""An op from torch's OpInfo database applied to a case tensor.

This module imports only torch: ``harness.materialize.source`` pastes
``opinfo_node`` into standalone scripts, so the harness and a repro run the
very same code.

A node reads the op's sample input as a recipe (shape, seed, range: the
values OpInfo chose for the op's domain) and moves it by a bounded amount
that depends on the case tensor ``h``::

    x = s + C * tanh(gather(h))       # h's elements tiled over s's shape
    y = fold(op(x, *args, **kwargs))  # every output element summed into h's shape
    return h + y

The bounded move keeps every value inside the region OpInfo drew from, so
the op stays well-conditioned whatever ``h`` holds, and ``h + y`` keeps the
rest of the case's grads flowing when the op's own grad is small. Tensor
arguments other than the input are constants: float ones by recipe, integer
and boolean ones (indices, masks) by value.

``call`` is plain data, nested tuples with a tag first:
``("C", input, args, kwargs, bound)``; a float tensor recipe
``("T", shape, seed, low, high)``; an integer or boolean tensor
``("I", dtype, shape, values)``; a tuple ``("U", items)``; a dtype
``("D", name)``; scalars as themselves. ``bound`` is
``(vmax, jrow, jcol, n_out)``: the op's largest output magnitude, its
Jacobian's largest row and column sums over the region, and its number of
output elements, which the magnitude-bound network uses.
"""

import torch

MOVE = 0.0625  # C above: how far the case moves the sample's values


def opinfo_recipe(shape, seed, low, high, device, dtype):
    """``shape`` values in [low, high] from ``seed``, by integer arithmetic
    that is exact in int64 (every product stays under 2**53): the same
    numbers eager, a compiled graph and every backend make, and no
    ``torch.Generator``, which stops torch.compile's trace."""
    n = 1
    for d in shape:
        n *= d
    p = 2147483647  # 2**31 - 1, with the multiplier 48271 of the minimal standard generator
    r = (torch.arange(1, n + 1, dtype=torch.int64, device=device) * 48271 + seed) % p
    r = (r * 48271) % p
    r = (r * 48271) % p
    u = r.to(torch.float64) / p
    return (low + (high - low) * u).reshape(shape).to(dtype)


# An input's placement below -1: Partial with this reduce op (-1 Replicate, d Shard(d)).
PARTIAL = {-2: "sum", -3: "avg", -4: "max", -5: "min"}


def placement_name(place):
    if place is None or place == -1:
        return "Replicate"
    return f"Partial({PARTIAL[place]})" if place in PARTIAL else f"Shard({place})"


def opinfo_on_mesh(mesh, place):
    """For an ``h`` that is a DTensor: (wrap, placed, split). ``wrap`` makes
    a local tensor a Replicate DTensor on ``mesh``; ``placed`` places one as
    ``place`` says on the first mesh dimension: Shard(place) where the
    tensor has that dimension, or Partial (``PARTIAL``). ``split``: the
    placements of the grad of the tensor ``placed`` reads (None: Replicate),
    Partial(sum) where each rank's grad is its own piece of it.

    A Partial(sum) or Partial(avg) input is split: each element's whole value
    on one rank (times the rank count for avg, that rank's piece carrying
    the grad) and 0 on the others, so an op that reads a Partial input as if
    it were replicated sees other values; every piece is exact in binary on
    a power-of-two mesh dimension. Max and min hold the value on every rank.
    DTensor refuses to redistribute to Partial from user code, so the
    pieces are made here and handed to ``from_local``."""
    import inspect

    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    rep = [Replicate()] * mesh.ndim
    op = PARTIAL.get(place)
    split = op in ("sum", "avg")

    def wrap(t):
        return DTensor.from_local(t, mesh, rep, run_check=False)

    def partial(t):
        # Older DTensors take no grad_placements; they hand a Partial input's grad back replicated too.
        takes = "grad_placements" in inspect.signature(DTensor.from_local).parameters
        grads = {"grad_placements": rep} if takes else {}
        n, r = mesh.size(0), mesh.get_local_rank(0)
        if split:
            own = (torch.arange(t.numel(), device=t.device).reshape(t.shape) % n) == r
            t = torch.where(own, t, torch.zeros_like(t))
            if op == "avg":
                t = t + (n - 1) * t.detach()
        return DTensor.from_local(t, mesh, [Partial(op)] + rep[1:], run_check=False, **grads)

    def placed(t):
        if op is not None:
            return partial(t)
        t = wrap(t)
        if place is None or place < 0 or place >= t.ndim:
            return t
        return t.redistribute(mesh, [Shard(place)] + rep[1:])

    return wrap, placed, ([Partial("sum")] + rep[1:]) if split else None


def opinfo_node(h, fn, call, const=None, x=None, place=None):
    """``h + fold(fn(s + C * tanh(gather(h)), *args, **kwargs))``; ``const(key, make)``
    may cache the constant tensors per device (None: made on every call).
    Given ``x``, the op's float outputs on ``x`` itself, flattened into one
    tensor (the table builder measures the op's Jacobian with it).
    A DTensor ``h`` (a case whose parameters live on a mesh): the op's
    operands are DTensors too, its input placed as ``place`` says (None or
    -1: Replicate, d: Shard(d), ``PARTIAL``), and its outputs gathered before
    the fold."""
    _, inp, args, kwargs, _bound = call
    keep = const if const is not None else (lambda key, make: make())
    wrap = placed = None
    h_in = h
    if x is None and hasattr(h, "device_mesh"):
        wrap, placed, split = opinfo_on_mesh(h.device_mesh, place)
        h = h.full_tensor(grad_placements=split)
    device = (h if x is None else x).device

    def value(v, dtype, operand=True):
        if not isinstance(v, tuple):
            return v
        tag = v[0]
        if tag == "T":
            _, shape, seed, low, high = v
            key = ("opinfo-T", v, str(device), str(dtype))
            t = keep(key, lambda: opinfo_recipe(shape, seed, low, high, device, dtype))
        elif tag == "I":
            _, name, shape, values = v
            key = ("opinfo-I", v, str(device))
            t = keep(key, lambda: torch.tensor(values, dtype=getattr(torch, name), device=device).reshape(shape))
        elif tag == "D":
            return getattr(torch, v[1])
        else:
            return tuple(value(x, dtype) for x in v[1])
        return wrap(t) if wrap is not None and operand else t

    if x is None:
        s = value(inp, h.dtype, operand=False)
        ix = keep(("opinfo-ix", s.numel(), h.numel(), str(h.device)),
                  lambda: torch.arange(s.numel(), device=h.device) % h.numel())
        x = s + MOVE * torch.tanh(h.reshape(-1)[ix].reshape(s.shape))
        if placed is not None:
            x = placed(x)
    else:
        x = x.clone()  # an in-place variant must not write to the caller's tensor
    out = fn(x, *[value(a, x.dtype) for a in args], **{k: value(a, x.dtype) for k, a in kwargs})
    # In the case's dtype: a conversion (``double``) or a dtype argument must not promote the rest.
    floats = [(o.full_tensor() if hasattr(o, "device_mesh") else o).reshape(-1).to(x.dtype)
              for o in (out if isinstance(out, (tuple, list)) else (out,))
              if isinstance(o, torch.Tensor) and o.is_floating_point()]
    if h is None:
        return torch.cat(floats) if floats else x.new_zeros(0)
    y = None
    for f in floats:
        f = torch.nn.functional.pad(f, (0, (-f.numel()) % h.numel())).reshape(-1, h.numel()).sum(0)
        y = f if y is None else y + f
    if y is None:
        return h_in
    y = y.reshape(h.shape)
    return h_in + (y if wrap is None else wrap(y))

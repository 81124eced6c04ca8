"""Liger's fused linear cross-entropy under gradient accumulation, against a
float64 eager reference (GPU: Liger's kernels are Triton).

Liger computes the weight and input grads in the forward pass and scales
them in place in the backward by the grad output, so the ways a training
loop feeds it a grad output are what this checks: the loss divided by the
accumulation steps, per-token weights (reduction "none"), a second backward
through the same graph (retain_graph), a head weight tied to the input
embedding, and the loss options (ignore_index, label smoothing, class
weights, softcap, z-loss). Each configuration is drawn from a fixed seed;
a mismatch prints the configuration and the error.

    python benchmarks/liger_flce_accum.py [N_CONFIGS] [SEED]    (needs CUDA and liger-kernel)
"""

from __future__ import annotations

import json
import random
import sys
import time

import torch
import torch.nn.functional as F


def draw(rng: random.Random) -> dict:
    reduction = rng.choice(["mean", "sum", "none"])
    smoothing = rng.choice([0.0, 0.0, 0.1])
    return {
        "V": rng.choice([32, 100, 257]), "H": rng.choice([16, 64]), "BT": rng.choice([8, 33]),
        "micro": rng.choice([1, 2, 4]), "reduction": reduction, "bias": rng.random() < 0.5,
        "tied": rng.random() < 0.5, "ignore": rng.choice([0.0, 0.25]), "smoothing": smoothing,
        "ce_weight": smoothing == 0.0 and rng.random() < 0.3, "softcap": rng.choice([None, None, 5.0]),
        "z": rng.choice([0.0, 0.0, 1e-3]), "twice": rng.random() < 0.25,
    }


def reference_loss(x, w, b, y, cfg, ce_w, tok_w):
    """Cross-entropy of x @ w.T + b, written out in float64 as the options define it."""
    logits = x @ w.T + (b if b is not None else 0)
    if cfg["softcap"]:
        logits = cfg["softcap"] * torch.tanh(logits / cfg["softcap"])
    keep = y != -100
    yk = torch.where(keep, y, torch.zeros_like(y))
    logp = torch.log_softmax(logits, -1)
    nll = -logp.gather(1, yk[:, None])[:, 0]
    cw = ce_w[yk] if ce_w is not None else torch.ones_like(nll)
    per = cw * nll
    if cfg["smoothing"]:
        per = (1 - cfg["smoothing"]) * nll - cfg["smoothing"] * logp.mean(-1)
    if cfg["z"]:
        per = per + cfg["z"] * torch.logsumexp(logits, -1) ** 2
    per = per * keep
    if cfg["reduction"] == "none":
        return (per * tok_w).sum()
    if cfg["reduction"] == "sum":
        return per.sum()
    denom = (cw * keep).sum() if ce_w is not None else keep.sum()
    return per.sum() / denom.clamp(min=1)


def run(cfg: dict, seed: int, dev: str) -> dict:
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    g = torch.Generator().manual_seed(seed)
    V, H, BT, k = cfg["V"], cfg["H"], cfg["BT"], cfg["micro"]
    w0 = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.3
    b0 = torch.randn(V, generator=g, dtype=torch.float64) * 0.1 if cfg["bias"] else None
    emb = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.3
    ce_w = torch.rand(V, generator=g, dtype=torch.float64) + 0.5 if cfg["ce_weight"] else None
    steps = []
    for _ in range(k):
        ids = torch.randint(0, V, (BT,), generator=g)
        y = torch.randint(0, V, (BT,), generator=g)
        y[torch.rand(BT, generator=g) < cfg["ignore"]] = -100
        steps.append((ids, y, torch.rand(BT, generator=g, dtype=torch.float64)))
    reps = 2 if cfg["twice"] else 1

    def grads(dtype, device, liger):
        w = w0.to(device, dtype).requires_grad_()
        b = b0.to(device, dtype).requires_grad_() if b0 is not None else None
        e = (w if cfg["tied"] else emb.to(device, dtype).requires_grad_())
        cw = ce_w.to(device, dtype) if ce_w is not None else None
        fn = LigerFusedLinearCrossEntropyLoss(ce_weight=cw, label_smoothing=cfg["smoothing"], reduction=cfg["reduction"],
                                              softcap=cfg["softcap"], lse_square_scale=cfg["z"]) if liger else None
        for ids, y, tw in steps:
            x = e[ids.to(device)]
            y, tw = y.to(device), tw.to(device, dtype)
            if liger:
                loss = fn(w, x, y, b)
                loss = (loss * tw).sum() if cfg["reduction"] == "none" else loss
            else:
                loss = reference_loss(x, w, b, y, cfg, cw, tw)
            for r in range(reps):
                (loss / k).backward(retain_graph=r + 1 < reps)
        out = {"w": w.grad}
        if b is not None:
            out["b"] = b.grad
        if not cfg["tied"]:
            out["emb"] = e.grad
        return {n: t.double().cpu() for n, t in out.items()}

    ref = grads(torch.float64, dev, liger=False)
    got = grads(torch.float32, dev, liger=True)
    errs = {n: float((got[n] - ref[n]).norm() / ref[n].norm().clamp(min=1e-12)) for n in ref}
    return {"ok": all(e < 1e-4 for e in errs.values()), "rel_err": errs}


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    seed = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    import liger_kernel  # noqa: F401  (fail early, naming the missing package)

    rng, bad, t0 = random.Random(seed), 0, time.monotonic()
    for i in range(n):
        cfg = draw(rng)
        try:
            res = run(cfg, seed * 100_000 + i, "cuda")
        except Exception as e:  # a configuration Liger refuses is reported, not counted as wrong
            res = {"ok": None, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        bad += res["ok"] is False
        if res["ok"] is not True:
            print(json.dumps({"i": i, "cfg": cfg, **res}), flush=True)
    print(f"liger fused linear cross-entropy: {n} configurations, {bad} wrong, {time.monotonic() - t0:.1f} s "
          f"(torch {torch.__version__}, liger-kernel {__import__('importlib.metadata').metadata.version('liger-kernel')})")


if __name__ == "__main__":
    main()

"""DeepSpeed's fp16 mixed precision with loss scaling under gradient
accumulation, against a float64 eager reference (GPU; torch and DeepSpeed).

DeepSpeed's CPU accelerator has no fp16, so gradfuzz's deepspeed family never
draws fp16 on CPU; this checks it on one GPU (world size 1, NCCL). With fp16 on,
engine.backward divides the loss by gradient_accumulation_steps (GAS), the
fp16 optimizer multiplies it by the current loss scale, and the scaled fp16
grads accumulate over the micro-steps of a window; step() at the boundary
unscales them into the fp32 master grads, checks for inf/nan and skips the
update (and lowers a dynamic scale) on overflow.

What is read, per window: (grad) just before the boundary engine.step(),
deepspeed.utils.safe_get_full_grad(p) of every parameter divided by
optimizer.loss_scale, the scale in force during the window (it changes only in
step()); (update) the grad step() applied, (fp32 master before - after) / lr
with torch SGD (no momentum) and gradient_clipping 0 (0.19.8 clips to norm 1.0
by default). The masters are FP16_UnfusedOptimizer.fp32_groups for ZeRO 0 and
safe_get_full_fp32_param (through _hp_mapping) for ZeRO 1 and 2. In 0.19.8
safe_get_full_grad returns the fp16 param.grad for ZeRO 0 and, for ZeRO 1 and 2
(whose epilogue clears param.grad), the fp16 flat partition averaged_gradients;
the fp16 optimizers unscale only inside step(), so both are meant to carry the
loss scale. Whether they do is recorded per configuration (accessor: scaled,
unscaled, or scale1 where the scale is 1 and the two agree); the update check
does not depend on that convention. The reference is the same module in float64
with the engine's current fp16 weights and the same fp16-rounded inputs, loss /
GAS summed over the window: DeepSpeed's convention.

Tolerance: fp16 rounds to 2^-11 (about 4.9e-4) relative; a two or three layer
forward, its backward and up to 4 fp16 accumulations give norm-relative errors
of a few 1e-3. The same fp16 training done in plain torch (loss * scale / GAS,
fp16 .grad accumulation, unscaled after) is run beside it and printed as
`floor`. WRONG means a parameter's norm-relative error above max(1e-2, 4 x its
floor), about 20 fp16 ulps; a lost, doubled or stale micro-step gives errors of
order 1/GAS, a scale not undone or undone twice gives a factor of the scale.
The floor is left out where plain fp16 itself overflowed (the bound is then 1e-2).
For a WRONG parameter `ratio` is <got, ref> / <ref, ref> (1/GAS or the scale
point at a convention slip rather than noise).

A window whose boundary step DeepSpeed skipped (engine.skipped_steps grew) is
counted as an overflow window and not compared; a configuration all of whose
windows overflowed is OVERFLOW, not wrong. Non-finite grads in a window
DeepSpeed did not skip are WRONG. A configuration DeepSpeed refuses or crashes
on is ERROR. Drawn per configuration (seeded random): input, hidden (4-32) and
output sizes, activation, bias, a square weight used twice (tied), micro batch
size, GAS 1-4, ZeRO stage 0/1/2, dynamic scale (initial_scale_power 4-8,
loss_scale_window, hysteresis) or a static one, 2-3 windows with SGD lr 0.03
(each window's reference uses the weights the engine has then), and
occasionally a large loss weight that makes the scaled grads overflow fp16.

Found on one H100 (torch 2.11, DeepSpeed 0.19.8; benchmarks/results-s18/fp16-README.md): ZeRO 0 never
scales the loss (engine.backward scales only for a ZeROOptimizer) yet its step() unscales, so every update
is grad / loss_scale; ZeRO 1 and 2 update the scale before unscaling, so a step that raises a dynamic scale
applies half the grad.

    python benchmarks/deepspeed_fp16_accum.py [N_CONFIGS] [SEED]   (needs CUDA and deepspeed)
    python benchmarks/deepspeed_fp16_accum.py --dry                (CPU, bf16, 3 configs: the script's own logic)
    BUDGET_S=300 ...                                               (draw no new configuration after 300 s)
"""

from __future__ import annotations

import gc
import json
import os
import random
import socket
import sys
import time
import traceback

import torch

DRY = "--dry" in sys.argv
LR = 0.03
TOL = 8e-2 if DRY else 1e-2  # norm-relative; bf16 (dry) rounds 8x coarser than fp16
if DRY:
    os.environ["DS_ACCELERATOR"] = "cpu"


def draw(rng: random.Random) -> dict:
    dynamic = rng.random() < 0.6
    return {
        "d_in": rng.choice([3, 8, 16]), "hidden": rng.randint(4, 32), "d_out": rng.choice([1, 4, 8]),
        "act": rng.choice(["relu", "tanh", "gelu", "none"]), "bias": rng.random() < 0.5, "tied": rng.random() < 0.5,
        "mbs": rng.choice([1, 2, 5]), "gas": rng.randint(1, 4), "stage": rng.choice([0, 1, 2]),
        "loss_scale": 0 if dynamic else rng.choice([1, 128, 1024]),
        "scale_power": rng.randint(4, 8), "scale_window": rng.choice([1, 2, 1000]), "hysteresis": rng.choice([1, 2]),
        "windows": rng.choice([2, 3]), "big": rng.choice([1.0] * 8 + [300.0, 3000.0]),
    }


class Net(torch.nn.Module):
    """fc1 -> act -> (mid -> act, twice, one weight: tied) -> fc2."""

    def __init__(self, cfg: dict):
        super().__init__()
        h = cfg["hidden"]
        self.fc1 = torch.nn.Linear(cfg["d_in"], h, bias=cfg["bias"])
        self.mid = torch.nn.Linear(h, h, bias=cfg["bias"]) if cfg["tied"] else None
        self.fc2 = torch.nn.Linear(h, cfg["d_out"], bias=cfg["bias"])
        self.act = cfg["act"]

    def _a(self, x):
        return {"relu": torch.relu, "tanh": torch.tanh, "gelu": torch.nn.functional.gelu}.get(self.act, lambda t: t)(x)

    def forward(self, x):
        h = self._a(self.fc1(x))
        if self.mid is not None:
            h = self._a(self.mid(self._a(self.mid(h))))
        return self.fc2(h)


def build(cfg: dict, values: dict, dtype, dev) -> Net:
    net = Net(cfg)
    with torch.no_grad():
        for n, p in net.named_parameters():
            p.copy_(values[n])
    return net.to(dev, dtype)


def make_values(cfg: dict, g: torch.Generator, low) -> dict:
    """Weights of scale 1/sqrt(fan_in), rounded to the low precision so the engine holds them exactly."""
    out = {}
    for n, p in Net(cfg).named_parameters():
        fan = p.shape[1] if p.dim() == 2 else 4
        out[n] = (torch.randn(p.shape, generator=g, dtype=torch.float64) / fan ** 0.5).to(low).double()
    return out


def ds_config(cfg: dict) -> dict:
    c = {"train_micro_batch_size_per_gpu": cfg["mbs"], "gradient_accumulation_steps": cfg["gas"],
         "zero_optimization": {"stage": cfg["stage"]}, "zero_allow_untested_optimizer": True,
         "steps_per_print": 10 ** 9, "wall_clock_breakdown": False,
         "gradient_clipping": 0.0}  # 0.19.8 clips to norm 1.0 by default; off, so step() applies the grad as is
    if DRY:
        c["bf16"] = {"enabled": True}
    else:
        c["fp16"] = {"enabled": True, "loss_scale": cfg["loss_scale"], "initial_scale_power": cfg["scale_power"],
                     "loss_scale_window": cfg["scale_window"], "hysteresis": cfg["hysteresis"], "min_loss_scale": 1}
    return c


def weights(module) -> dict:
    return {n: p.detach().to("cpu", torch.float64, copy=True) for n, p in module.named_parameters()}


def masters(eng) -> dict:
    """The optimizer's fp32 master weights: FP16_UnfusedOptimizer's fp32_groups (ZeRO 0), else
    safe_get_full_fp32_param (ZeRO 1 and 2, through _hp_mapping)."""
    from deepspeed.utils import safe_get_full_fp32_param

    opt, by_id = eng.optimizer, {}
    for g16, g32 in zip(getattr(opt, "fp16_groups", []), getattr(opt, "fp32_groups", [])):
        by_id.update({id(a): b for a, b in zip(g16, g32)})
    out = {}
    for n, p in eng.module.named_parameters():
        t = by_id.get(id(p))
        t = t if t is not None else safe_get_full_fp32_param(p)
        if t is None:
            raise RuntimeError(f"no fp32 master weight found for {n}")
        out[n] = t.detach().to("cpu", torch.float64, copy=True).reshape(p.shape)
    return out


def reference(cfg, values, window, dtype, dev, scale) -> dict:
    """Window grads of `values` with loss / GAS per micro-step, in `dtype`; for a low dtype the loss is
    multiplied by `scale` and the accumulated .grad divided by it afterwards (plain torch fp16 training)."""
    net = build(cfg, values, dtype, dev)
    for x, probe in window:
        out = net(x.to(dev, dtype))
        if dtype == torch.float64:
            loss = (out * probe.to(dev, dtype)).sum()
        else:  # as the engine's caller does: fp16 output, loss in float32
            loss = (out.float() * probe.to(dev)).sum()
        (loss / cfg["gas"] * scale).backward()
    return {n: (p.grad if p.grad is not None else torch.zeros_like(p)).to("cpu", torch.float64) / scale
            for n, p in net.named_parameters()}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    e = float((a - b).norm() / b.norm().clamp(min=1e-6))
    return float("inf") if e != e else e


def run(cfg: dict, seed: int, dev: str, low) -> dict:
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    g = torch.Generator().manual_seed(seed)
    values = make_values(cfg, g, low)
    data = [[((torch.randn(cfg["mbs"], cfg["d_in"], generator=g)).to(low),
              torch.randn(cfg["mbs"], cfg["d_out"], generator=g) * cfg["big"]) for _ in range(cfg["gas"])]
            for _ in range(cfg["windows"])]
    net = build(cfg, values, torch.float32, dev)
    eng = None
    res = {"verdict": "OK", "compared": 0, "overflow": 0, "floor": 0.0, "scales": []}
    try:
        eng, *_ = deepspeed.initialize(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=LR),
                                       config=ds_config(cfg))
        res["optimizer"] = type(eng.optimizer).__name__
        for w, window in enumerate(data):
            start, m0 = weights(eng.module), masters(eng)
            scale = float(getattr(eng.optimizer, "loss_scale", 1.0))
            skipped = eng.skipped_steps
            got = None
            for k, (x, probe) in enumerate(window):
                out = eng(x.to(dev))
                eng.backward((out.float() * probe.to(dev)).sum())
                if k == len(window) - 1:
                    got = {}
                    for n, p in eng.module.named_parameters():
                        gr = safe_get_full_grad(p)
                        if gr is None:
                            raise RuntimeError(f"safe_get_full_grad({n}) is None at the boundary")
                        got[n] = gr.to("cpu", torch.float64, copy=True) / scale
                eng.step()
            res["scales"].append(scale)
            finite = all(bool(t.isfinite().all()) for t in got.values())
            if eng.skipped_steps > skipped:
                res["overflow"] += 1
                if finite:
                    res.setdefault("skipped_finite", []).append(w)
                continue
            m1 = masters(eng)
            applied = {n: (m0[n] - m1[n]) / LR for n in m0}  # SGD without momentum: the grad step() used
            ref = reference(cfg, start, window, torch.float64, "cpu", 1.0)
            floor = reference(cfg, start, window, low, dev, scale)
            res["compared"] += 1
            for n in ref:
                f = rel(floor[n], ref[n])
                tol = max(TOL, 4 * f) if f < 1 else TOL  # plain fp16 overflowed: no floor
                res["floor"] = max(res["floor"], f if f < 1 else 0.0)
                for what, t in (("grad", got[n]), ("update", applied[n])):
                    e = rel(t, ref[n])
                    res[f"max_rel_{what}"] = max(res.get(f"max_rel_{what}", 0.0), e)
                    if not finite or e > tol:
                        ratio = float((t * ref[n]).sum() / (ref[n] * ref[n]).sum().clamp(min=1e-30))
                        res["verdict"] = "WRONG"
                        res[f"n_bad_{what}"] = res.get(f"n_bad_{what}", 0) + 1
                        if res[f"n_bad_{what}"] <= 3:
                            res.setdefault("bad", []).append({"of": what, "window": w, "param": n, "rel": e,
                                                              "floor": f, "ratio": ratio, "finite": finite})
                # which convention the accessor follows: scaled (divide by loss_scale) or already unscaled
                conv = ("scale1" if scale == 1 else "scaled" if rel(got[n], ref[n]) <= tol
                        else "unscaled" if rel(got[n] * scale, ref[n]) <= tol else "neither")
                res.setdefault("accessor", set()).add(conv)
        if res["compared"] == 0:
            res["verdict"] = "OVERFLOW"
        res["accessor"] = sorted(res.get("accessor", []))
    except Exception as e:  # noqa: BLE001  (DeepSpeed refusing or crashing on a configuration)
        tb = traceback.extract_tb(e.__traceback__)[-1]
        res = {"verdict": "ERROR", "error": f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:240]}",
               "raised_at": f"{os.path.basename(tb.filename)}:{tb.lineno}"}
    finally:
        if eng is not None and hasattr(eng, "destroy"):
            try:
                eng.destroy()
            except Exception:  # noqa: BLE001
                pass
        eng = net = None
        gc.collect()
        if dev == "cuda":
            torch.cuda.empty_cache()
    return res


def setup() -> None:
    import logging

    import deepspeed
    from deepspeed.utils import logger

    logger.setLevel(logging.ERROR)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if not DRY:
        torch.cuda.set_device(0)
    deepspeed.init_distributed(dist_backend="gloo" if DRY else "nccl", verbose=False)


def main() -> None:
    argv = [a for a in sys.argv[1:] if a != "--dry"]
    n = 3 if DRY else int(argv[0]) if argv else 100
    seed = int(argv[1]) if len(argv) > 1 else 0
    if not DRY and not torch.cuda.is_available():
        sys.exit("deepspeed_fp16_accum.py: needs CUDA (DeepSpeed's CPU accelerator has no fp16); "
                 "--dry runs bf16 on CPU")
    import deepspeed

    torch.backends.cuda.matmul.allow_tf32 = False
    setup()
    dev, low = ("cpu", torch.bfloat16) if DRY else ("cuda", torch.float16)
    rng, t0 = random.Random(seed), time.monotonic()
    counts = {"OK": 0, "WRONG": 0, "ERROR": 0, "OVERFLOW": 0}
    windows = {"compared": 0, "overflow": 0, "skipped_finite": 0}
    wrong_stage = {}
    optimizers, worst, conventions = set(), {"grad": 0.0, "update": 0.0}, {}
    budget, done = float(os.environ.get("BUDGET_S", "inf")), 0
    for i in range(n):
        if time.monotonic() - t0 > budget:
            print(f"# BUDGET_S={budget:.0f} s reached after {i} configurations", flush=True)
            break
        done += 1
        cfg = draw(rng)
        if DRY:
            cfg.update(stage=i % 3, tied=True, gas=2 + i % 2)
        res = run(cfg, seed * 100_000 + i, dev, low)
        counts[res["verdict"]] += 1
        if res["verdict"] in ("WRONG", "ERROR"):
            key = f"zero{cfg['stage']}:{res['verdict']}"
            wrong_stage[key] = wrong_stage.get(key, 0) + 1
        windows["compared"] += res.get("compared", 0)
        windows["overflow"] += res.get("overflow", 0)
        windows["skipped_finite"] += len(res.get("skipped_finite", []))
        optimizers.add(f"zero{cfg['stage']}:{res.get('optimizer', '?')}")
        for what in worst:
            worst[what] = max(worst[what], res.get(f"max_rel_{what}", 0.0)) if res["verdict"] == "OK" else worst[what]
        for conv in res.get("accessor", []):
            key = f"zero{cfg['stage']}:{conv}"
            conventions[key] = conventions.get(key, 0) + 1
        if res["verdict"] in ("WRONG", "ERROR") or DRY:
            num = {k: (f"{v:.2e}" if isinstance(v, float) else v) for k, v in res.items() if k != "verdict"}
            print(f"{i:4d} {res['verdict']:8s} {json.dumps(num)} cfg={json.dumps(cfg)}", flush=True)
        if (i + 1) % 10 == 0:
            print(f"# {i + 1}/{n} {json.dumps(counts)} {time.monotonic() - t0:.0f} s", flush=True)
    summary = {"bench": "deepspeed_fp16_accum" + ("_dry_bf16" if DRY else ""), "configs": done, "seed": seed, **counts,
               "windows": windows, "max_rel_ok": worst, "accessor": "safe_get_full_grad / optimizer.loss_scale",
               "accessor_convention_configs": conventions, "wrong_by_stage": wrong_stage,
               "optimizers": sorted(optimizers), "seconds": round(time.monotonic() - t0, 1),
               "torch": torch.__version__, "deepspeed": deepspeed.__version__,
               "device": torch.cuda.get_device_name(0) if not DRY else "cpu"}
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()

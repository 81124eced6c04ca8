"""What a training step may be, as data: norm types, optimizers, implementations.

The validator, the generator and the trainer all read these tables, so the
case layer owns them; running a step (``harness.materialize.train``) needs torch's
optimizers, validating a JSON case must not.
"""

from __future__ import annotations

from typing import Any

CLIP_NORMS = ("1", "2", "inf")
OPTIMIZER_IMPLS = ("", "for_loop", "foreach", "fused")
# name -> (torch.optim class name, extra constructor arguments)
OPTIMIZERS: dict[str, tuple[str, dict[str, Any]]] = {
    "sgd": ("SGD", {}),
    "momentum": ("SGD", {"momentum": 0.9}),
    "nesterov": ("SGD", {"momentum": 0.9, "nesterov": True}),
    "adam": ("Adam", {}),
    "amsgrad": ("Adam", {"amsgrad": True}),
    "adamw": ("AdamW", {}),
    "adamax": ("Adamax", {}),
    "nadam": ("NAdam", {}),
    "radam": ("RAdam", {}),
    "adagrad": ("Adagrad", {}),
    "adadelta": ("Adadelta", {}),
    "rmsprop": ("RMSprop", {}),
    "asgd": ("ASGD", {}),
    "rprop": ("Rprop", {}),
}
FUSED = frozenset({"sgd", "momentum", "nesterov", "adam", "amsgrad", "adamw", "adagrad"})
# Updates driven by the sign of the grad: a grad that is zero in exact
# arithmetic and 1e-16 in floats moves the parameter by a full step, so these
# are drawn only in exact mode.
SIGN_BASED = frozenset({"rprop"})

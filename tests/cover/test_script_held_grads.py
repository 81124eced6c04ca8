"""A schedule repro script's held .grad copies across steps.

The script keeps every earlier .grad and checks it never changes. A .grad is
accumulated into in place (and clipped) by design while it is its
parameter's .grad; once a step's zero_grad let it go (set_to_none), it is
checked against the value the step ended with, as gradfuzz's own
``Held.refresh`` does, not against its copy from the step's first backward.
"""

import dataclasses
import os
import subprocess
import sys

import pytest

from harness.case.spec import Schedule
from harness.paths.base import Repro
from tests.helpers import nested


def _case(zero_grad="set_to_none", clip=""):
    return dataclasses.replace(nested(), schedule=Schedule(microbatches=2, steps=2, zero_grad=zero_grad, clip=clip))


def _run(tmp_path, case, path_name, machinery, *args):
    from harness.artifacts.repro import script

    file = tmp_path / "repro.py"
    file.write_text(script(case, path_name, machinery))
    run = subprocess.run([sys.executable, str(file), *args], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": ""})
    return run, run.stdout + run.stderr


@pytest.mark.parametrize("zero_grad, clip", [("set_to_none", ""), ("set_to_none", "2"), ("zeros", ""), ("keep", "")])
def test_eager_accumulate_agrees_across_steps(tmp_path, zero_grad, clip):
    """The bug: 'w0.grad after backward 0 was changed by the machinery' at
    backward 2 of eager.accumulate itself under set_to_none."""
    from harness.paths import resolve

    case = _case(zero_grad, clip)
    (p,) = resolve("eager.accumulate")
    run, out = _run(tmp_path, case, p.name, p.repro(case))
    assert "was changed" not in out, out[-3000:]
    assert ": agrees (0 differing grads, 0 caller tensors changed)" in run.stdout, out[-3000:]
    assert run.returncode == 0


_PLAIN = '''    live = [(o, c) for o, c in zip(outs, cots) if o.requires_grad]
    torch.autograd.backward([o for o, _ in live], [c for _, c in live])
'''

# Machinery that writes into a .grad the user still holds: right grads, a tensor changed under the user.
_MUTATES = {
    # the previous step's .grad, let go by set_to_none, is written at the next step's backward
    "released grad written in the next step": '''    global OLD
    stale = globals().get("OLD")
    if stale is not None and stale is not params["w0"].grad:
        stale.add_(1.0)
''' + _PLAIN + '''    OLD = params["w0"].grad
''',
    # within one step: .grad replaced by a new tensor, the old one (which the user holds) zeroed
    "replaced grad zeroed within a step": '''    old = params["w0"].grad
    params["w0"].grad = None
''' + _PLAIN + '''    if old is not None:
        params["w0"].grad = params["w0"].grad + old
        old.zero_()
''',
}


@pytest.mark.parametrize("how", sorted(_MUTATES))
def test_a_real_mutation_of_a_held_grad_is_still_reported(tmp_path, how):
    run, out = _run(tmp_path, _case(), "test.mutates", Repro(backward=_MUTATES[how]))
    assert "w0.grad after backward 0 was changed by the machinery" in run.stdout, out[-3000:]
    assert ": DIVERGES (0 differing grads," in run.stdout, out[-3000:]
    assert run.returncode == 1
    run, out = _run(tmp_path, _case(), "test.mutates", Repro(backward=_MUTATES[how]), "--no-hold")
    assert ": agrees (0 differing grads, 0 caller tensors changed)" in run.stdout, out[-3000:]
    assert run.returncode == 0

"""From a case to tensors and the one schedule every path runs.

Owns concrete data and magnitude bounds (``tensors``), the microbatch, step
and ``zero_grad`` rules with the shared schedule loop (``schedule``), the
training step (``train``), buffer-lifetime events (``lifetime``) and
spans of a node list between a family's cuts (``stages``). May import ``harness.case`` and
``harness.observation``.
"""

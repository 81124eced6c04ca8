"""The case: plain, frozen, versioned data that round-trips to JSON.

Owns the spec (``spec``), its vocabulary and the one input error
(``vocab``), validation that names the field (``validate``), the op table
(``ops``), the custom autograd Functions ops may use (``functions``) and the
training-step tables (``training``). Imports nothing of gradfuzz but itself:
everything downstream is a pure function of a ``Case``.
"""

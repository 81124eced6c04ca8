"""The case's module in the shape torchtitan's parallelize functions take.

``apply_fsdp_to_decoder``, the activation-checkpoint policies and
``apply_compile`` read a ``Decoder``: ``model.layers`` (a ``ModuleDict`` of
transformer blocks, each wrapped or sharded in place), ``tok_embeddings``,
``norm``, ``lm_head`` and ``enable_weight_tying``. Here the blocks are the
case's spans between its ``layers`` cuts (``harness.materialize.units``
blocks, each holding the parameters only it uses); a weight used in two
blocks or by an output stays in the root, which torchtitan shards last, as
a whole-model unit. The embedding, norm and head slots are empty: the case's
tied embedding and head are root parameters, so torchtitan's weight-tying
branch (one unit for embedding, norm and head) is not taken.
"""

from __future__ import annotations

from typing import Any

import torch

from harness.materialize.tensors import Built
from harness.materialize.units import Block, CaseModule


class Decoder(CaseModule):
    enable_weight_tying = False
    tok_embeddings = norm = lm_head = None

    def __init__(self, built: Built, values: dict[str, torch.Tensor], device: Any, dtype: torch.dtype,
                 layers: tuple[int, ...]) -> None:
        super().__init__(built, values, device, dtype, units=layers)
        # torchtitan replaces ``layers[i]`` by its wrapper, so the forward runs
        # ``layers``; ``blocks`` stays the plain list of the case's blocks,
        # which ownership and the per-forward flags are kept on.
        blocks = list(self.blocks) or [Block(built, (0, len(built.case.nodes)), self)]
        del self.blocks
        self.layers = torch.nn.ModuleDict({str(j): b for j, b in enumerate(blocks)})
        self.blocks = blocks

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        case = self.built.case
        env: dict[str, Any] = {x.name: t for x, t in zip(case.inputs, inputs)}
        env.update({n: self.weight(n) for n, j in self.owner.items() if j < 0})
        self.built.retained = {}
        self.built.seed_rng()
        for block in self.blocks:
            block.ran = False
        for layer in self.layers.values():
            env.update(layer(env))
        return tuple(self.built.outputs_of(env))

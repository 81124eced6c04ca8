"""A ``PipelineStage`` whose backward counts every use site once and keeps
what the weight pass needs.

Starts from ``oracles.split_fixed`` (the weight pass is a second, ordinary
backward from the stage outputs with the saved grad outputs, restricted to
the weights; nothing is captured at intermediate nodes, so no hook or use
site is visited twice), and fixes what the stage itself does around the
split functions:

- *full* backward (GPipe, 1F1B, looped schedules, and the first stage of the
  zero-bubble ones, which runs its whole backward at W) goes through
  ``torch.autograd.grad`` too, with parameter grads accumulated as owned
  copies: ``torch.autograd.backward`` would let ``AccumulateGrad`` adopt
  the incoming grad as ``.grad``, and that tensor can alias a grad output
  or another parameter's grad (the ``eager.accumulate`` findings);
- the user's tensors fed to the first stage (the microbatch slices of
  ``step()``'s arguments) get their grads by an ordinary backward from the
  slice, so the user's leaf sees ``.grad`` as in eager autograd;
- stage outputs are never detached in place: the split input pass and the
  last stage detach them to free memory early, but a stage output saved by
  the graph of another output (one computed from the other) is then needed
  at W, which fails "saved tensor detached in-place". Dropping references
  frees the same memory once W has run;
- the stage is built with example activations (``takes_example_args``:
  the rank passes one microbatch's real inputs and outputs as
  ``input_args``/``output_args``), so the schedule never infers its
  metadata by running a later stage's forward on inputs it made up (zeros
  on 2.11, memory it did not fill on 2.13), which raised wherever an op
  checks its input's values;
- two stages on one rank (the V placement, or several stages in one
  process) never talk through the process group: torch 2.11's p2p warm-up
  sends to the rank itself, which gloo cannot ("Pair is not connected");
  the fixed stage leaves those warm-up ops out, as 2.13 does.

Parameter grads are accumulated as in ``oracles.split_fixed``: a fresh
``.grad`` is an owned contiguous copy, an existing one is added into.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.pipelining import PipelineStage

from oracles.split_fixed import _accumulate


def _pairs(outputs: Any, grads: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Stage outputs (a loss, or a tuple) and their grads, restricted to the
    outputs that take part in autograd."""
    if isinstance(outputs, torch.Tensor):
        outputs = (outputs,)
    outs, gs = [], []
    for i, o in enumerate(outputs):
        if not isinstance(o, torch.Tensor) or not o.requires_grad:
            continue
        g = None if grads is None else grads[i]
        outs.append(o)
        gs.append(torch.ones_like(o) if g is None and grads is None else g)
    # A non-last stage may be handed no grad for an output (an unused one):
    # it contributes nothing.
    live = [(o, g) for o, g in zip(outs, gs) if g is not None]
    return [o for o, _ in live], [g for _, g in live]


def stage_backward_input(outputs: Any, output_grads: Any, input_values: list[Any],
                         weights: Any) -> tuple[tuple[torch.Tensor | None, ...], list[dict[str, Any]]]:
    outs, gs = _pairs(outputs, output_grads)
    wanted = [i for i, x in enumerate(input_values) if isinstance(x, torch.Tensor) and x.requires_grad]
    dinputs: list[torch.Tensor | None] = [None] * len(input_values)
    if outs and wanted:
        got = torch.autograd.grad(outs, [input_values[i] for i in wanted], gs, retain_graph=True, allow_unused=True)
        for i, g in zip(wanted, got):
            dinputs[i] = g
    return tuple(dinputs), [{"outputs": outs, "grads": gs}]


def stage_backward_weight(weights: Any, param_groups: list[dict[str, Any]]) -> None:
    wanted = [w for w in weights if w.requires_grad]
    for group in param_groups:
        outs, gs = group.pop("outputs"), group.pop("grads")
        if not outs or not wanted:
            continue
        got = torch.autograd.grad(outs, wanted, gs, allow_unused=True)
        for w, g in zip(wanted, got):
            if g is not None:
                _accumulate(w, g)


def stage_backward(outputs: Any, output_grads: Any, input_values: list[Any], weights: Any) -> tuple[torch.Tensor | None, ...]:
    """Input and weight grads in one ordinary backward."""
    outs, gs = _pairs(outputs, output_grads)
    wanted_w = [w for w in weights if w.requires_grad]
    wanted_i = [i for i, x in enumerate(input_values) if isinstance(x, torch.Tensor) and x.requires_grad]
    dinputs: list[torch.Tensor | None] = [None] * len(input_values)
    if not outs or not (wanted_w or wanted_i):
        return tuple(dinputs)
    got = torch.autograd.grad(outs, wanted_w + [input_values[i] for i in wanted_i], gs, allow_unused=True)
    for w, g in zip(wanted_w, got):
        if g is not None:
            _accumulate(w, g)
    for i, g in zip(wanted_i, got[len(wanted_w):]):
        dinputs[i] = g
        x = input_values[i]
        if g is not None and x.grad_fn is not None:
            # The first stage's inputs are slices of the user's tensors: hand
            # the grad on, so the user's leaves accumulate it as eager would.
            torch.autograd.backward([x], [g])
    return tuple(dinputs)


class _OwnedLayout(torch.nn.Module):
    """The stage module with outputs in fresh row-major tensors.

    torch 2.11 checks each forward output's strides against the metadata of
    its first-step inference, strides of size-1 dims included, and the two
    can disagree for a view (a ``chunk`` of width 1: (2, 1) at run time,
    (1, 1) inferred), so the schedule raises ``PipeliningShapeError`` on a
    case eager runs fine. A row-major copy has the same strides both times;
    autograd passes the grads through the copy unchanged.
    """

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.inner(*args, **kwargs)
        if isinstance(out, (tuple, list)):
            return type(out)(_row_major(o) for o in out)
        return _row_major(out)


def _row_major(t: Any) -> Any:
    if not isinstance(t, torch.Tensor) or t.stride() == torch.empty(t.shape, device="meta").stride():
        return t
    return t.clone(memory_format=torch.contiguous_format)


class FixedPipelineStage(PipelineStage):
    """``PipelineStage`` with the backward above; schedules use it unchanged."""

    takes_example_args = True

    def __init__(self, submodule: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("output_args") is not None:  # the outputs as _OwnedLayout returns them
            kwargs["output_args"] = tuple(_row_major(o) for o in kwargs["output_args"])
        super().__init__(_OwnedLayout(submodule), *args, **kwargs)

    def backward_maybe_with_nosync(self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False) -> Any:
        weights = list(self.submod.parameters())
        if backward_type == "full":
            return stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"],
                                  bwd_kwargs["input_values"], weights), None
        if backward_type == "input":
            return stage_backward_input(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"],
                                        bwd_kwargs["input_values"], weights)
        if backward_type == "weight":
            stage_backward_weight(weights, bwd_kwargs["param_groups"])
            return (), None
        raise RuntimeError(f"unknown backward type {backward_type!r}")

    def backward_one_chunk(self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True,
                           last_backward: bool = False) -> None:
        # The stock last stage detaches its outputs in place after the input
        # pass (views excepted). Hand it views of them instead: the loss was
        # computed from the originals, so nothing the graph saved is touched.
        cached = self.fwd_cache.get(bwd_chunk_id)
        if cached is not None and self.is_last:
            outs, inputs = cached
            self.fwd_cache[bwd_chunk_id] = (
                tuple(o.view_as(o) if isinstance(o, torch.Tensor) else o for o in outs), inputs)
        super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward)

    def _get_init_p2p_neighbors_ops(self) -> list[Any]:
        # torch 2.11's PipelineScheduleMulti._initialize_stages batches every
        # local stage's warm-up send and recv to each neighbour stage's rank,
        # this rank included when the neighbour is held here too (the V
        # placement: rank 1 holds stages 1 and 2; every multi-stage layout in
        # one process). Gloo has no pair to itself ("Pair is not connected"),
        # so the step raises before any forward, on stock stages as well.
        # Everything after the warm-up already passes a same-rank neighbour's
        # tensors directly (shape inference and the schedule runtime compare
        # stage_index_to_group_rank with group_rank), so a warm-up with this
        # rank has nothing to warm: drop those ops, as 2.13's warm-up does
        # (it warms neighbours on other ranks only, and calls this method for
        # non-PipelineStage stages alone). Ops with other ranks are kept in
        # their order; both ranks drop only their own self ops, so the sends
        # and recvs between the two ranks still pair up.
        ops = super()._get_init_p2p_neighbors_ops()
        return [op for op in ops if _op_peer(op) != self.group_rank]

    # Point-to-point sends need contiguous tensors (gloo raises "input tensor
    # has to be contiguous"; the receiver's buffer is contiguous anyway), but a
    # stage output can be a view (a transpose, a chunk) and an input grad can
    # be expanded or transposed. Send contiguous copies; autograd keeps the
    # originals.

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> Any:
        outs, inputs = self.fwd_cache[fwd_chunk_id]
        self.fwd_cache[fwd_chunk_id] = (tuple(_contiguous(o) for o in outs), inputs)
        try:
            return super().get_fwd_send_ops(fwd_chunk_id)
        finally:
            self.fwd_cache[fwd_chunk_id] = (outs, inputs)

    # Receive buffers are allocated with the sender's strides ("preserving
    # the exact memory layout"): for a transposed or expanded activation or
    # grad that is a buffer recv refuses (or, with stride 0, one that
    # overlaps itself). Receive into contiguous buffers instead.

    # (Private hooks of PipelineStage; arguments passed through as they come,
    # since their signatures differ between torch versions.)

    def _setup_forward_recv_info(self, *args: Any, **kwargs: Any) -> None:
        super()._setup_forward_recv_info(*args, **kwargs)
        for infos in self.args_recv_info.values():
            _contiguous_buffers(infos)

    def _setup_backward_recv_info(self, *args: Any, **kwargs: Any) -> None:
        super()._setup_backward_recv_info(*args, **kwargs)
        for infos in self.grad_recv_info.values():
            _contiguous_buffers(infos)

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> Any:
        if bwd_chunk_id in self.bwd_cache:
            self.bwd_cache[bwd_chunk_id] = tuple(_contiguous(g) for g in self.bwd_cache[bwd_chunk_id])
        return super().get_bwd_send_ops(bwd_chunk_id)


def _contiguous_buffers(infos: Any) -> None:
    for info in infos:
        buf = getattr(info, "buffer", None)
        if isinstance(buf, torch.Tensor) and not buf.is_contiguous():
            info.buffer = torch.empty(buf.shape, dtype=buf.dtype, device=buf.device).requires_grad_(buf.requires_grad)


def _contiguous(t: Any) -> Any:
    return t.detach().contiguous() if isinstance(t, torch.Tensor) and not t.is_contiguous() else t


def _op_peer(op: Any) -> int | None:
    """The group rank a warm-up ``P2POp`` talks to."""
    peer = getattr(op, "group_peer", None)
    if peer is None:  # an older P2POp: its peer is a global rank
        import torch.distributed as dist

        peer = getattr(op, "peer", None)
        return None if peer is None else dist.get_group_rank(op.group, peer)
    return peer

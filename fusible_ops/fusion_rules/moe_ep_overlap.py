"""Expert parallel MoE with the all-to-alls hidden behind the expert GEMMs:
``Dispatch(ep_group=...) -> GroupedLinear -> activation -> GroupedLinear -> Combine``.

Joint rule ``moe_ep_overlap`` (training; the forward and backward are equivalent only as a pair).
The local experts are cut into ``Dispatch.ep_chunks`` chunks (:class:`~fusible_ops.ops.moe_ep.ChunkLayout`),
each exchanged by its own asynchronous all-to-all:

* forward: every chunk's dispatch all-to-all is started at once (they run back to back on the
  communicator's stream); chunk ``c``'s expert MLP runs as soon as its copies have arrived, while
  chunk ``c + 1``'s travel; chunk ``c``'s outputs start home as soon as they exist, while chunk
  ``c + 1`` computes. Combine waits for the last one.
* backward: the same pipeline for the input gradients (the copies' gradients out, each chunk's
  dgrad chain, its result home); the weight gradients of every chunk are computed after the last
  chunk's dgrad, while its result travels (or later, delayed: the gradient contract's
  ``delay_wgrad_compute`` / :func:`~fusible_ops.grad.delayed_wgrad`).

While chunks are in flight the grouped GEMMs leave :data:`COMM_SMS` SMs to the communication
kernels (:func:`~fusible_ops.kernels.launch.reserve_sms`).

Each chunk's GEMMs see exactly the rows of its experts that the unchunked layer's GEMMs see, in
the same order: on CPU the result equals the exchange without overlap, and one process running
every rank's tokens, bit for bit (on GPUs a chunk's GEMM may take other tile configurations: equal
within the tolerance table). It declines (falls back to the unfused expert-parallel ops) under FP8
autocast (a per-tensor scale would be taken per chunk instead of over the layer) and for
``ep_chunks=1``. How much it hides, measured: docs/scaling-out.md.

With ``Dispatch(ep_exchange="padded")`` the same op runs the exchange with no host read as one
chunk (:class:`~fusible_ops.ops.moe_ep.PaddedLayout`: fixed-capacity all-to-alls, the expert rows
the first rows of a padded buffer, which the grouped GEMMs walk by their groups only), so the
layer can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from ..grad import deliver_weight_grad
from ..kernels.activation import bias_act_bwd, bias_act_fwd
from ..kernels.launch import reserve_sms
from ..kernels.grouped_gemm import grouped_bias_grad, grouped_gemm_dgrad, grouped_gemm_fwd, grouped_gemm_wgrad
from ..kernels.moe_combine import combine_bwd, gather_rows, gather_sum
from ..op import FusedOperation
from ..ops.activation import GEGLU, GELU, ReGLU, ReLU, SiLU, SwiGLU
from ..ops.grouped_linear import GroupedLinear
from ..ops.moe import Combine, Dispatch, _need_routing
from ..ops.moe_ep import ExpertExchange, PaddedLayout
from ..ops.validation import check_input
from ..rules import match, rule


COMM_SMS = 32
"""SMs the grouped GEMMs leave to the all-to-all kernels while chunks are in flight
(:func:`~fusible_ops.kernels.launch.reserve_sms`): NCCL's send/receive kernel runs 32 CTAs here.
The GEMMs are persistent (one program per SM, tiles assigned statically), so the programs that
could not start beside it held back their tiles. Profile of one step on 2 H200s, 4 chunks
(2026-11-28): the grouped GEMM kernels took 2.28 ms without overlap, 3.63 ms beside the
all-to-alls with no SM reserved, 3.32 / 3.26 / 3.55 ms with 16 / 32 / 48 reserved."""


def _part(t, lo: int, hi: int):
    return None if t is None else t[lo:hi]


class EPOverlapMoE(FusedOperation):
    """The chunked, overlapped expert-parallel MoE layer body (module doc). Holds no state."""

    accepts_fp8 = False  # (casts its own FP8 operands: a Float8Tensor input or output gradient is dequantized)

    def fuser_forward(self, ctxs, x, *, extra_inputs, routing=None, **kwargs):
        dispatch, fc1, act, fc2, _ = self.basic_ops
        cd, c1, ca, c2, cc = ctxs
        _need_routing(self, routing)
        check_input(dispatch, x)
        padded = dispatch.ep_exchange == "padded"
        x2d = dispatch._rows(x, routing, exchange=not padded)  # validates; "sync": plans (its one host read)
        check_input(fc1, x2d, features=fc1.in_features, like=fc1.weight)
        if padded:
            lay = dispatch.padded_layout(routing, x2d.shape[1], x2d.dtype)
            routing.local_split_sizes = lay.counts[0]
        else:
            ex = routing.exchange or ExpertExchange.local("Dispatch", dispatch.ep, routing.split_sizes)
            lay = ex.chunked(dispatch.ep_chunks)
        send = gather_rows(x2d, Dispatch.gather_index(routing).index_select(0, lay.send_order))
        recv = send.new_empty((lay.recv_rows[-1].stop, send.shape[1]))
        arriving = [lay.to_experts(recv, send, c) for c in range(lay.n)]
        home = send.new_empty((send.shape[0], fc2.out_features))
        leaving, kept = [], []
        with reserve_sms(COMM_SMS if lay.n > 1 else 0):
            self._forward_chunks(lay, recv, home, arriving, leaving, kept)
        for w in leaving:
            w.wait()
        if padded:  # (the copies back in the Dispatch's order: what Combine's kernels index)
            home, index = lay.compact(home), routing.inv_perm.view(routing.num_tokens, routing.top_k)
        else:
            index = lay.send_pos.index_select(0, routing.inv_perm).view(routing.num_tokens, routing.top_k)
        out = gather_sum(home, index, routing.probs).reshape(*routing.token_shape, fc2.out_features)
        if cc.requires_grad:
            cd.layout, cd.input_shape = lay, x.shape
            cd.probs_grad = routing.probs_grad
            cd.weight_grads = tuple(op.weight.requires_grad and ctx.weight_requires_grad for op, ctx in ((fc1, c1), (fc2, c2)))
            cd.save_for_backward(index, routing.probs, home if routing.probs_grad else None, *kept)
        return out, [(), (), (), (), ()]

    def _forward_chunks(self, lay, recv, home, arriving, leaving, kept) -> None:
        """Each chunk's expert MLP once its copies arrive; its outputs start home at once."""
        _, fc1, act, fc2, _ = self.basic_ops
        for c in range(lay.n):
            lo, hi = lay.bounds[c], lay.bounds[c + 1]
            arriving[c].wait()
            xc = gather_rows(recv, lay.order[c])
            h = grouped_gemm_fwd(xc, fc1.weight[lo:hi], lay.counts[c], _part(fc1.bias, lo, hi))
            y = bias_act_fwd(h, None, act.kind, dropout_p=0.0)
            o = grouped_gemm_fwd(y, fc2.weight[lo:hi], lay.counts[c], _part(fc2.bias, lo, hi))
            leaving.append(lay.from_experts(home, gather_rows(o, lay.back[c]), c))
            kept += [xc, h, y]

    def fuser_backward(self, ctxs, dy, *, grad_extra_outputs, routing=None, **kwargs):
        _, fc1, act, fc2, _ = self.basic_ops
        cd = ctxs[0]
        lay = cd.layout
        index, probs, home, *kept = cd.saved_tensors
        dhome, dprobs = combine_bwd(dy.reshape(-1, fc2.out_features), home, index, probs)
        if cd.probs_grad:
            routing.dprobs = dprobs
        padded = isinstance(lay, PaddedLayout)
        if padded:
            dhome = lay.expand(dhome)
        drecv = dhome.new_empty((lay.recv_rows[-1].stop, fc2.out_features))
        arriving = [lay.to_experts(drecv, dhome, c) for c in range(lay.n)]
        need_dx = cd.input_requires_grad
        dsend = dhome.new_empty((dhome.shape[0], fc1.in_features)) if need_dx else None
        leaving, grads = [], []  # grads: per chunk (FC2's output grad, FC1's output grad)
        with reserve_sms(COMM_SMS if lay.n > 1 else 0):
            for c in range(lay.n):
                lo, hi = lay.bounds[c], lay.bounds[c + 1]
                h = kept[3 * c + 1]
                arriving[c].wait()
                do = gather_rows(drecv, lay.order[c])
                dh = bias_act_bwd(grouped_gemm_dgrad(do, fc2.weight[lo:hi], lay.counts[c]), h, None, act.kind, False,
                                  dropout_p=0.0)[0]
                if need_dx:
                    dxc = grouped_gemm_dgrad(dh, fc1.weight[lo:hi], lay.counts[c])
                    leaving.append(lay.from_experts(dsend, gather_rows(dxc, lay.back[c]), c))
                grads.append((do, dh))
            # (while the last chunk travels home; delayed: whenever backward_dw runs)
            g1 = self._weight_grads(fc1, cd.weight_grads[0], lay, [(dh, kept[3 * c]) for c, (_, dh) in enumerate(grads)])
            g2 = self._weight_grads(fc2, cd.weight_grads[1], lay,
                                    [(do, kept[3 * c + 2]) for c, (do, _) in enumerate(grads)])
        for w in leaving:
            w.wait()
        if padded and need_dx:
            dsend = lay.compact(dsend)
        dx = gather_sum(dsend, index).reshape(cd.input_shape) if need_dx else None
        return dx, [(), g1, (), g2, ()], [(), (None,), (), (None,), ()]

    @staticmethod
    def _weight_grads(op: GroupedLinear, weight_grad: bool, lay, pairs: list) -> tuple:
        """(dW, db) of one GroupedLinear from every chunk's (output grad, input) rows: dW through the
        gradient contract, one grouped GEMM per chunk into its experts' slice of the gradient."""
        dw = None
        if weight_grad:
            def compute(out, accumulate):
                if out is None:
                    out, accumulate = torch.empty_like(op.weight), False
                for c, (g, inp) in enumerate(pairs):
                    lo, hi = lay.bounds[c], lay.bounds[c + 1]
                    grouped_gemm_wgrad(g, inp, lay.counts[c], out=out[lo:hi], accumulate=accumulate)
                return out

            dw = deliver_weight_grad(op, op.weight, compute)
        if op.bias is None:
            return (dw,)
        db = None
        if op.bias.requires_grad:
            db = torch.cat([grouped_bias_grad(g, lay.counts[c]) for c, (g, _) in enumerate(pairs)])
        return (dw, db)


def _check(ops, ctx):
    dispatch, fc1, act, fc2, _ = ops
    if dispatch.ep_size <= 1:
        return "no expert-parallel group: nothing to overlap"
    if dispatch.ep_chunks <= 1 and dispatch.ep_exchange != "padded":
        return "Dispatch(ep_chunks=1): the overlap is off"
    if ctx.recipe is not None:
        return ("FP8 autocast: a chunk would take its own per-tensor scales, not the layer's; the unfused "
                "expert-parallel ops run")
    if fc1.num_groups != fc2.num_groups:
        return f"FC1 has {fc1.num_groups} groups, FC2 {fc2.num_groups}"
    if act.gated and fc1.out_features % 2:  # (the unfused activation raises its own error)
        return f"{type(act).__name__} needs an even input width, FC1 gives {fc1.out_features}"
    if act.out_features(fc1.out_features) != fc2.in_features:
        return f"{type(act).__name__} gives {act.out_features(fc1.out_features)} features, FC2 takes {fc2.in_features}"
    return None


_ACTIVATIONS = (SwiGLU, GEGLU, ReGLU, SiLU, GELU, ReLU)  # (one elementwise kernel each: bias_act_fwd / _bwd)

RULES = [  # the built-in rules of this family (installed by fusible_ops/__init__.py)
    rule("moe_ep_overlap", [Dispatch, GroupedLinear, match(_ACTIVATIONS), GroupedLinear, Combine], pass_="joint",
         build=EPOverlapMoE, check=_check),
]

"""The MoE layer's Combine fused with FC2 before it, and with the activation before FC2:
rules ``moe_act_combine`` (``activation -> GroupedLinear -> Combine``) and ``moe_combine``
(``GroupedLinear -> Combine``).

Joint rules (training; forward and backward are equivalent only as a pair). The unfused Combine
keeps its input, FC2's output ``y`` ([T * k, hidden]), for the probabilities' gradient
``dprobs[t, j] = <dy[t], y[copy (t, j)]>``. Without a bias ``y = a @ W2[e].T`` (``a``: FC2's input),
so (SonicMoE's way)

* ``dprobs[t, j] = <dy[t] @ W2[e], a[copy (t, j)]>``: FC2's input gradient of the unscaled copies
  of ``dy``, dotted with ``a``; ``y`` is never kept;
* FC2's input gradient is that GEMM's result times the copy's probability, and its weight
  gradient the unscaled copies' against ``p * a``.

Forward: (the activation,) FC2's grouped GEMM, the probability-weighted gather-sum, as unfused.
Backward: one pass making the unscaled copies of ``dy``
(:func:`~fusible_ops.kernels.moe_combine.scatter_copies`; the unfused Combine writes the scaled
ones instead), FC2's input-gradient GEMM, then one pass over its [T * k, ffn] result
(:func:`~fusible_ops.kernels.moe_combine.rows_scale_dot`): the dot products, the scaled input
gradient, ``p * a``; with the activation in the rule, ``a`` is recomputed from the activation's
input in that pass and the activation's backward runs there too (its own pass is gone). Then
FC2's weight-gradient GEMM through the gradient contract.

What it saves: the [T * k, hidden] copy Combine keeps (on the fine-grained layer of the
benchmarks, T=24576, k=8, hidden 1536, bf16: 576 MiB) and, with the activation, FC2's kept
input ([T * k, ffn], 96 MiB there). Bytes moved by the backward per token copy: ``hidden``
fewer, and ``f`` more with the activation (``4 f`` without), for FC2's input width ``f``; the
cost hint declines where that is a net loss on CUDA (:func:`_cost`). It declines (with
``explain()``'s reason) for FC2 with a bias (``y`` then holds the bias too), under FP8 autocast
(FC2 is an FP8 GEMM there, which the fused expert MLP covers) and without a backward. Where the
router needs no ``dprobs`` (frozen and no input gradient) Combine keeps nothing, and after an
expert-parallel Dispatch Combine exchanges rows first: there the ops run their own forward and
backward.
"""

from __future__ import annotations

from ..grad import deliver_weight_grad
from ..kernels.activation import bias_act_fwd
from ..kernels.grouped_gemm import grouped_gemm_dgrad, grouped_gemm_wgrad
from ..kernels.moe_combine import gather_sum, rows_scale_dot, scatter_copies
from ..op import FusedOperation
from ..ops.activation import GEGLU, GELU, ReGLU, ReLU, SiLU, SwiGLU
from ..ops.grouped_linear import GroupedLinear
from ..ops.moe import Combine, _need_routing
from ..rules import match, rule


class GroupedLinearCombine(FusedOperation):
    """FC2 (a bias-free ``GroupedLinear``), optionally the activation before it, and ``Combine``,
    with no kept [T * k, hidden] output (and, with the activation, no kept FC2 input: it is
    recomputed from the activation's input in the backward pass that needs it). Module doc.
    Holds no state."""

    accepts_fp8 = False  # (casts its own FP8 operands: a Float8Tensor input or output gradient is dequantized)

    @property
    def _parts(self):
        ops = self.basic_ops
        return (ops[0] if len(ops) == 3 else None), ops[-2], ops[-1]

    def fuser_forward(self, ctxs, x, *, extra_inputs, routing=None, **kwargs):
        act, fc2, combine = self._parts
        c2, cc = ctxs[-2], ctxs[-1]
        _need_routing(combine, routing)
        c2.unfused = routing.exchange is not None or not routing.probs_grad
        if c2.unfused:  # expert parallel (Combine exchanges rows first), or no dprobs: Combine keeps nothing
            return _run_unfused(self.basic_ops, ctxs, x, extra_inputs, routing), [()] * len(ctxs)
        h = x
        if act is not None:
            act.check_input(h)
            x = bias_act_fwd(h, None, act.kind, dropout_p=0.0)
        a, splits = fc2.prepare(x, extra_inputs[-2][0])
        y = fc2.forward_2d(a, splits)
        y2d, index = combine._rows(y, routing)
        out = gather_sum(y2d, index, routing.probs).reshape(*routing.token_shape, fc2.out_features)
        if cc.requires_grad:
            c2.weight_grad = c2.weight_requires_grad and fc2.weight.requires_grad
            c2.input_shape, c2.top_k = h.shape, routing.top_k
            c2.save_for_backward(a if act is None else h.reshape(a.shape[0], h.shape[-1]), fc2.weight, splits,
                                 routing.probs, routing.perm, routing.inv_perm)
        return out, [()] * len(ctxs)

    def fuser_backward(self, ctxs, dy, *, grad_extra_outputs, routing=None, **kwargs):
        act, fc2, combine = self._parts
        c2 = ctxs[-2]
        if c2.unfused:
            return _backward_unfused(self.basic_ops, ctxs, dy, grad_extra_outputs, routing)
        kept, w, splits, probs, perm, inv = c2.saved_tensors
        need_dx = ctxs[0].input_requires_grad
        g = scatter_copies(dy.reshape(-1, fc2.out_features), inv.view(-1, c2.top_k))  # unscaled copies of dy
        dx, routing.dprobs, a_scaled = rows_scale_dot(grouped_gemm_dgrad(g, w, splits), kept, probs, perm,
                                                      dx=need_dx, scaled_a=c2.weight_grad,
                                                      act=None if act is None else act.kind)
        dw = None
        if c2.weight_grad:
            dw = deliver_weight_grad(fc2, fc2.weight,
                                     lambda out, acc: grouped_gemm_wgrad(g, a_scaled, splits, out=out, accumulate=acc))
        if dx is not None:
            dx = dx.reshape(c2.input_shape)
        pgrads = [(dw,), ()] if act is None else [(), (dw,), ()]
        return dx, pgrads, [()] * (len(ctxs) - 2) + [(None,), ()]


def _run_unfused(ops, ctxs, x, extra_inputs, routing):
    """The basic ops' own forwards, in order (each with its ctx)."""
    for op, ctx, extra in zip(ops, ctxs, extra_inputs):
        x, _ = op.fuser_forward([ctx], x, extra_inputs=[extra], routing=routing)
    return x


def _backward_unfused(ops, ctxs, dy, grad_extra_outputs, routing):
    """The basic ops' own backwards, in reverse order."""
    pgrads, gextra = [None] * len(ops), [None] * len(ops)
    for i in reversed(range(len(ops))):
        dy, pg, ge = ops[i].fuser_backward([ctxs[i]], dy, grad_extra_outputs=[grad_extra_outputs[i]], routing=routing)
        pgrads[i], gextra[i] = pg[0], ge[0]
    return dy, pgrads, gextra


def _check(ops, ctx):
    fc2 = ops[-2]
    if not ctx.requires_grad:
        return "no backward: Combine keeps nothing to save"
    if fc2.bias is not None:
        return "FC2 has a bias: Combine's input is not FC2's input times its weight alone"
    if ctx.recipe is not None:
        return "FP8 autocast: FC2 runs as an FP8 GEMM (the fused expert MLP covers that)"
    return None


def _cost(ops, ctx):
    """Cost hint (training on CUDA): the backward moves per copy of a token ``hidden`` elements
    fewer (Combine's kept input is not read) and, for FC2 of input width ``f``, ``4 f`` more
    without the activation (the [*, f] scaling pass), ``f`` more with it (its pass replaces the
    activation's backward pass). So it declines where ``4 f >= hidden`` (``f >= hidden`` with the
    activation). The memory saved is the same; ``fo.tune(..., prefer="memory")`` or
    ``fusion_rules.disabled("cost hints")`` takes the fused plan anyway."""
    if ctx.device is None or ctx.device.type != "cuda":
        return None
    f, hidden = ops[-2].in_features, ops[-2].out_features
    factor = 1 if len(ops) == 3 else 4
    if factor * f >= hidden:
        return (f"FC2's input width {f} {'>=' if factor == 1 else 'x 4 >='} its output width {hidden}: the backward "
                f"would move more bytes than it saves")
    return None


_ACTIVATIONS = (SwiGLU, GEGLU, ReGLU, SiLU, GELU, ReLU)  # (their kinds: rows_scale_dot recomputes them)

RULES = [  # the built-in rules of this family (installed by fusible_ops/__init__.py)
    rule("moe_act_combine", [match(_ACTIVATIONS), GroupedLinear, Combine], pass_="joint", build=GroupedLinearCombine,
         check=_check, cost=_cost),
    rule("moe_combine", [GroupedLinear, Combine], pass_="joint", build=GroupedLinearCombine, check=_check, cost=_cost),
]

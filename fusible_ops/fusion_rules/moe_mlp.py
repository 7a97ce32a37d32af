"""Dispatch fused with the expert MLP of a MoE layer: ``Dispatch -> GroupedLinear -> GLU ->
GroupedLinear`` (the routed experts of :mod:`fusible_ops.ops.moe`), memory-minimal.

Joint rule ``moe_dispatch_mlp`` (training; the forward and backward are equivalent only as a pair):

* forward: no gathered copy of the tokens is ever written: FC1's kernel (GLU in its epilogue,
  :func:`~fusible_ops.kernels.grouped_glu.grouped_glu_fwd` with ``gather``) reads each token
  copy's row straight from the tokens inside its mainloop; then FC2 as in the fused grouped MLP
  (:class:`~fusible_ops.fusion_rules.grouped_mlp.FusedGroupedMLP`).
* backward: the copies are gathered again (one ``index_select``) just for FC1's weight gradient,
  which reads them through TMA (a weight-gradient kernel that gathered inside its mainloop, with
  pointer loads, measured ~1.4x slower, a net loss on the larger MoE shapes of issue 13: H200,
  2026-11-25); then Dispatch's backward sums each token's copies' gradients (one gather-sum pass).

What it saves: the [T * k, hidden] copy in the forward's peak and in what backward keeps (the
tokens, which the layer's caller holds anyway, and the gather index are kept instead), and the
forward's gather pass. Under FP8 autocast (per-tensor recipes) the tokens are cast once (T rows,
not T * k) and FC1's FP8 kernel gathers the FP8 rows
(:func:`~fusible_ops.fusion_rules.fp8_grouped_mlp.fp8_mlp_forward`). It declines (``explain()``
says why) where the grouped MLP declines (e.g. FP8 block scaling) and for an expert-parallel
Dispatch (its copies come from an all-to-all, not a local gather).
"""

from __future__ import annotations

from ..op import FusedOperation
from ..ops.activation import GEGLU, ScaledSwiGLU, SwiGLU
from ..ops.grouped_linear import GroupedLinear
from ..ops.moe import Dispatch
from ..rules import match, rule
from .grouped_mlp import FusedGroupedMLP, check_grouped_mlp, grouped_glu_cost


class DispatchGroupedMLP(FusedOperation):
    """``Dispatch`` + the fused grouped MLP with the gather inside FC1's kernels (module doc)."""

    accepts_fp8 = False  # (casts its own FP8 operands: a Float8Tensor input or output gradient is dequantized)

    def __init__(self, ops) -> None:
        super().__init__(ops)
        self.__dict__["_mlp"] = FusedGroupedMLP(ops[1:])  # a fused op of the same basic ops: no state

    def fuser_forward(self, ctxs, x, *, extra_inputs, routing=None, **kwargs):
        dispatch = self.basic_ops[0]
        tokens = dispatch.begin(ctxs[0], x, routing)
        y, _ = self._mlp.fuser_forward(ctxs[1:], tokens, extra_inputs=extra_inputs[1:],
                                       gather=dispatch.gather_index(routing), **kwargs)
        return y, [(), (), (), ()]

    def fuser_backward(self, ctxs, dy, *, grad_extra_outputs, **kwargs):
        dxp, pgrads, gextra = self._mlp.fuser_backward(ctxs[1:], dy, grad_extra_outputs=grad_extra_outputs[1:])
        dx, _, _ = self.basic_ops[0].fuser_backward([ctxs[0]], dxp, grad_extra_outputs=[()],
                                                    routing=kwargs.get("routing"))
        return dx, [(), *pgrads], [(), *gextra]


def _check(ops, ctx):
    if ops[0].ep_size > 1:
        return "expert-parallel Dispatch: its token copies come from an all-to-all, not a local gather"
    return check_grouped_mlp(ops[1:], ctx)


RULES = [  # the built-in rules of this family (installed by fusible_ops/__init__.py)
    rule("moe_dispatch_mlp", [Dispatch, GroupedLinear, match((SwiGLU, GEGLU, ScaledSwiGLU)), GroupedLinear],
         pass_="joint", build=DispatchGroupedMLP, check=_check, cost=grouped_glu_cost),
]

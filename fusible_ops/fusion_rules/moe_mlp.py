"""Dispatch fused with the expert MLP of a MoE layer: ``Dispatch -> GroupedLinear -> GLU ->
GroupedLinear`` (the routed experts of :mod:`fusible_ops.ops.moe`), memory-minimal.

Joint rule ``moe_dispatch_mlp`` (training; the forward and backward are equivalent only as a pair):

* forward: the token copies are gathered (Dispatch), the fused grouped MLP runs on them
  (:class:`~fusible_ops.fusion_rules.grouped_mlp.FusedGroupedMLP`), and the gathered copy
  [T * k, hidden], which FC1's weight gradient would otherwise keep until backward, is dropped:
  backward keeps the tokens themselves (which the layer's caller holds anyway) and the gather index.
* backward: the gather is redone (one ``index_select``) just before FC1's weight gradient; then
  Dispatch's backward sums each token's copies' gradients.

What it trades: activation memory of T * k * hidden elements per layer, for one gather in
backward. It declines (``explain()`` says why) where the grouped MLP declines, under FP8 autocast
(FC1's weight gradient keeps FP8 copies there, not the gathered input), and for an
expert-parallel Dispatch (its copies come from an all-to-all, not a local gather).
"""

from __future__ import annotations

from ..op import FusedOperation
from ..ops.activation import GEGLU, ScaledSwiGLU, SwiGLU
from ..ops.grouped_linear import GroupedLinear
from ..ops.moe import Dispatch
from ..rules import match, rule
from .grouped_mlp import FusedGroupedMLP, check_grouped_mlp


class DispatchGroupedMLP(FusedOperation):
    """``Dispatch`` + the fused grouped MLP, keeping no gathered copy for backward (module doc)."""

    def __init__(self, ops) -> None:
        super().__init__(ops)
        self.__dict__["_mlp"] = FusedGroupedMLP(ops[1:])  # a fused op of the same basic ops: no state

    def fuser_forward(self, ctxs, x, *, extra_inputs, routing=None, **kwargs):
        dispatch = self.basic_ops[0]
        cd, c1 = ctxs[0], ctxs[1]
        xp, _ = dispatch.fuser_forward([cd], x, extra_inputs=[()], routing=routing)
        y, _ = self._mlp.fuser_forward(ctxs[1:], xp, extra_inputs=extra_inputs[1:], **kwargs)
        cd.regather = c1.requires_grad and c1.fp8 is None and c1.weight_grad
        if cd.regather:  # FC1 kept the gathered copy for its weight gradient: keep the tokens instead
            c1.save_for_backward(None, *c1.saved_tensors[1:])
            cd.save_for_backward(*cd.saved_tensors, x.reshape(-1, x.shape[-1]), dispatch.gather_index(routing))
        return y, [(), (), (), ()]

    def fuser_backward(self, ctxs, dy, *, grad_extra_outputs, **kwargs):
        dispatch = self.basic_ops[0]
        cd, c1 = ctxs[0], ctxs[1]
        if cd.regather:
            *kept, tokens, index = cd.saved_tensors
            c1._saved = (tokens.index_select(0, index), *c1.saved_tensors[1:])
            cd._saved = tuple(kept)
        dxp, pgrads, gextra = self._mlp.fuser_backward(ctxs[1:], dy, grad_extra_outputs=grad_extra_outputs[1:])
        dx, _, _ = dispatch.fuser_backward([cd], dxp, grad_extra_outputs=[()])
        return dx, [(), *pgrads], [(), *gextra]


def _check(ops, ctx):
    if ops[0].ep_size > 1:
        return "expert-parallel Dispatch: its token copies come from an all-to-all, not a local gather"
    if ctx.recipe is not None:
        return "FP8 autocast: FC1's weight gradient keeps FP8 copies, not the gathered input"
    return check_grouped_mlp(ops[1:], ctx)


RULES = [  # the built-in rules of this family (installed by fusible_ops/__init__.py)
    rule("moe_dispatch_mlp", [Dispatch, GroupedLinear, match((SwiGLU, GEGLU, ScaledSwiGLU)), GroupedLinear],
         pass_="joint", build=DispatchGroupedMLP, check=_check),
]

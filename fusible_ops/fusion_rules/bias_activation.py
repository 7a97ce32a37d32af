"""Linear + bias + activation (+ dropout) forward, and activation + bias (+ dropout) backward.

Forward (``ForwardLinearBiasActivation``): the GEMM runs through torch (cuBLAS on CUDA); bias,
activation and dropout run in ONE Triton pass over its output (reference math on CPU). The
pre-bias GEMM output is what the activation's ctx keeps (with ``act_bias``), so the biased
pre-activation is never written.

Backward (``BackwardBiasActivation``): the activation gradient (after regenerating the dropout
mask) and the bias gradient (a column reduction) in ONE Triton pass.

Dropout's seed goes through the ``Dropout`` protocol: ``drop.start(ctx, z)`` in forward (draws the
seed tensor on the device and saves it in the Dropout's ctx, exactly as ``Dropout.op_forward``
does) and ``drop.seed_of(ctx)`` in backward; the kernels read the seed on the device.
"""

from __future__ import annotations

import torch

from ..kernels.gemm import linear_fprop
from ..op import FusedOperation
from ..ops.activation import ACTIVATION_CLASSES, Activation
from ..ops.linear import BasicLinear, Bias
from ..ops.misc import Dropout
from ..rules import match, rule


def _kernels():
    from ..kernels import activation

    return activation


def _split(ops):
    """Name the roles of the matched ops: (linear, bias, act, dropout), each possibly None."""
    roles = {"linear": None, "bias": None, "act": None, "dropout": None}
    for op in ops:
        if isinstance(op, BasicLinear):
            roles["linear"] = op
        elif isinstance(op, Bias):
            roles["bias"] = op
        elif isinstance(op, Activation):
            roles["act"] = op
        elif isinstance(op, Dropout):
            roles["dropout"] = op
    return roles


class ForwardLinearBiasActivation(FusedOperation):
    """Forward of ``[BasicLinear] [Bias] [activation] [Dropout]`` (any contiguous subset that the
    rules below match). Fills each basic op's ctx exactly as the op's own forward would."""

    def __init__(self, ops) -> None:
        super().__init__(ops)
        self.roles = _split(ops)

    def fuser_forward(self, ctxs, x, *, extra_inputs, **kwargs):
        r = self.roles
        ctx_of = {id(op): ctx for op, ctx in zip(self.basic_ops, ctxs)}
        lin, bias, act, drop = r["linear"], r["bias"], r["act"], r["dropout"]
        if lin is not None:
            lin.check_input(x)
            if act is None:  # linear + bias only: one GEMM with the bias in its epilogue
                bias.check_input(x, shape=(*x.shape[:-1], lin.out_features))
                y = linear_fprop(x, lin.weight, bias.bias)
                bias.save_ctx(ctx_of[id(bias)])
                if ctx_of[id(lin)].requires_grad:
                    lin.save_ctx(ctx_of[id(lin)], x)
                return y, [() for _ in ctxs]
            z = linear_fprop(x, lin.weight)
            if ctx_of[id(lin)].requires_grad:
                lin.save_ctx(ctx_of[id(lin)], x)
        else:
            z = x
        b = None
        if bias is not None:
            bias.check_input(z)
            bias.save_ctx(ctx_of[id(bias)])
            b = bias.bias
        act.check_input(z)
        seed = drop.start(ctx_of[id(drop)], z) if drop is not None else None  # the Dropout seed protocol
        p = drop.p if seed is not None else 0.0
        y = _kernels().bias_act_fwd(z, b, act.kind, dropout_p=p, seed=seed)
        act.save_ctx(ctx_of[id(act)], z, bias=b)
        return y, [() for _ in ctxs]


class BackwardBiasActivation(FusedOperation):
    """Backward of ``[Bias] activation [Dropout]``: dropout mask regenerated, activation gradient
    and bias column sum in one pass."""

    def __init__(self, ops) -> None:
        super().__init__(ops)
        self.roles = _split(ops)

    def fuser_backward(self, ctxs, dy, *, grad_extra_outputs, **kwargs):
        ctx_of = {id(op): ctx for op, ctx in zip(self.basic_ops, ctxs)}
        bias, act, drop = self.roles["bias"], self.roles["act"], self.roles["dropout"]
        actx = ctx_of[id(act)]
        seed = drop.seed_of(ctx_of[id(drop)]) if drop is not None else None
        p = drop.p if seed is not None else 0.0
        need_dbias = bias is not None and ctx_of[id(bias)].bias_grad
        grads = []
        if not actx.saved_tensors:  # nothing before needs a gradient
            dz, db = None, None
        else:
            (x,) = actx.saved_tensors
            dz, db = _kernels().bias_act_bwd(dy, x, actx.act_bias, act.kind, need_dbias, dropout_p=p, seed=seed)
            if db is not None and db.dtype != bias.bias.dtype:
                db = db.to(bias.bias.dtype)
        for op in self.basic_ops:
            grads.append((db,) if op is bias else ())
        dx = dz if ctxs[0].input_requires_grad else None
        return dx, grads, [() for _ in ctxs]


def _check_forward(ops, ctx):
    roles = _split(ops)
    drop = roles["dropout"]
    if drop is not None and not drop.active:
        return "dropout is inactive (eval mode or p=0): nothing to fuse into"
    if ctx.device is not None and ctx.device.type == "cuda" and ctx.dtype == torch.float64:
        return "float64 on CUDA: the Triton kernels serve fp32/fp16/bf16"
    return None


def _check_backward(ops, ctx):
    return _check_forward(ops, ctx)


_ACT = match(ACTIVATION_CLASSES)
_build_fwd = ForwardLinearBiasActivation
_build_bwd = BackwardBiasActivation

# Forward rules (longest match wins; priority equal).
RULES = [  # the built-in rules of this family (installed by fusible_ops/__init__.py)
    rule("linear_bias_activation_dropout", [BasicLinear, Bias, _ACT, Dropout],
         pass_="forward", build=_build_fwd, check=_check_forward),
    rule("linear_bias_activation", [BasicLinear, Bias, _ACT],
         pass_="forward", build=_build_fwd, check=_check_forward),
    rule("linear_bias", [BasicLinear, Bias], pass_="forward", build=_build_fwd, check=_check_forward),
    rule("bias_activation_dropout", [Bias, _ACT, Dropout],
         pass_="forward", build=_build_fwd, check=_check_forward),
    rule("bias_activation", [Bias, _ACT], pass_="forward", build=_build_fwd, check=_check_forward),
    rule("activation_dropout", [_ACT, Dropout], pass_="forward", build=_build_fwd, check=_check_forward),

    # Backward rules.
    rule("bias_activation_dropout_backward", [Bias, _ACT, Dropout],
         pass_="backward", build=_build_bwd, check=_check_backward),
    rule("activation_bias_backward", [Bias, _ACT],
         pass_="backward", build=_build_bwd, check=_check_backward),
    rule("activation_dropout_backward", [_ACT, Dropout],
         pass_="backward", build=_build_bwd, check=_check_backward),
]

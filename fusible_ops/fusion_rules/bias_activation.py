"""Linear + bias + activation (+ dropout) forward, and activation + bias (+ dropout) backward.

Forward (``ForwardLinearBiasActivation``): the GEMM runs through torch (cuBLAS on CUDA); bias,
activation and dropout run in ONE Triton pass over its output. The pre-bias GEMM output is what
the activation's ctx keeps (with ``act_bias``), so the biased pre-activation is never written.
On the reference path (CPU) the bias goes into the GEMM (``addmm``, as ``torch.nn.Linear``) and
the activation's ctx keeps the biased output (``act_bias`` None); backward then sums dbias from
the activation gradient.

Backward (``BackwardBiasActivation``): the activation gradient (after regenerating the dropout
mask) and the bias gradient (a column reduction) in ONE Triton pass; when the op before is an
FP8 linear (``prev_op_grad_output_quantizer``) that pass also takes max|dz| and one cast kernel
writes the linear's FP8 gradient (both layouts).

Dropout's seed goes through the ``Dropout`` protocol: ``drop.start(ctx, z)`` in forward (draws the
seed tensor on the device and saves it in the Dropout's ctx, exactly as ``Dropout.op_forward``
does) and ``drop.seed_of(ctx)`` in backward; the kernels read the seed on the device.
"""

from __future__ import annotations

import torch

from ..kernels import activation as _K
from ..kernels import use_triton
from ..kernels.activation_ref import act_native
from ..op import FusedOperation
from ..ops.activation import ACTIVATION_CLASSES, Activation, check_gated_width
from ..ops.linear import BasicLinear, Bias
from ..ops.misc import Dropout
from ..ops.validation import check_input, native_dtype_ok
from ..quantization.recipes import current_recipe
from ..quantization.tensor import is_float8
from ..rules import match, rule



_ROLES = (("linear", BasicLinear), ("bias", Bias), ("act", Activation), ("dropout", Dropout))


def _split(ops):
    """Name the roles of the matched ops: {role: (op, index in ops)} for (linear, bias, act,
    dropout), each possibly (None, None)."""
    roles = {name: (None, None) for name, _ in _ROLES}
    for i, op in enumerate(ops):
        for name, cls in _ROLES:
            if isinstance(op, cls):
                roles[name] = (op, i)
    return roles


class ForwardLinearBiasActivation(FusedOperation):
    """Forward of ``[BasicLinear] [Bias] [activation] [Dropout]`` (any contiguous subset that the
    rules below match). Fills each basic op's ctx exactly as the op's own forward would. When the
    next op is an FP8 linear (``next_op_input_quantizer``), the activation kernel writes that
    linear's FP8 input itself (:meth:`~fusible_ops.quantization.InputQuantizer.produce`)."""

    writes_fp8_output = True
    cpu_autograd = True  # (see FusibleOperation.cpu_autograd)

    def __init__(self, ops) -> None:
        super().__init__(ops)
        self.roles = _split(ops)
        self._no_extras = [()] * len(ops)
        # A gated activation after the linear: its input is the GEMM's output, of the linear's
        # out_features (fixed for the plan). An odd one is checked on every call of the native path
        # (the activation's own check_input runs on the others), before the GEMM.
        lin, act = self.roles["linear"][0], self.roles["act"][0]
        self._odd_glu = lin is not None and act is not None and act.gated and lin.out_features % 2 != 0

    @property
    def replayable(self) -> bool:  # (see FusibleOperation.replayable; a dropout's seed is drawn per call)
        return self.roles["dropout"][0] is None

    def fuser_forward(self, ctxs, x, *, extra_inputs, **kwargs):
        r = self.roles
        (lin, li), (bias, bi), (act, ai), (drop, di) = r["linear"], r["bias"], r["act"], r["dropout"]
        if (lin is not None and drop is None and not ctxs[0].requires_grad
                and native_dtype_ok(x, act is not None and act.gated)
                and not is_float8(x) and current_recipe() is None and not use_triton(x)):
            return self._native(ctxs[li], x, lin, bias, act, self._odd_glu), self._no_extras
        if lin is not None:
            if act is None or not use_triton(x):  # the bias in the GEMM's epilogue (addmm)
                bias.check_input(x, shape=(*x.shape[:-1], lin.out_features))
                bias.save_ctx(ctxs[bi])
                z = lin.fprop(ctxs[li], x, bias.bias)
                if act is None:  # linear + bias only
                    return z, self._no_extras
                bias = None  # reference math (CPU): the activation's ctx keeps the biased z, act_bias None
            else:
                z = lin.fprop(ctxs[li], x)
        else:
            z = x
        b = None
        if bias is not None:
            bias.check_input(z)
            bias.save_ctx(ctxs[bi])
            b = bias.bias
        act.check_input(z)
        seed = drop.start(ctxs[di], z) if drop is not None else None  # the Dropout seed protocol
        p = drop.p if seed is not None else 0.0
        per_op = kwargs.get("basic_op_kwargs")
        quant = per_op[-1].get("next_op_input_quantizer") if per_op else None
        if quant is None:
            y = _K.bias_act_fwd(z, b, act.kind, dropout_p=p, seed=seed)
        else:  # the next op is an FP8 linear: this kernel writes its input (see InputQuantizer.produce)
            kind = act.kind

            def run(amax=None, **fp8):
                if amax is None:
                    return _K.bias_act_fwd(z, b, kind, dropout_p=p, seed=seed)
                return _K.bias_act_fwd_fp8(z, b, kind, amax=amax, dropout_p=p, seed=seed, **fp8)

            y = quant.produce(run, z)
        act.save_ctx(ctxs[ai], z, bias=b)
        return y, self._no_extras

    @staticmethod
    def _native(lctx, x, lin, bias, act, odd_glu):
        """Reference math that fills no ctx (a call under PyTorch's autograd, or inference; dtypes
        as :func:`~fusible_ops.ops.validation.native_dtype_ok`), no FP8, no dropout:
        ``act(x @ w.T + b)`` with torch's ops, the bias in the GEMM (``addmm``), as the generic
        path computes it, without its ctx bookkeeping. ``odd_glu``: the activation is gated and
        the linear's width odd (it raises as the activation would, before the GEMM)."""
        w = lctx.gated_weight  # (set under PyTorch's autograd: see ContractGate)
        if w is None:
            w = lin.weight
        check_input(lin, x, features=lin.in_features, like=w)
        b = None
        if bias is not None:
            b = bias.bias
            if bias.size != lin.out_features:  # (else the output's last dim is the bias's size)
                bias.check_input(x, shape=(*x.shape[:-1], lin.out_features))  # (raises)
            check_input(bias, x, like=b)  # dtype and device of the bias
        if odd_glu:
            check_gated_width(act, (*x.shape[:-1], lin.out_features))  # (raises)
        z = torch._C._nn.linear(x, w, b)  # (F.linear)
        return z if act is None else act_native(z, act.kind)


class BackwardBiasActivation(FusedOperation):
    """Backward of ``[Bias] activation [Dropout]``: dropout mask regenerated, activation gradient
    and bias column sum in one pass (which also serves a preceding FP8 linear's gradient cast)."""

    writes_fp8_grad = True

    def __init__(self, ops) -> None:
        super().__init__(ops)
        self.roles = _split(ops)
        self._no_extras = [()] * len(ops)

    @property
    def replayable(self) -> bool:  # (see FusibleOperation.replayable)
        return self.roles["dropout"][0] is None

    def fuser_backward(self, ctxs, dy, *, grad_extra_outputs, **kwargs):
        (bias, bi), (act, ai), (drop, di) = self.roles["bias"], self.roles["act"], self.roles["dropout"]
        actx = ctxs[ai]
        seed = drop.seed_of(ctxs[di]) if drop is not None else None
        p = drop.p if seed is not None else 0.0
        need_dbias = bias is not None and ctxs[bi].bias_grad
        gq = kwargs.get("prev_op_grad_output_quantizer")  # the linear before wants dz in FP8
        if not actx.saved_tensors:  # nothing before needs a gradient
            dz, db = None, None
        else:
            (x,) = actx.saved_tensors
            if gq is None or not ctxs[0].input_requires_grad:
                dz, db = _K.bias_act_bwd(dy, x, actx.act_bias, act.kind, need_dbias, dropout_p=p, seed=seed)
            else:  # this pass also takes max|dz| for the linear's FP8 cast (InputQuantizer.produce)
                out = []

                def run(amax=None):
                    if amax is None:
                        out.append(_K.bias_act_bwd(dy, x, actx.act_bias, act.kind, need_dbias, dropout_p=p, seed=seed))
                    else:
                        out.append(_K.bias_act_bwd_amax(dy, x, actx.act_bias, act.kind, need_dbias, amax=amax,
                                                        dropout_p=p, seed=seed))
                    return out[0][0]

                dzq = gq.produce(run, x, direct=False)
                dz, db = out[0]
            if need_dbias and db is None:  # the bias was added in the GEMM (act_bias None)
                db = dz.sum(0) if dz.dim() == 2 else dz.flatten(0, -2).sum(0)
            if db is not None and db.dtype != bias.bias.dtype:
                db = db.to(bias.bias.dtype)
            if gq is not None and ctxs[0].input_requires_grad:
                dz = dzq
        grads = [()] * len(ctxs)
        if bias is not None:
            grads[bi] = (db,)
        dx = dz if ctxs[0].input_requires_grad else None
        return dx, grads, self._no_extras


def _check_forward(ops, ctx):
    drop = _split(ops)["dropout"][0]
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

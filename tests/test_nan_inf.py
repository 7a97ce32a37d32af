"""NaN / +-Inf semantics of every activation: both kernel paths (Triton through the interpreter on
CPU, and the pure-torch ``*_ref`` twins), forward and backward, against plain torch autograd.

What torch gives (float32 and float64, CPU, torch 2.13; ``g`` = the gradient for an upstream
gradient of 1; the full contract is in :mod:`fusible_ops.kernels.activation_ref`):

=============  ===============  ===============  ===============
act            z = NaN          z = +Inf         z = -Inf
=============  ===============  ===============  ===============
relu           y NaN, g 1       y +Inf, g 1      y 0, g 0
gelu (erf)     y NaN, g NaN     y +Inf, g NaN    y NaN, g NaN
gelu (tanh)    y NaN, g NaN     y +Inf, g NaN    y NaN, g NaN
silu           y NaN, g NaN     y +Inf, g NaN    y NaN, g NaN
=============  ===============  ===============  ===============

relu's backward selects (``threshold_backward``: 0 where z <= 0 even for a NaN/Inf upstream
gradient); every other backward multiplies. One torch quirk: float32 exact ``gelu(+Inf)`` on CPU
is NaN in torch's vectorized kernel (+Inf in its scalar tail, in float64 and on CUDA); we give
+Inf, so the float32 references below use torch's gelu with that one value fixed (its gradient is
torch's own ``gelu_backward``).
"""

import math

import pytest
import torch
import torch.nn.functional as F

import fusible_ops as fo
import fusible_ops.kernels as K
from fusible_ops.kernels import activation as A
from fusible_ops.kernels import dropout as D
from fusible_ops.kernels import launch
from fusible_ops.kernels import grouped_glu as gm

pytestmark = [  # the interpreter computes with numpy, which warns on inf * 0 and exp overflow
    pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning"),
]

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # "triton" mode: real kernels on a GPU, else the interpreter
NAN, INF = float("nan"), float("inf")
V = [NAN, INF, -INF, 0.0, 0.5, -1.5, 3.0, 20.0, -20.0]  # activation inputs
DY = [1.0, -0.75, NAN, INF, -INF, 0.0]  # upstream gradients (one per row)
MODES = ["triton", "reference"]
class _Gelu(torch.autograd.Function):
    """torch's exact GELU, forward and backward, with gelu(+Inf) = +Inf in float32 too."""

    @staticmethod
    def forward(ctx, z):
        ctx.save_for_backward(z)
        return torch.where(z == INF, z, F.gelu(z))

    @staticmethod
    def backward(ctx, g):
        (z,) = ctx.saved_tensors
        return torch.ops.aten.gelu_backward(g, z, approximate="none")


BASE = {
    "relu": torch.relu, "gelu": _Gelu.apply, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "silu": F.silu,
}
TORCH = {**BASE, "gelu": F.gelu}
GATE = {"swiglu": "silu", "geglu": "gelu", "geglu_tanh": "gelu_tanh", "reglu": "relu"}
TABLE = {  # act: {z: (y, g)}
    "relu": {NAN: (NAN, 1.0), INF: (INF, 1.0), -INF: (0.0, 0.0)},
    "gelu": {NAN: (NAN, NAN), INF: (INF, NAN), -INF: (NAN, NAN)},
    "gelu_tanh": {NAN: (NAN, NAN), INF: (INF, NAN), -INF: (NAN, NAN)},
    "silu": {NAN: (NAN, NAN), INF: (INF, NAN), -INF: (NAN, NAN)},
}


def close(actual, expected, msg=""):
    torch.testing.assert_close(actual, expected, equal_nan=True, msg=lambda m: f"{msg}\n{m}")


def _act(kind):
    if kind in GATE:
        base = BASE[GATE[kind]]
        return lambda z: base(z[..., : z.shape[-1] // 2]) * z[..., z.shape[-1] // 2 :]
    return BASE[kind]


def _grid(kind):
    """(x, dy): every activation input against every upstream gradient; gated kinds also every
    (a, b) pair. x [len(DY), n] float32."""
    n = len(V)
    if kind in GATE:
        j = torch.arange(n * n)
        a, b = torch.tensor(V)[j // n], torch.tensor(V)[j % n]
        row = torch.cat([a, b])
    else:
        row = torch.tensor(V)
    x = row.expand(len(DY), -1).contiguous()
    dy = torch.tensor(DY)[:, None].expand(-1, row.numel() // (2 if kind in GATE else 1)).contiguous()
    return x.to(DEV), dy.to(DEV)


def _torch_ref(fn, inputs, dy):
    """(y, grads) of fn(*inputs) by plain torch autograd (float32)."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    y = fn(*leaves)
    grads = torch.autograd.grad(y, leaves, dy)
    return y.detach(), list(grads)


def test_torch_table():
    """The table above is what torch does (float64 everywhere; float32 too, but gelu(+Inf))."""
    for act, rows in TABLE.items():
        for dtype in (torch.float32, torch.float64):
            for z, (y_exp, g_exp) in rows.items():
                x = torch.tensor([z], dtype=dtype, requires_grad=True)
                y = TORCH[act](x)
                (g,) = torch.autograd.grad(y, x, torch.ones_like(y))
                if not (act == "gelu" and z == INF and dtype == torch.float32):  # the CPU quirk
                    close(y, torch.tensor([y_exp], dtype=dtype), f"{act}({z}) {dtype}")
                close(g, torch.tensor([g_exp], dtype=dtype), f"{act}'({z}) {dtype}")
    # relu's backward is a select: a NaN/Inf upstream gradient gives 0 where z <= 0
    x = torch.tensor([-1.0, 0.0, NAN, 2.0], requires_grad=True)
    (g,) = torch.autograd.grad(torch.relu(x), x, torch.tensor([NAN, INF, NAN, INF]))
    close(g, torch.tensor([0.0, 0.0, NAN, INF]))


def test_reference_gelu_is_torch_gelu_but_at_plus_inf():
    x, dy = _grid("gelu")
    y, (g,) = _torch_ref(_Gelu.apply, [x], dy)
    y_t, (g_t,) = _torch_ref(F.gelu, [x], dy)
    y64, (g64,) = _torch_ref(F.gelu, [x.double()], dy.double())
    fin = x != INF
    close(y[fin], y_t[fin])
    close(g, g_t)
    close(y[~fin], y64[~fin].float())  # +Inf, as torch's float64 (and CUDA, and its scalar path)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", A.ACTIVATIONS)
def test_bias_act_kernels(kind, mode):
    x, dy = _grid(kind)
    y_exp, (dx_exp,) = _torch_ref(_act(kind), [x], dy)
    with K.use(mode):
        y = A.bias_act_fwd(x, None, kind)
        dx, _ = A.bias_act_bwd(dy, x, None, kind, False)
    close(y, y_exp, f"y {kind} {mode}")
    close(dx, dx_exp, f"dx {kind} {mode}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["relu", "gelu", "swiglu", "reglu", "geglu_tanh"])
def test_bias_act_dropout_kernels(kind, mode):
    """z = x + bias, then dropout as a product (dropped NaN/Inf give NaN, as in torch's dropout);
    the bias gradient is the column sum of dz (NaN where a column has one)."""
    x, dy = _grid(kind)
    bias = torch.linspace(-1.0, 1.0, x.shape[-1], device=DEV)
    p, seed = 0.4, torch.tensor([77], device=DEV)
    keep = D.dropout_keep_mask(dy.shape, p, seed, DEV)
    assert keep.any() and not keep.all()

    def f(x, bias):
        return _act(kind)(x + bias) * keep.float() * (1 / (1 - p))

    y_exp, (dx_exp, db_exp) = _torch_ref(f, [x, bias], dy)
    with K.use(mode):
        y = A.bias_act_fwd(x, bias, kind, dropout_p=p, seed=seed)
        dx, db = A.bias_act_bwd(dy, x, bias, kind, True, dropout_p=p, seed=seed)
    close(y, y_exp, f"y {kind} {mode}")
    close(dx, dx_exp, f"dx {kind} {mode}")
    close(db, db_exp, f"dbias {kind} {mode}")


def _scales():
    return torch.tensor([0.5, NAN, INF, 0.0, -2.0, 1.0], device=DEV)  # one per row of the grid


@pytest.mark.parametrize("mode", MODES)
def test_scaled_swiglu_kernels(mode):
    x, dy = _grid("swiglu")
    s = _scales()
    y_exp, (dx_exp, ds_exp) = _torch_ref(lambda x, s: _act("swiglu")(x) * s[:, None], [x, s], dy)
    with K.use(mode):
        y = A.scaled_swiglu_fwd(x, s)
        dx, ds = A.scaled_swiglu_bwd(dy, x, s, True)
    close(y, y_exp, f"y {mode}")
    close(dx, dx_exp, f"dx {mode}")
    close(ds, ds_exp, f"dscales {mode}")


OPS = {
    "relu": fo.ReLU, "gelu": fo.GELU, "gelu_tanh": lambda: fo.GELU("tanh"), "silu": fo.SiLU,
    "swiglu": fo.SwiGLU, "geglu": fo.GEGLU, "geglu_tanh": lambda: fo.GEGLU(approximate="tanh"), "reglu": fo.ReGLU,
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", A.ACTIVATIONS)
def test_public_ops(kind, mode):
    x, dy = _grid(kind)
    y_exp, (dx_exp,) = _torch_ref(_act(kind), [x], dy)
    xr = x.clone().requires_grad_()
    with K.use(mode):
        y = OPS[kind]()(xr)
        y.backward(dy)
    close(y.detach(), y_exp, f"y {kind} {mode}")
    close(xr.grad, dx_exp, f"dx {kind} {mode}")


@pytest.mark.parametrize("mode", MODES)
def test_public_scaled_swiglu_op(mode):
    x, dy = _grid("swiglu")
    s = _scales()
    y_exp, (dx_exp, ds_exp) = _torch_ref(lambda x, s: _act("swiglu")(x) * s[:, None], [x, s], dy)
    xr, sr = x.clone().requires_grad_(), s.clone().requires_grad_()
    with K.use(mode):
        y = fo.ScaledSwiGLU()(xr, sr)
        y.backward(dy)
    close(y.detach(), y_exp, f"y {mode}")
    close(xr.grad, dx_exp, f"dx {mode}")
    close(sr.grad, ds_exp, f"dscales {mode}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dropout", [False, True])
@pytest.mark.parametrize("kind", ["relu", "gelu", "gelu_tanh", "silu", "swiglu", "reglu"])
def test_fused_bias_activation_in_sequential(kind, dropout, mode):
    """``Bias -> act (-> Dropout)`` runs the fused rules; same NaN/Inf as torch autograd of
    ``act(x + bias)`` (then ``Dropout.reference_forward``, which draws the op's seed)."""
    x, dy = _grid(kind)
    n = x.shape[-1]
    bias_op, act_op = fo.Bias(n, device=DEV), OPS[kind]()
    with torch.no_grad():
        bias_op.bias.copy_(torch.linspace(-1.0, 1.0, n, device=DEV))
    ops = [bias_op, act_op] + ([fo.Dropout(0.5)] if dropout else [])
    seq = fo.Sequential(*ops)
    xr = x.clone().requires_grad_()
    with K.use(mode):
        torch.manual_seed(3)
        y = seq(xr)
        y.backward(dy)
    plan = [r["rule"] for r in seq.fusion_plan("forward", xr)]
    assert plan == ["bias_activation_dropout" if dropout else "bias_activation"]
    bplan = [r["rule"] for r in seq.fusion_plan("backward", xr)]
    assert bplan == ["bias_activation_dropout_backward" if dropout else "activation_bias_backward"]

    def f(x, b):
        h = _act(kind)(x + b)
        if dropout:
            torch.manual_seed(3)
            h = ops[2].reference_forward(h)
        return h

    y_exp, (dx_exp, db_exp) = _torch_ref(f, [x, bias_op.bias.detach()], dy)
    close(y.detach(), y_exp, f"y {kind} {mode}")
    close(xr.grad, dx_exp, f"dx {kind} {mode}")
    close(bias_op.bias.grad, db_exp, f"dbias {kind} {mode}")


# ----------------------------------------------------------------------------- grouped GLU (MoE)

GLU_KINDS = ["swiglu", "geglu", "geglu_tanh", "scaled_swiglu"]


def _glu(kind, h, s=None):
    a, b = h.chunk(2, dim=-1)
    act = BASE[{"swiglu": "silu", "scaled_swiglu": "silu", "geglu": "gelu", "geglu_tanh": "gelu_tanh"}[kind]]
    y = act(a) * b
    return y if s is None else y * s[:, None]


@pytest.fixture
def _fixed_configs(monkeypatch):
    monkeypatch.setattr(launch, "AUTOTUNE", False)


@pytest.mark.usefixtures("_fixed_configs")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", GLU_KINDS)
def test_grouped_glu_fwd_epilogue(kind, mode):
    """FC1 (K = 1, x = 1: h = the weights exactly, NaN/Inf included) + GLU in its epilogue."""
    n = len(V)
    j = torch.arange(n * n)
    w_row = torch.cat([torch.tensor(V)[j // n], torch.tensor(V)[j % n]]).to(DEV)  # [2F]
    splits = torch.tensor([2, 0, 3], device=DEV)
    w1 = w_row[None, :, None].expand(3, -1, 1).contiguous()  # [G, 2F, K=1]
    x = torch.ones(5, 1, device=DEV)
    s = torch.tensor([0.5, NAN, INF, 0.0, -2.0], device=DEV) if kind == "scaled_swiglu" else None
    with K.use(mode):
        y, h = gm.grouped_glu_fwd(x, w1, splits, None, kind, s)
    close(h, w_row.expand(5, -1), f"h {kind} {mode}")
    close(y, _glu(kind, w_row.expand(5, -1), s), f"y {kind} {mode}")


@pytest.mark.usefixtures("_fixed_configs")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", GLU_KINDS)
def test_grouped_dglu_epilogue(kind, mode):
    """FC2 dgrad (H = 1, w2 = 1: g[r, :] = dy2[r]) with the dGLU epilogue, against torch autograd of
    glu(h) * scales; dscales = sum_j g * glu."""
    x, dy = _grid("swiglu")  # h [6, 2F] with every (a, b) pair; one upstream value per row
    M, F2 = x.shape
    splits = torch.tensor([4, 2], device=DEV)
    w2 = torch.ones(2, 1, F2 // 2, device=DEV)
    dy2 = dy[:, :1].contiguous()
    s = _scales() if kind == "scaled_swiglu" else None
    y_exp, (dh_exp,) = _torch_ref(lambda h: _glu(kind, h, s), [x], dy)
    ds_exp = (dy * _glu(kind, x)).sum(-1)
    with K.use(mode):
        dh, y, ds = gm.grouped_dglu(dy2, w2, splits, x, kind, s, need_dscales=True)
    close(dh, dh_exp, f"dh {kind} {mode}")
    close(y, y_exp, f"y {kind} {mode}")
    close(ds, ds_exp, f"dscales {kind} {mode}")
    assert math.isnan(ds[2].item()) and math.isnan(ds[0].item())  # NaN pairs in every row

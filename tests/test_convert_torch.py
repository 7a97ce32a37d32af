"""fusible_ops.convert on plain torch.nn models: what converts (by structure, confirmed by probes)
and what is left alone with which reason; converted norms against the original math in float32
and bf16 (the tolerance table); the returned module, the filter, errors. (Hugging Face models:
tests/test_convert.py.)"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fusible_ops as fo
from fusible_ops.convert import to_original_names
from fusible_ops.convert.modules import ConvertedLayerNorm, ConvertedMLP, ConvertedRMSNorm
from fusible_ops.testing import assert_close, assert_close_norm, assert_close_scaled

D, F_ = 32, 64


class HFStyleRMSNorm(nn.Module):
    """Hugging Face's Llama RMSNorm math (attribute ``variance_epsilon``)."""

    def __init__(self, size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


class OffsetNorm(nn.Module):
    """Gemma's RMSNorm: scales by ``1 + weight``."""

    def __init__(self, size, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(size))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.float())).type_as(x)


class EpsOutsideNorm(HFStyleRMSNorm):
    def forward(self, x):
        return self.weight * x / (x.pow(2).mean(-1, keepdim=True).sqrt() + self.variance_epsilon)


class QuickGELU(nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(1.702 * x)


class FcMLP(nn.Module):
    """``fc2(act(fc1(x)))``; ``drop``: a dropout between act and fc2; ``times``: scales the output
    (so the probe must refuse it)."""

    def __init__(self, act, drop=0.0, times=1.0):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(D, F_), act, nn.Linear(F_, D)
        if drop:
            self.drop = nn.Dropout(drop)
        self.times = times

    def forward(self, x):
        h = self.act(self.fc1(x))
        if hasattr(self, "drop"):
            h = self.drop(h)
        return self.fc2(h) * self.times


class W123MLP(nn.Module):
    """The original Llama naming (w1 gate, w3 up, w2 down) with a function attribute as activation."""

    def __init__(self):
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(D, F_, bias=False), nn.Linear(F_, D, bias=False), nn.Linear(D, F_, bias=False)
        self.act = F.silu

    def forward(self, x):
        return self.w2(self.act(self.w1(x)) * self.w3(x))


class FusedGateUpMLP(nn.Module):
    """Phi-3's layout: one [2f, d] projection, gate rows first."""

    def __init__(self):
        super().__init__()
        self.gate_up_proj, self.down_proj = nn.Linear(D, 2 * F_, bias=False), nn.Linear(F_, D, bias=False)
        self.activation_fn = nn.SiLU()

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.activation_fn(gate) * up)


class Conv1DLinear(nn.Module):
    """GPT-2's Conv1D: weight [in, out], ``x @ weight + bias``."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out) * 0.1)
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x):
        return x @ self.weight + self.bias


class GPT2StyleMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc, self.c_proj, self.act = Conv1DLinear(D, F_), Conv1DLinear(F_, D), nn.GELU(approximate="tanh")

    def forward(self, x):
        return self.c_proj(self.act(self.c_fc(x)))


CONVERTED = {
    "rms": ("fo.RMSNorm", nn.RMSNorm(D, eps=1e-5)),
    "hf_rms": ("fo.RMSNorm", HFStyleRMSNorm(D)),
    "ln": ("fo.LayerNorm", nn.LayerNorm(D)),
    "seq_mlp": ("fo.Sequential(Linear, GELU, Linear)", nn.Sequential(nn.Linear(D, F_), nn.GELU(), nn.Linear(F_, D))),
    "fc_mlp": ("fo.Sequential(Linear, ReLU, Linear)", FcMLP(nn.ReLU())),
    "fc_mlp_p0": ("fo.Sequential(Linear, GELU, Linear)", FcMLP(nn.GELU(approximate="tanh"), drop=0.0)),
    "w123": ("fo.Sequential(Linear, SwiGLU, Linear) (w1 + w3 fused into gate_up_proj [2f, d])", W123MLP()),
    "phi3": ("fo.Sequential(Linear, SwiGLU, Linear) (gate/up already one weight)", FusedGateUpMLP()),
}
LEFT_ALONE = {
    "offset_norm": ("(1 + weight)", OffsetNorm(D)),
    "eps_outside": ("does not compute x / sqrt(mean(x^2) + eps) * weight", EpsOutsideNorm(D, eps=1e-2)),
    "ln_no_bias": ("subtracts the mean", nn.LayerNorm(D, bias=False)),
    "ln_no_affine": ("no weight", nn.LayerNorm(D, elementwise_affine=False)),
    "rms_eps_none": ("eps=None", nn.RMSNorm(D)),
    "quick_gelu": ("act: the activation is none of", FcMLP(QuickGELU())),
    "dropout": ("has dropout drop (p=0.1)", FcMLP(nn.GELU(), drop=0.1)),
    "scaled": ("does not compute fc2(act(fc1(x)))", FcMLP(nn.GELU(), times=2.0)),
    "gpt2": ("c_fc: weight [32, 64] with bias [64]: a Conv1D-style layer", GPT2StyleMLP()),
}


class Zoo(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        for name, (_, m) in {**CONVERTED, **LEFT_ALONE}.items():
            self.add_module(name, copy.deepcopy(m))
        with torch.no_grad():
            for n, p in self.named_parameters():
                if p.dim() == 1 and "norm" in n or n.endswith(("rms.weight", "ln.weight")):
                    p.uniform_(0.5, 1.5)

    def forward(self, x):
        for m in self.children():
            x = x + m(x)
        return x


def test_report_converted_and_left_alone_with_reasons(capsys):
    model = Zoo()
    ref = copy.deepcopy(model)
    fo.convert(model, verbose=True)
    report = model.fusible_ops_report
    assert sorted(report.names()) == sorted(CONVERTED)
    for e in report.converted:
        assert e.into == CONVERTED[e.name][0], e
    assert sorted(report.names(converted=False)) == sorted(LEFT_ALONE)
    for e in report.left_alone:
        assert LEFT_ALONE[e.name][0] in e.reason, e
        assert getattr(model, e.name) is not None and type(getattr(model, e.name)) is type(LEFT_ALONE[e.name][1])
    printed = capsys.readouterr().out
    assert "left alone:" in printed and "offset_norm (OffsetNorm): computes x_normed * (1 + weight)" in printed
    # same math, same state dict, same gradients (under the original names)
    same = list(ref.state_dict())
    assert list(model.state_dict()) == same
    model.eval()  # (the left-alone dropout)
    ref.eval()
    x = torch.randn(4, 8, D, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y, want = model(x), ref(x2)
    assert_close(y, want, torch.float32)
    y.square().mean().backward()
    want.square().mean().backward()
    got = to_original_names(model, {n: p.grad for n, p in model.named_parameters()})
    for n, p in ref.named_parameters():
        assert_close_norm(got[n], p.grad, torch.float32, msg=n)
    assert_close(x.grad, x2.grad, torch.float32)


def test_parameters_kept_where_nothing_is_fused():
    """Norms and plain MLPs hold the original Parameter objects (an optimizer built before keeps
    working); a gated MLP's down projection too."""
    model = Zoo()
    before = dict(model.named_parameters())
    fo.convert(model)
    after = dict(model.named_parameters())
    for name in ("rms.weight", "ln.weight", "ln.bias", "seq_mlp.0.weight", "fc_mlp.fc2.bias", "w123.w2.weight",
                 "phi3.gate_up_proj.weight"):
        assert after[name] is before[name], name
    assert "w123.gate_up_proj.weight" in after and "w123.w1.weight" not in after
    assert isinstance(model.rms, ConvertedRMSNorm) and isinstance(model.ln, ConvertedLayerNorm)
    assert isinstance(model.w123, ConvertedMLP) and model.w123.act.__class__ is fo.SwiGLU


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("make", [lambda: nn.RMSNorm(D, eps=1e-5), lambda: HFStyleRMSNorm(D, eps=1e-6),
                                  lambda: nn.LayerNorm(D, eps=1e-5)], ids=["torch_rms", "hf_rms", "torch_ln"])
def test_converted_norm_numerics(make, dtype):
    """A converted norm against the original's math in float64 from the same (rounded) inputs:
    output, input and weight gradients within the table's entry for ``dtype``, or (the table's
    baseline rule) no worse than the original module run in ``dtype``; same output dtype."""
    torch.manual_seed(1)
    orig = make()
    with torch.no_grad():
        for p in orig.parameters():
            p.uniform_(0.5, 1.5)
    ref = copy.deepcopy(orig).double()
    base = copy.deepcopy(orig).to(dtype)
    conv = fo.convert(copy.deepcopy(orig).to(dtype))
    assert isinstance(conv, (ConvertedRMSNorm, ConvertedLayerNorm))
    for scale in (1.0, 1e-3):  # (1e-3: the mean square is near eps, where its place matters)
        xs = [(torch.randn(4, 5, D) * scale).to(dtype).requires_grad_()]
        xs += [xs[0].detach().clone().requires_grad_(), xs[0].detach().double().requires_grad_()]
        ys = [conv(xs[0]), base(xs[1]), _ref_math(ref, xs[2])]
        assert ys[0].dtype == ys[1].dtype
        dy = torch.randn_like(ys[2])
        for m, y in zip((conv, base, ref), ys):
            m.zero_grad()
            y.backward(dy.to(y.dtype))
        assert_close_scaled(ys[0], ys[2], dtype, f"y at scale {scale}", baseline=ys[1])
        assert_close_scaled(xs[0].grad, xs[2].grad, dtype, "dx", baseline=xs[1].grad)
        for (n, p), b, r in zip(conv.named_parameters(), base.parameters(), ref.parameters()):
            assert_close_scaled(p.grad, r.grad, dtype, f"d{n}", baseline=b.grad)


def _ref_math(ref, x):
    """The original module's math in float64 (a Hugging Face norm casts to float32 itself)."""
    if isinstance(ref, HFStyleRMSNorm):
        return ref.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + ref.variance_epsilon)
    return ref(x)


def test_mixed_dtype_norm_keeps_original_output_dtype():
    """bf16 input, float32 weight: a Hugging Face norm returns float32 (weight * x.to(bf16)),
    torch.nn.RMSNorm returns bf16; the converted ones do the same."""
    x = torch.randn(3, D, dtype=torch.bfloat16)
    for orig in (HFStyleRMSNorm(D), nn.RMSNorm(D, eps=1e-6)):
        want = orig(x)
        got = fo.convert(copy.deepcopy(orig))(x)
        assert got.dtype == want.dtype
        assert_close(got, want, torch.bfloat16)


def test_root_module_converted_and_fusion_plan():
    """A model that is itself an MLP: convert returns the new module (a fo.Sequential, keys as
    torch.nn.Sequential's), whose biases fuse into its GEMMs."""
    mlp = nn.Sequential(nn.Linear(D, F_), nn.SiLU(), nn.Linear(F_, D))
    keys = list(mlp.state_dict())
    new = fo.convert(mlp)
    assert isinstance(new, ConvertedMLP) and new is not mlp and new.fusible_ops_report.names() == [""]
    assert list(new.state_dict()) == keys
    new(torch.randn(4, D, requires_grad=True)).sum().backward()
    assert [g["rule"] for g in new.fusion_plan()] == ["linear_bias_activation", "linear_bias"]


def test_convert_twice_and_filter():
    model = Zoo()
    fo.convert(model, module_filter_fn=lambda m, name: name != "fc_mlp")
    report = model.fusible_ops_report
    assert "fc_mlp" not in report.names()
    assert {e.name: e.reason for e in report.left_alone}["fc_mlp"] == "module_filter_fn returned False"
    state = {k: v.clone() for k, v in model.state_dict().items()}
    fo.convert(model)
    again = model.fusible_ops_report
    assert again.names() == ["fc_mlp"]
    assert {e.name for e in again.left_alone if e.reason == "already converted"} == set(CONVERTED) - {"fc_mlp"}
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


def test_recipe_and_model_errors_name_convert():
    with pytest.raises(TypeError, match="fusible_ops.convert: recipe must be"):
        fo.convert(Zoo(), recipe="fp8")
    with pytest.raises(TypeError, match="fusible_ops.convert: model must be a torch.nn.Module"):
        fo.convert(lambda x: x)


def test_hooked_module_left_alone():
    model = Zoo()
    model.rms.register_forward_hook(lambda *a: None)
    fo.convert(model)
    assert {e.name: e.reason for e in model.fusible_ops_report.left_alone}["rms"] == "has module hooks (they would be lost)"


def test_fp8_recipe_on_plain_mlp():
    """``recipe=``: the converted MLP runs its GEMMs in FP8 (dims multiples of 16)."""
    mlp = fo.convert(nn.Sequential(nn.Linear(D, F_), nn.GELU(), nn.Linear(F_, D)), recipe=fo.Float8CurrentScaling())
    y = mlp(torch.randn(16, D, requires_grad=True))
    y.sum().backward()
    assert mlp[0].fp8_weight_casts == 1 and mlp[2].fp8_weight_casts == 1

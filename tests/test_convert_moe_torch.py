"""fusible_ops.convert on MoE blocks recognized by structure (a plain torch block nobody wrote a
converter for: sigmoid routing, differently named weights), what is left alone and why (a routed
scaling factor, a group-limited router, a router bias, random jitter, hooks), copies, and FP8
delayed-scaling state of the converted experts. (Hugging Face models: tests/test_convert_moe.py.)
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fusible_ops as fo
from fusible_ops.convert.moe import ConvertedMoE
from fusible_ops.testing import assert_close, assert_close_norm


class Experts(nn.Module):
    """Expert weights under other names than Hugging Face's, the down projection registered first
    (roles are told by shape), the activation a function attribute."""

    def __init__(self, e: int, d: int, f: int) -> None:
        super().__init__()
        self.w_out = nn.Parameter(torch.randn(e, d, f) / f ** 0.5)
        self.w_in = nn.Parameter(torch.randn(e, 2 * f, d) / d ** 0.5)
        self.act = F.silu


class SigmoidMoE(nn.Module):
    """DeepSeek-style routing (sigmoid scores, top-k, normalized), optionally with a routed scaling
    factor, a group limit (top-k within the best of ``groups`` groups), a router bias, jitter."""

    def __init__(self, d: int = 32, f: int = 16, e: int = 8, k: int = 2, *, scale: float = 1.0, groups: int = 1,
                 bias: bool = False, jitter_noise: float = 0.0) -> None:
        super().__init__()
        self.router = nn.Linear(d, e, bias=bias)
        self.experts = Experts(e, d, f)
        self.top_k, self.scale, self.groups, self.jitter_noise = k, scale, groups, jitter_noise

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.jitter_noise:
            x = x * torch.empty_like(x).uniform_(1 - self.jitter_noise, 1 + self.jitter_noise)
        x2 = x.reshape(-1, x.shape[-1])
        s = torch.sigmoid(self.router(x2))
        sel = s
        if self.groups > 1:
            best = s.view(len(s), self.groups, -1).amax(-1).argmax(-1)
            group = torch.arange(s.shape[1], device=s.device) // (s.shape[1] // self.groups)
            sel = s.masked_fill(group[None, :] != best[:, None], -1.0)
        ids = sel.topk(self.top_k, -1).indices
        p = s.gather(1, ids)
        p = p / p.sum(-1, keepdim=True) * self.scale
        out = torch.zeros_like(x2)
        for j in range(self.top_k):
            g, u = torch.einsum("tod,td->to", self.experts.w_in[ids[:, j]], x2).chunk(2, -1)
            y = torch.einsum("tdf,tf->td", self.experts.w_out[ids[:, j]], self.experts.act(g) * u)
            out = out + p[:, j:j + 1] * y
        return out.reshape(x.shape)


def model_of(cls=SigmoidMoE, **kw) -> nn.Module:
    """``nn.Sequential(nn.Linear(32, 32), cls(**kw))`` from a fixed seed."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), cls(**kw))


def test_a_block_nobody_wrote_a_converter_for():
    """Recognized by structure (weights ``w_in`` [E, 2f, d] / ``w_out`` [E, d, f], router an
    ``nn.Linear``), the routing (sigmoid, normalized) found by the probe; output and every gradient
    match the original."""
    model = model_of()
    ref = copy.deepcopy(model)
    w_in = model[1].experts.w_in
    fo.convert(model)
    report = model.fusible_ops_report
    assert [(e.name, e.source) for e in report.converted] == [("1", "SigmoidMoE")]
    assert report.converted[0].into.startswith("fo.Sequential(Router(sigmoid, top-2, normalized), Dispatch, "
                                               "GroupedLinear, SwiGLU, GroupedLinear, Combine) (experts.w_in")
    assert isinstance(model[1], ConvertedMoE)
    assert model[1].experts.w_in is w_in  # (the original Parameter objects)
    x = torch.randn(2, 12, 32)
    for m in (model, ref):
        m(x).square().mean().backward()
    assert_close(model(x), ref(x), torch.float32)
    got = dict(model.named_parameters())
    assert list(got) == [n for n, _ in ref.named_parameters()]
    for name, p in ref.named_parameters():
        assert_close_norm(got[name].grad, p.grad, torch.float32, msg=name)
    assert [g["rule"] for g in model[1].fusion_plan()] == [None, "moe_dispatch_mlp", None]


@pytest.mark.parametrize("kw,reason", [
    (dict(scale=2.5), "does not compute the routed experts with softmax or sigmoid top-2 routing"),
    (dict(groups=4), "does not compute the routed experts with softmax or sigmoid top-2 routing"),
    (dict(bias=True), "the router (router) holds bias besides its weight"),
    (dict(jitter_noise=0.1), "jitter_noise=0.1: the router input is multiplied by random noise in training"),
])
def test_left_alone_with_the_reason(kw, reason):
    """A routed scaling factor, a group-limited router, a router bias, jitter: not reproduced by
    fo.Router, left alone with the reason; the model computes what it did."""
    model = model_of(**kw).eval()
    ref = copy.deepcopy(model)
    fo.convert(model)
    report = model.fusible_ops_report
    assert report.converted == []
    (entry,) = report.left_alone
    assert entry.name == "1" and reason in entry.reason, entry.reason
    x = torch.randn(2, 12, 32)
    assert torch.equal(model(x), ref(x))


class Noisy(SigmoidMoE):
    """Random noise in training under no attribute the converter knows."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            x = x * (1 + 0.1 * torch.randn_like(x))
        return super().forward(x)


def test_random_in_training_is_left_alone():
    """The probe runs the block in training mode too: noise there (under any name) shows."""
    model = model_of(Noisy)
    fo.convert(model)
    (entry,) = model.fusible_ops_report.left_alone
    assert "in training mode differs from evaluation mode's" in entry.reason, entry.reason


def test_hooks_leave_it_alone():
    model = model_of()
    model[1].router.register_forward_hook(lambda m, a, out: out * 2)
    fo.convert(model)
    (entry,) = model.fusible_ops_report.left_alone
    assert entry.reason == "router has module hooks (they would be lost)"


def test_copies_compute_with_their_own_parameters():
    """A deep copy of a converted model computes with the copy's parameters (the lent weights
    follow the copy), and loading new weights into the original does not change the copy."""
    model = model_of()
    fo.convert(model)
    x = torch.randn(2, 12, 32)
    before = model(x).detach()
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    assert torch.equal(twin(x), before)
    assert not torch.allclose(model(x), before)
    assert twin[1].fusible_moe[2].weight is twin[1].experts.w_in


def test_fp8_delayed_scaling_state_round_trips():
    """Under Float8DelayedScaling the experts' FP8 histories live on the converted block's
    ``fusible_weights`` owners, in the state dict, and load into a fresh converted model."""
    recipe = fo.Float8DelayedScaling()
    model = model_of()
    fo.convert(model, recipe=recipe)
    x = torch.randn(2, 16, 32)
    model(x).square().mean().backward()
    sd = model.state_dict()
    hist = [k for k in sd if k.startswith("1.fusible_weights.") and k.endswith("fp8_amax_history")]
    assert hist == [f"1.fusible_weights.experts_{w}.fp8_amax_history" for w in ("w_in", "w_out")]
    fresh = model_of()
    fo.convert(fresh, recipe=recipe)
    fresh.load_state_dict(sd)
    assert all(torch.equal(v, fresh.state_dict()[k]) for k, v in sd.items())

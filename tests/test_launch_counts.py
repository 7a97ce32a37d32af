"""Kernel launches per forward and per backward of each built-in fused op (GPU), counted with
torch.profiler: the numbers of the launch-count table in docs/kernels.md. A change that adds a
launch must update that table (and say why)."""

import pytest
import torch

import fusible_ops as fo

pytestmark = pytest.mark.gpu
DEV, DT = "cuda", torch.bfloat16


def _count(fn) -> int:
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def _cases():
    kw = dict(device=DEV, dtype=DT)
    x = lambda *s: torch.randn(*s, **kw, requires_grad=True)  # noqa: E731
    splits = torch.tensor([5, 0, 7, 4], device=DEV)
    yield "bias_activation", fo.Sequential(fo.Bias(512, **kw), fo.GELU()), (x(256, 512),)
    yield "linear_bias_activation", fo.Sequential(fo.Linear(256, 512, **kw), fo.GELU()), (x(256, 256),)
    yield "activation_dropout", fo.Sequential(fo.GELU(), fo.Dropout(0.1)).train(), (x(256, 512),)
    yield "residual_norm", fo.Sequential(fo.AddExtraInput(), fo.RMSNorm(512, **kw)), (x(256, 512), x(256, 512))
    yield "linear_add", fo.Sequential(fo.Linear(256, 256, bias=False, **kw), fo.AddExtraInput()), (x(256, 256),
                                                                                                 x(256, 256))
    yield "layernorm", fo.Sequential(fo.LayerNorm(512, **kw)), (x(256, 512),)
    yield "swiglu", fo.Sequential(fo.SwiGLU()), (x(256, 512),)
    yield "grouped_mlp", fo.Sequential(fo.GroupedLinear(4, 64, 256, bias=False, **kw), fo.SwiGLU(),
                                       fo.GroupedLinear(4, 128, 64, bias=False, **kw)), (x(16, 64), splits, splits)
    # FC2's split sizes in a tensor of their own: one more launch (the kernel asserting they equal FC1's)
    yield "grouped_mlp_fc2_splits", fo.Sequential(fo.GroupedLinear(4, 64, 256, bias=False, **kw), fo.SwiGLU(),
                                                  fo.GroupedLinear(4, 128, 64, bias=False, **kw)), (x(16, 64), splits,
                                                                                                   splits.clone())


# (forward, backward) kernel launches, as documented in docs/kernels.md's launch-count table.
EXPECTED = {
    "bias_activation": (1, 2),
    "linear_bias_activation": (2, 4),
    "activation_dropout": (2, 1),
    "residual_norm": (1, 3),
    "linear_add": (2, 3),
    "layernorm": (1, 2),
    "swiglu": (1, 1),
    "grouped_mlp": (3, 4),
    "grouped_mlp_fc2_splits": (4, 4),
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_launches_per_forward_and_backward(name):
    _, seq, args = next(c for c in _cases() if c[0] == name)
    for _ in range(2):  # warm-up: autotuning, compilation, plan
        seq(*args).backward(torch.ones(seq(*args).shape, device=DEV, dtype=DT))
    for a in args:
        a.grad = None
    for p in seq.parameters():
        p.grad = None
    dy = torch.ones(seq(*args).shape, device=DEV, dtype=DT)
    out = []
    n_fwd = _count(lambda: out.append(seq(*args)))
    n_bwd = _count(lambda: out[0].backward(dy))
    print(f"launches {name}: forward {n_fwd}, backward {n_bwd}")
    assert (n_fwd, n_bwd) == EXPECTED[name], f"{name}: measured (forward, backward) = {(n_fwd, n_bwd)}"

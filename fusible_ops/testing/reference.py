"""``assert_matches_reference``: a fused Sequential against the same ops run unfused, one by
one, under plain autograd in float64."""

from __future__ import annotations

import copy
from typing import Optional

import torch

from .tolerances import TOLERANCES

__all__ = ["assert_matches_reference", "assert_close_scaled", "run_unfused"]


def assert_close_scaled(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    """``|a - e| <= rtol |e| + atol * max(1, max|e|)`` elementwise with (rtol, atol) from the
    tolerance table for ``dtype``: error is judged against the tensor's own scale, which is how
    rounding of a ``dtype`` computation (GEMMs, reductions) behaves. NaN never passes."""
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    if a.shape != e.shape:
        raise AssertionError(f"{what}: shape {list(a.shape)} != reference {list(e.shape)}")
    if not torch.isfinite(a).all():
        raise AssertionError(f"{what}: non-finite values in result")
    if a.numel() == 0:
        return
    rtol, atol = TOLERANCES[dtype]
    scale = max(1.0, e.abs().max().item())
    err = (a - e).abs()
    bound = rtol * e.abs() + atol * scale
    bad = err > bound
    if bad.any():
        i = int(bad.flatten().nonzero()[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())}/{a.numel()} elements off (dtype {dtype}, rtol {rtol}, atol {atol}, "
            f"scale {scale:.3g}); worst |err| {err.max().item():.3e}; first at flat index {i}: "
            f"{a.flatten()[i].item():.6g} vs reference {e.flatten()[i].item():.6g}"
        )


def _coarser(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """The less precise of two dtypes: a float32 parameter's gradient computed from bf16
    activations carries bf16 rounding, so it is judged with bf16's tolerance."""
    return a if TOLERANCES[a][0] >= TOLERANCES[b][0] else b


def _to64(t):
    if isinstance(t, torch.Tensor) and t.is_floating_point():
        return t.detach().to(torch.float64).requires_grad_(t.requires_grad)
    return t


def _fresh(t):
    if isinstance(t, torch.Tensor) and t.is_floating_point():
        return t.detach().clone().requires_grad_(t.requires_grad)
    return t


def run_unfused(seq, *inputs):
    """Run ``seq``'s modules one by one; every basic op is its own one-op fuser with no rules."""
    from ..fuser import OperationFuser
    from ..op import FusibleOperation
    from ..rules import RuleSet

    empty = RuleSet()
    x, extras = inputs[0], list(inputs[1:])
    extra_outputs = []
    for module in seq:
        ops = list(module.basic_ops) if isinstance(module, FusibleOperation) else None
        if ops is None:
            x = module(x)
            continue
        for op in ops:
            n = op.num_extra_inputs
            mine, extras = extras[:n], extras[n:]
            out = OperationFuser([op], rules=empty)(x, *mine)
            if op.num_extra_outputs:
                x, *ex = out
                extra_outputs.extend(ex)
            else:
                x = out
    return (x, *extra_outputs) if extra_outputs else x


def _grads_of(module) -> dict:
    out = {}
    for name, p in module.named_parameters():
        g = getattr(p, "main_grad", None) if getattr(p, "main_grad", None) is not None else p.grad
        out[name] = g
    return out


def assert_matches_reference(seq, *inputs, seed: int = 1234, grad_seed: Optional[int] = 4321) -> None:
    """Run ``seq(*inputs)`` fused and compare it against the same ops run unfused, one by one,
    under plain autograd, on float64 copies of the parameters and inputs.

    Compares the output(s) and the gradients of every floating-point input that requires grad
    and of every parameter (``main_grad`` where the op accumulates into it) with the tolerance
    table for the fused run's dtype. Random ops (dropout) draw the same seeds in both runs.
    ``inputs`` are not modified; ``seq``'s gradients are accumulated as by a normal backward.
    """
    ref = copy.deepcopy(seq).to(torch.float64)
    for p in ref.parameters():
        p.grad = None
    run_in = [_fresh(t) for t in inputs]
    ref_in = [_to64(t) for t in inputs]
    for p_ref, p in zip(ref.parameters(), seq.parameters()):
        if getattr(p, "main_grad", None) is not None:
            p_ref.main_grad = torch.zeros_like(p_ref)
    grads_before = {k: (None if g is None else g.detach().clone()) for k, g in _grads_of(seq).items()}

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        out = seq(*run_in)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        ref_out = run_unfused(ref, *ref_in)
    outs = list(out) if isinstance(out, tuple) else [out]
    ref_outs = list(ref_out) if isinstance(ref_out, tuple) else [ref_out]
    if len(outs) != len(ref_outs):
        raise AssertionError(f"{len(outs)} outputs, reference has {len(ref_outs)}")
    dtype = outs[0].dtype
    for i, (o, r) in enumerate(zip(outs, ref_outs)):
        assert_close_scaled(o, r, dtype, f"output {i}")

    diff = [(o, r) for o, r in zip(outs, ref_outs) if o.requires_grad]
    if not diff:
        return
    gen = torch.Generator().manual_seed(grad_seed if grad_seed is not None else 0)
    grads_out = [torch.randn(o.shape, generator=gen, dtype=torch.float64) for o, _ in diff]
    torch.autograd.backward([o for o, _ in diff], [g.to(o.device, o.dtype) for (o, _), g in zip(diff, grads_out)])
    torch.autograd.backward([r for _, r in diff], [g.to(r.device) for g in grads_out])
    # flush delayed weight gradients (no-op when none are pending)
    for m in (seq, ref):
        for mod in m.modules():
            if hasattr(mod, "backward_dw") and not isinstance(mod, type(seq)):
                mod.backward_dw()

    for i, (a, b) in enumerate(zip(run_in, ref_in)):
        if isinstance(a, torch.Tensor) and a.is_floating_point() and a.requires_grad:
            if a.grad is None or b.grad is None:
                raise AssertionError(f"input {i}: gradient missing (fused {a.grad is not None}, ref {b.grad is not None})")
            assert_close_scaled(a.grad, b.grad, dtype, f"grad of input {i}")
    ref_grads = _grads_of(ref)
    for name, g in _grads_of(seq).items():
        p = dict(seq.named_parameters())[name]
        rg = ref_grads[name]
        if not p.requires_grad:
            if g is not None and grads_before[name] is None:
                raise AssertionError(f"parameter {name}: frozen but got a gradient")
            continue
        if g is None or rg is None:
            raise AssertionError(f"parameter {name}: gradient missing (fused {g is not None}, ref {rg is not None})")
        before = grads_before[name]
        got = g - before if before is not None else g
        assert_close_scaled(got, rg, _coarser(p.dtype, dtype), f"grad of parameter {name}")

"""The whole MoE layer (issue 13): ``Router -> Dispatch -> GroupedLinear -> SwiGLU -> GroupedLinear ->
Combine`` as one ``fo.Sequential`` (bf16, and under FP8 current scaling) against the plain-PyTorch
composition (router GEMM, softmax, top-k, sort by expert, ``index_select``, ``torch._grouped_mm``, SwiGLU, ``torch._grouped_mm``,
probability-weighted ``index_add_``), eager and under ``torch.compile``, all in one run; ours also
with fusion disabled and graph-replayed. bf16 weights and activations, top-k probabilities
renormalised, load-balancing loss in both.

Reports forward and backward separately (median ms of CUDA events after warm-up; backward =
forward+backward minus forward), TFLOP/s (forward 6*T*k*hidden*ffn, backward twice that), and
activation memory: what the forward keeps for backward (allocated after the forward minus
before) and the forward's peak above the inputs.

Run on the GPU: ``PYTHONPATH=. python scripts/moe_layer_bench.py [--quick]``.
"""
import argparse
import contextlib
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from _timing import ms  # noqa: E402

import fusible_ops as fo  # noqa: E402

BF = dict(device="cuda", dtype=torch.bfloat16)
# (tokens, hidden, ffn, experts, top_k): the shapes
SHAPES = [(24576, 1536, 256, 128, 8), (32768, 2048, 768, 128, 8), (16384, 4096, 14336, 8, 2)]


def ours(H, Fd, E, k, ep_group=None, local=None):
    """The layer as one ``fo.Sequential``; expert parallel with ``ep_group`` (``local`` = E / ep
    experts per rank)."""
    g = E if local is None else local
    seq = fo.Sequential(fo.Router(H, E, top_k=k, score="softmax", normalize=True, **BF), fo.Dispatch(ep_group=ep_group),
                        fo.GroupedLinear(g, H, 2 * Fd, bias=False, **BF), fo.SwiGLU(),
                        fo.GroupedLinear(g, Fd, H, bias=False, **BF), fo.Combine())
    with torch.no_grad():
        seq[2].weight.normal_(0, H ** -0.5)
        seq[4].weight.normal_(0, Fd ** -0.5)
    return seq


class Composition(torch.nn.Module):
    """The plain-PyTorch MoE layer, reading the same weights as ``ours``."""

    def __init__(self, seq, k):
        super().__init__()
        self.wr = torch.nn.Parameter(seq[0].weight.detach().clone())
        self.w1 = torch.nn.Parameter(seq[2].weight.detach().clone())
        self.w2 = torch.nn.Parameter(seq[4].weight.detach().clone())
        self.k = k

    def forward(self, x):
        E, k = self.w1.shape[0], self.k
        logits = (x @ self.wr.t()).float()
        probs = logits.softmax(-1)
        p, eid = probs.topk(k, dim=-1)
        p = p / p.sum(-1, keepdim=True)
        flat = eid.flatten()
        order = flat.argsort(stable=True)
        counts = torch.zeros(E, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
        offs = counts.cumsum(0).to(torch.int32)
        tok = order // k
        h = torch._grouped_mm(x.index_select(0, tok), self.w1.transpose(-2, -1), offs=offs)
        a, b = h.chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(a) * b, self.w2.transpose(-2, -1), offs=offs)
        y = y * p.flatten().index_select(0, order)[:, None].to(y.dtype)
        out = torch.zeros_like(x).index_add_(0, tok, y)
        aux = E * (counts.float() / flat.numel() * probs.mean(0)).sum() * 1e-2
        return out, aux


def memory(fn, x):
    """(MiB kept for backward, MiB peak above the start) of one forward."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn(x)
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - base
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return kept / 2 ** 20, peak / 2 ** 20


@contextlib.contextmanager
def _both(a, b):
    with a, b:
        yield


def times(fn, x, dy):
    def fwd():
        fn(x)

    def step():
        y, aux = fn(x)
        torch.autograd.backward((y, aux), (dy, torch.ones_like(aux)))
    f = ms(fwd, n=10)
    return f, ms(step, n=10) - f


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="first shape only")
    a = p.parse_args()
    torch.manual_seed(0)
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16")
    print("\n| shape (T, H, F, E, k) | variant | fwd ms | bwd ms | fwd TFLOP/s | bwd TFLOP/s | fwd+bwd TFLOP/s "
          "| kept MiB | fwd peak MiB |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for T, H, Fd, E, k in SHAPES[:1] if a.quick else SHAPES:
        fl = 6 * T * k * H * Fd
        x = torch.randn(T, H, **BF, requires_grad=True)
        dy = torch.randn(T, H, **BF)
        seq = ours(H, Fd, E, k)
        comp = Composition(seq, k)
        variants = [("ours", seq, contextlib.nullcontext),
                    ("ours, moe_dispatch_mlp off", seq, lambda: fo.fusion_rules.disabled("moe_dispatch_mlp")),
                    ("ours, fusion disabled", seq, lambda: fo.fusion_rules.disabled(*fo.RuleSet.builtin().names())),
                    ("ours, FP8 current scaling", seq, lambda: fo.autocast(recipe=fo.Float8CurrentScaling())),
                    ("ours, FP8, moe_dispatch_mlp off", seq, lambda: _both(
                        fo.autocast(recipe=fo.Float8CurrentScaling()), fo.fusion_rules.disabled("moe_dispatch_mlp"))),
                    ("composition eager", comp, contextlib.nullcontext),
                    ("composition compiled", torch.compile(comp), contextlib.nullcontext)]
        rows = []
        for name, fn, ctx in variants:
            try:
                with ctx():
                    f, b = times(fn, x, dy)
                    kept, peak = memory(fn, x)
                rows.append((name, f, b, kept, peak))
            except Exception as e:  # report, do not hide
                print(f"<!-- {name}: {type(e).__name__}: {str(e)[:300]} -->")
        for name, mk in (("ours graphed", lambda: fo.make_graphed_callables(ours(H, Fd, E, k), (x,))),
                         ("composition graphed", lambda: torch.cuda.make_graphed_callables(Composition(seq, k),
                                                                                           (x,)))):
            try:
                g = mk()
                f, b = times(g, x, dy)
                rows.append((name, f, b, float("nan"), float("nan")))
            except Exception as e:
                print(f"<!-- {name}: {type(e).__name__}: {str(e)[:300]} -->")
        for name, f, b, kept, peak in rows:
            print(f"| {T}, {H}, {Fd}, {E}, {k} | {name} | {f:.3f} | {b:.3f} | {fl / f / 1e9:.0f} | "
                  f"{2 * fl / b / 1e9:.0f} | {3 * fl / (f + b) / 1e9:.0f} | {kept:.0f} | {peak:.0f} |", flush=True)
        del seq, comp, x, dy
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

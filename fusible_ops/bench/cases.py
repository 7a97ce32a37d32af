"""The benchmark cases: each builds a fused ``fusible_ops.Sequential`` and the same ops as plain
PyTorch (eager, and ``torch.compile`` of that eager code, ``dynamic=False``), sharing parameters.

A case's ``build(ctx)`` yields one :class:`Bench` per configuration (the grouped MLPs yield one
per routing), one at a time, so only one configuration's tensors are alive.

Work counted per call (forward + backward):

* elementwise / norm cases: minimal bytes, each input of a pass read once and each output
  written once (forward: inputs + outputs; backward: dy + the forward inputs it needs + the
  gradients), parameters included (read in forward, read in backward, gradient written);
* GEMM cases: GEMM flops only, forward 2*M*N*K per GEMM, backward 2x forward (dgrad + wgrad).
"""

from __future__ import annotations

import copy
import dataclasses
import time
import warnings
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn.functional as F

import fusible_ops as fo
from fusible_ops.testing.fp8 import SQNR_DB

from .common import log

SKEW_FACTOR = 8  # skewed routing: the heavy expert gets SKEW_FACTOR x the mean
ALIGN_ROWS = 16  # skewed routing: group sizes are multiples of this where possible
INIT_STD = 0.02
DROPOUT_P = 0.1
EPS = 1e-5


@dataclasses.dataclass
class BenchContext:
    device: torch.device
    dtype: torch.dtype = torch.bfloat16
    quick: bool = False
    compile: bool = True

    def size(self, n: int, quick_div: int) -> int:
        """``n``, or with ``quick`` ``n // quick_div`` rounded up to a multiple of 16."""
        if not self.quick:
            return n
        m = max(1, n // quick_div)
        return max(16, -(-m // 16) * 16)

    def randn(self, *shape, scale: float = 1.0, requires_grad: bool = False) -> torch.Tensor:
        t = torch.randn(*shape, device=self.device, dtype=self.dtype)
        if scale != 1.0:
            t.mul_(scale)
        return t.requires_grad_(requires_grad)

    def compiled(self, fn: Callable) -> Callable:
        return torch.compile(fn, dynamic=False)


@dataclasses.dataclass
class Bench:
    """One configuration of a case.

    ``new_copy()`` returns ``(inputs, dy)``: a fresh copy of the rotated inputs (every variant
    is called as ``fn(*inputs)``) and of the output gradient. ``variants`` maps a name to that
    ``fn``; ``"fused"`` is the Sequential, ``baseline`` names the eager one. ``reference(inputs,
    y)`` (default: the baseline) gives what each variant's output and gradients are checked
    against; ``check_output(inputs, y)`` may return a problem string. ``extra(name, row)``
    returns fields added to a variant's row once it is checked (and timed, where it passed).
    """

    case: str
    config: str
    shape: str
    dtype: torch.dtype
    metric: str  # "bytes" (vs copy bandwidth) or "flops" (vs matmul rate)
    work: float
    new_copy: Callable[[], tuple[tuple, torch.Tensor]]
    params: list
    variants: dict
    fused_module: Any
    plan_args: Callable[[tuple], tuple]
    expected_rules: tuple = ()
    baseline: str = "eager"
    reference: Optional[Callable[[tuple, torch.Tensor], torch.Tensor]] = None
    check_output: Optional[Callable[[tuple, torch.Tensor], Optional[str]]] = None
    notes: dict = dataclasses.field(default_factory=dict)
    tolerances: dict = dataclasses.field(default_factory=dict)  # variant -> rel norm err bound (FP8)
    tokens: Optional[int] = None  # tokens per call: the rows get tokens_per_s
    extra: Optional[Callable[[str, dict], dict]] = None  # (variant, row so far) -> more fields for its row
    copies: Optional[list] = None  # filled by the harness


class Lazy:
    """A variant built only when the harness reaches it, from the first copy of the inputs (a
    CUDA-graphed variant captures there, and its graph and memory pool go when it is done)."""

    def __init__(self, make: Callable[[tuple], Callable], pooled: bool = False) -> None:
        self.make = make
        self.pooled = pooled  # (a graph: its memory was allocated at capture, in the graph's pool)


@dataclasses.dataclass
class Case:
    description: str
    build: Callable[[BenchContext], Iterator[Bench]]


def _init_(*params: torch.Tensor, std: float = INIT_STD, mean: float = 0.0) -> None:
    with torch.no_grad():
        for p in params:
            p.normal_(mean, std)


def _with_compile(ctx: BenchContext, variants: dict, eager: Callable, name: str = "compile") -> dict:
    if ctx.compile:
        variants[name] = ctx.compiled(eager)
    return variants


def liger(ctx: BenchContext, name: str):
    """Liger-Kernel's autograd Function ``name`` (from ``liger_kernel.ops``) for the ``liger`` peer
    variant, or None where it cannot run (not CUDA, liger-kernel not importable: the ``bench``
    extra installs it)."""
    if ctx.device.type != "cuda":
        return None
    try:
        import liger_kernel.ops as L
    except ImportError:
        return None
    except Exception as e:  # (installed, but it does not load with this torch / Triton)
        warnings.warn(f"the Liger-Kernel peer is left out: liger_kernel.ops does not import ({type(e).__name__}: {e})",
                      RuntimeWarning, stacklevel=2)
        return None
    return getattr(L, name, None)


def fp8_variants(ctx: BenchContext, call: Callable) -> dict:
    """``call`` under each FP8 recipe (``fp8_current``, ``fp8_delayed``, ``fp8_block``): on CPU as
    emulation, on CUDA where FP8 matmuls run (compute capability 8.9+)."""
    if ctx.device.type == "cuda" and torch.cuda.get_device_capability(ctx.device) < (8, 9):
        return {}
    out = {}
    for name, recipe in (("fp8_current", fo.Float8CurrentScaling()), ("fp8_delayed", fo.Float8DelayedScaling()),
                         ("fp8_block", fo.Float8BlockScaling())):
        def fn(*inputs, recipe=recipe):
            with fo.autocast(recipe=recipe):
                return call(*inputs)
        out[name] = fn
    return out


FP8_REL_ERR = 10 ** (-SQNR_DB[("grad", "hybrid")] / 20)
"""Bound on an FP8 variant's relative error against the bf16 reference: the SQNR table's gradient
threshold (20 dB), the looser of its output and gradient rows."""


def graphed(ctx: BenchContext, module, args: Callable[[tuple], tuple], recipe=None) -> dict:
    """``{"graphed": ...}`` on CUDA: ``module`` captured by :func:`fusible_ops.make_graphed_callables`
    on clones of the first input copy when the harness reaches it (under ``recipe`` if given);
    calls with other copies copy them into the static inputs first, as torch's graphed callables
    do. ``args(inputs)`` gives the module's arguments. Empty on CPU."""
    if ctx.device.type != "cuda":
        return {}

    def make(inputs):
        static = tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in inputs)
        # a copy that shares the parameters (the case checks their gradients): capture replaces
        # the module's forward, and the case's other variants (a second graphed one too) keep
        # calling the original
        shared = {id(p): p for p in module.parameters()}
        with fo.autocast(recipe=recipe):
            g = fo.make_graphed_callables(copy.deepcopy(module, shared), args(static))

        def call(*inp):
            out = g(*args(inp))
            return out[0] if isinstance(out, tuple) else out
        return call
    return {"graphed" if recipe is None else "graphed_fp8": Lazy(make, pooled=True)}


def unfused(ctx: BenchContext, call: Callable, fp8: bool = False) -> dict:
    """``{"unfused": ..., "no_hints": ...}``: ``call`` with every built-in fusion rule disabled (the
    plan the fuser's fused plans must not lose to), and with the rules' cost hints ignored (the
    fused plan where a hint declines it); with ``fp8``, also ``fp8_unfused`` and ``fp8_no_hints``
    under Float8CurrentScaling where the FP8 variants run."""
    names = fo.RuleSet.builtin().names()

    def plain(*inputs):
        with fo.fusion_rules.disabled(*names):
            return call(*inputs)
    def no_hints(*inputs):
        with fo.fusion_rules.disabled("cost hints"):
            return call(*inputs)
    out = {"unfused": plain, "no_hints": no_hints}
    if fp8 and "fp8_current" in fp8_variants(ctx, call):
        def plain_fp8(*inputs):
            with fo.autocast(recipe=fo.Float8CurrentScaling()), fo.fusion_rules.disabled(*names):
                return call(*inputs)

        def no_hints_fp8(*inputs):
            with fo.autocast(recipe=fo.Float8CurrentScaling()), fo.fusion_rules.disabled("cost hints"):
                return call(*inputs)
        out.update(fp8_unfused=plain_fp8, fp8_no_hints=no_hints_fp8)
    return out


def tuned(ctx: BenchContext, module, args: Callable[[tuple], tuple], out: Callable = lambda y: y) -> dict:
    """``{"tuned": ...}``: a copy of ``module`` sharing its parameters (the case checks their
    gradients), its plans tuned by :func:`fusible_ops.tune` on clones of the first input copy when
    the harness reaches it (no disk cache: every run measures); the tuning pass's wall time is
    logged. ``out(y)``: the variant's result from the module's output."""
    def make(inputs):
        static = tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in inputs)
        shared = {id(p): p for p in module.parameters()}
        twin = copy.deepcopy(module, shared)
        t0 = time.perf_counter()
        lines = fo.tune(twin, *args(static), disk=False)
        log(f"tuning pass: {time.perf_counter() - t0:.2f} s; " + " | ".join(l.strip() for l in lines))

        def call(*inp):
            return out(twin(*args(inp)))
        return call
    return {"tuned": Lazy(make)}


def _shape(*dims) -> str:
    return "[" + ", ".join(str(d) for d in dims) + "]"


# ------------------------------------------------------------------------------ elementwise cases
def bias_gelu(ctx: BenchContext) -> Iterator[Bench]:
    M = N = ctx.size(16384, 64)
    seq = fo.Sequential(fo.Bias(N, device=ctx.device, dtype=ctx.dtype), fo.GELU())
    b = seq[0].bias
    _init_(b)

    def eager(x):
        return F.gelu(x + b)

    def new_copy():
        return (ctx.randn(M, N, requires_grad=True),), ctx.randn(M, N)

    E = torch.tensor([], dtype=ctx.dtype).element_size()
    yield Bench(
        case="bias_gelu", config="", shape=_shape(M, N), dtype=ctx.dtype, metric="bytes",
        work=E * (5 * M * N + 3 * N), new_copy=new_copy, params=[b],
        variants=_with_compile(ctx, {"fused": lambda x: seq(x), "eager": eager}, eager),
        fused_module=seq, plan_args=lambda inp: inp,
        expected_rules=("bias_activation", "activation_bias_backward"),
    )


def swiglu(ctx: BenchContext) -> Iterator[Bench]:
    M = ctx.size(16384, 64)
    Fh = ctx.size(8192, 64)
    seq = fo.Sequential(fo.SwiGLU())

    def eager(x):
        a, b = x.chunk(2, dim=-1)
        return F.silu(a) * b

    def new_copy():
        return (ctx.randn(M, 2 * Fh, requires_grad=True),), ctx.randn(M, Fh)

    E = torch.tensor([], dtype=ctx.dtype).element_size()
    variants = _with_compile(ctx, {"fused": lambda x: seq(x), "eager": eager}, eager)
    lf = liger(ctx, "LigerFusedGateUpSiLUMulFunction")  # (gate and up in one tensor, as ours reads them)
    if lf is not None:
        variants["liger"] = lf.apply
    yield Bench(
        case="swiglu", config="", shape=_shape(M, 2 * Fh), dtype=ctx.dtype, metric="bytes",
        work=E * 8 * M * Fh, new_copy=new_copy, params=[],
        variants=variants,
        fused_module=seq, plan_args=lambda inp: inp, expected_rules=(),
        notes={"fused": "single op (no rule): its Triton fwd/bwd kernels"},
    )


def residual_rmsnorm(ctx: BenchContext) -> Iterator[Bench]:
    M = N = ctx.size(16384, 64)
    seq = fo.Sequential(fo.AddExtraInput(), fo.RMSNorm(N, eps=EPS, device=ctx.device, dtype=ctx.dtype))
    w = seq[1].weight
    _init_(w, std=0.1, mean=1.0)

    def eager(x, r):
        h = x + r
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * w

    def new_copy():
        return (ctx.randn(M, N, requires_grad=True), ctx.randn(M, N, requires_grad=True)), ctx.randn(M, N)

    E = torch.tensor([], dtype=ctx.dtype).element_size()
    variants = _with_compile(ctx, {"fused": lambda x, r: seq(x, r), "eager": eager}, eager)
    lf = liger(ctx, "LigerFusedAddRMSNormFunction")
    if lf is not None:  # (Llama casting; in_place=False: the harness reuses its output gradient)
        variants["liger"] = lambda x, r: lf.apply(x, r, w, EPS, 0.0, "llama", False)[0]
    yield Bench(
        case="residual_rmsnorm", config="", shape=_shape(M, N), dtype=ctx.dtype, metric="bytes",
        work=E * (7 * M * N + 3 * N), new_copy=new_copy, params=[w],
        variants=variants,
        fused_module=seq, plan_args=lambda inp: inp,
        expected_rules=("residual_norm", "residual_norm_backward"),
    )


def gelu_dropout(ctx: BenchContext) -> Iterator[Bench]:
    M = N = ctx.size(16384, 64)
    p = DROPOUT_P
    seq = fo.Sequential(fo.GELU(), fo.Dropout(p))
    seq.train()

    def eager(x):
        return F.dropout(F.gelu(x), p, training=True)

    def new_copy():
        return (ctx.randn(M, N, requires_grad=True),), ctx.randn(M, N)

    # Masks differ between implementations: each variant is checked against GELU with ITS OWN
    # keep mask (read off its output), so values and the forward/backward mask agreement are
    # checked exactly; the drop rate is checked statistically.
    def reference(inputs, y):
        (x,) = inputs
        keep = (y.detach() != 0).to(x.dtype)
        return F.gelu(x) * keep * (1.0 / (1.0 - p))

    def check_output(inputs, y):
        frac = (y.detach() == 0).float().mean().item()
        tol = max(0.01, 5 * (p * (1 - p) / y.numel()) ** 0.5)
        if abs(frac - p) > tol:
            return f"dropped fraction {frac:.4f}, expected {p} +- {tol:.4f}"
        return None

    E = torch.tensor([], dtype=ctx.dtype).element_size()
    yield Bench(
        case="gelu_dropout", config="", shape=_shape(M, N), dtype=ctx.dtype, metric="bytes",
        work=E * 5 * M * N, new_copy=new_copy, params=[],
        variants=_with_compile(ctx, {"fused": lambda x: seq(x), "eager": eager}, eager),
        fused_module=seq, plan_args=lambda inp: inp,
        expected_rules=("activation_dropout", "activation_dropout_backward"),
        reference=reference, check_output=check_output,
        notes={"fused": "Philox mask regenerated in backward (no mask bytes)",
               "eager": "F.dropout stores a mask (bytes not counted)"},
    )


def layernorm(ctx: BenchContext) -> Iterator[Bench]:
    M = N = ctx.size(16384, 64)
    seq = fo.Sequential(fo.LayerNorm(N, eps=EPS, device=ctx.device, dtype=ctx.dtype))
    w, b = seq[0].weight, seq[0].bias
    _init_(w, std=0.1, mean=1.0)
    _init_(b)

    def eager(x):
        return F.layer_norm(x, (N,), w, b, EPS)

    def new_copy():
        return (ctx.randn(M, N, requires_grad=True),), ctx.randn(M, N)

    E = torch.tensor([], dtype=ctx.dtype).element_size()
    yield Bench(
        case="layernorm", config="", shape=_shape(M, N), dtype=ctx.dtype, metric="bytes",
        work=E * (5 * M * N + 5 * N), new_copy=new_copy, params=[w, b],
        variants=_with_compile(ctx, {"fused": lambda x: seq(x), "eager": eager}, eager),
        fused_module=seq, plan_args=lambda inp: inp, expected_rules=(),
        notes={"fused": "single op (no rule): its Triton fwd/bwd kernels"},
    )


NORM_HIDDEN_SIZES = (1024, 2048, 4096, 8192, 16384)


def norm_sizes(ctx: BenchContext) -> Iterator[Bench]:
    """LayerNorm and RMSNorm fwd+bwd over 16384 tokens at each hidden size of NORM_HIDDEN_SIZES
    (configs ``layernorm_N`` / ``rmsnorm_N``); eager is torch's F.layer_norm / F.rms_norm."""
    M = ctx.size(16384, 64)
    E = torch.tensor([], dtype=ctx.dtype).element_size()
    for kind in ("layernorm", "rmsnorm"):
        for n in NORM_HIDDEN_SIZES:
            N = ctx.size(n, 64)
            if kind == "layernorm":
                op = fo.LayerNorm(N, eps=EPS, device=ctx.device, dtype=ctx.dtype)
                w, b = op.weight, op.bias
                _init_(b)

                def eager(x, N=N, w=w, b=b):
                    return F.layer_norm(x, (N,), w, b, EPS)
                params, n_params = [w, b], 2
            else:
                op = fo.RMSNorm(N, eps=EPS, device=ctx.device, dtype=ctx.dtype)
                w = op.weight

                def eager(x, N=N, w=w):
                    return F.rms_norm(x, (N,), w, EPS)
                params, n_params = [w], 1
                lf = liger(ctx, "LigerRMSNormFunction")
            _init_(w, std=0.1, mean=1.0)
            seq = fo.Sequential(op)

            def new_copy(N=N):
                return (ctx.randn(M, N, requires_grad=True),), ctx.randn(M, N)

            variants = _with_compile(ctx, {"fused": lambda x, seq=seq: seq(x), "eager": eager}, eager)
            if kind == "rmsnorm" and lf is not None:  # (in_place=False: the harness reuses its output gradient)
                variants["liger"] = lambda x, w=w, lf=lf: lf.apply(x, w, EPS, 0.0, "llama", False)
            yield Bench(
                case="norm_sizes", config=f"{kind}_{n}", shape=_shape(M, N), dtype=ctx.dtype, metric="bytes",
                work=E * (5 * M * N + 3 * n_params * N), new_copy=new_copy, params=params,
                variants=variants,
                fused_module=seq, plan_args=lambda inp: inp, expected_rules=(),
                notes={"fused": "single op (no rule): its Triton fwd/bwd kernels"},
            )
            del op, seq, params


# ------------------------------------------------------------------------------------ MLP blocks
def _mlp(ctx: BenchContext, gated: bool) -> Iterator[Bench]:
    T = ctx.size(16384, 32)
    H = ctx.size(4096, 32)
    Fd = ctx.size(16384, 32)
    fc1_out = 2 * Fd if gated else Fd
    kw = dict(device=ctx.device, dtype=ctx.dtype)
    norm = fo.RMSNorm(H, eps=EPS, **kw)
    fc1 = fo.Linear(H, fc1_out, **kw)
    act = fo.SwiGLU() if gated else fo.GELU()
    fc2 = fo.Linear(Fd, H, **kw)
    seq = fo.Sequential(norm, fc1, act, fc2, fo.AddExtraInput())
    _init_(norm.weight, std=0.1, mean=1.0)
    _init_(fc1.weight, fc1.bias, fc2.weight, fc2.bias)
    wn, w1, b1, w2, b2 = norm.weight, fc1.weight, fc1.bias, fc2.weight, fc2.bias

    def eager(x):
        h = F.rms_norm(x, (H,), wn, EPS)
        h = F.linear(h, w1, b1)
        if gated:
            a, g = h.chunk(2, dim=-1)
            h = F.silu(a) * g
        else:
            h = F.gelu(h)
        return F.linear(h, w2, b2) + x

    def new_copy():
        return (ctx.randn(T, H, requires_grad=True),), ctx.randn(T, H)

    fwd_flops = 2 * T * H * fc1_out + 2 * T * Fd * H
    yield Bench(
        case="mlp_block_swiglu" if gated else "mlp_block", config="", shape=f"T={T} H={H} F={Fd}",
        dtype=ctx.dtype, metric="flops", work=3 * fwd_flops, new_copy=new_copy,
        params=[wn, w1, b1, w2, b2],
        variants=_with_compile(ctx, {"fused": lambda x: seq(x, x), "eager": eager, **fp8_variants(ctx, lambda x: seq(x, x)),
                                     **tuned(ctx, seq, lambda inp: (inp[0], inp[0])),
                                     **unfused(ctx, lambda x: seq(x, x))}, eager),
        fused_module=seq, plan_args=lambda inp: (inp[0], inp[0]),
        expected_rules=("linear_bias_activation", "activation_bias_backward"),
        tolerances=dict.fromkeys(("fp8_current", "fp8_delayed", "fp8_block"), FP8_REL_ERR),
    )


def mlp_block(ctx: BenchContext) -> Iterator[Bench]:
    yield from _mlp(ctx, gated=False)


def mlp_block_swiglu(ctx: BenchContext) -> Iterator[Bench]:
    yield from _mlp(ctx, gated=True)


# ---------------------------------------------------------------------------------- grouped MLPs
def routing_splits(E: int, T: int, routing: str) -> list[int]:
    """Tokens per expert (sum T). ``uniform``: T/E each (remainder to the first experts).
    ``skewed``: one expert gets SKEW_FACTOR x the mean (capped at T), E//8 (>= 1) experts are
    empty, the rest share what is left unevenly (weights 1..k), in multiples of ALIGN_ROWS where
    possible; the heavy and empty experts are spread over the expert index range."""
    if routing == "uniform":
        base, rem = divmod(T, E)
        return [base + (1 if g < rem else 0) for g in range(E)]
    if routing != "skewed":
        raise ValueError(f"unknown routing {routing!r}")
    mean = T / E
    heavy = min(T, int(round(SKEW_FACTOR * mean)))
    n_empty = max(1, E // 8)
    rest = T - heavy
    others = E - 1 - n_empty
    sizes_others = [0] * max(others, 0)
    if rest > 0:
        if others <= 0:
            heavy, rest = T, 0
        else:
            align = ALIGN_ROWS if rest >= ALIGN_ROWS * others else 1
            units = rest // align
            wts = list(range(1, others + 1))
            tot = sum(wts)
            raw = [units * w / tot for w in wts]
            alloc = [int(r) for r in raw]
            order = sorted(range(others), key=lambda k: raw[k] - alloc[k], reverse=True)
            for k in order[: units - sum(alloc)]:
                alloc[k] += 1
            sizes_others = [a * align for a in alloc]
            sizes_others[-1] += rest - sum(sizes_others)
    # lay out: heavy at E//2, empties every E//n_empty starting at 1, others in between
    sizes = [None] * E
    sizes[E // 2] = heavy
    empties = 0
    for g in range(1, E, max(1, E // n_empty)):
        if empties < n_empty and sizes[g] is None:
            sizes[g] = 0
            empties += 1
    g = 0
    while empties < n_empty:  # not enough slots found above
        if sizes[g] is None:
            sizes[g] = 0
            empties += 1
        g += 1
    it = iter(sizes_others)
    sizes = [s if s is not None else next(it, 0) for s in sizes]
    assert sum(sizes) == T and len(sizes) == E, (sizes, T)
    return sizes


def _grouped(ctx: BenchContext, name: str, E: int, T: int, H: int, Fd: int) -> Iterator[Bench]:
    T = ctx.size(T, 32)
    H = ctx.size(H, 32)
    Fd = ctx.size(Fd, 32)
    kw = dict(device=ctx.device, dtype=ctx.dtype)
    for routing in ("uniform", "skewed"):
        sizes = routing_splits(E, T, routing)
        fc1 = fo.GroupedLinear(E, H, 2 * Fd, bias=False, **kw)
        fc2 = fo.GroupedLinear(E, Fd, H, bias=False, **kw)
        _init_(fc1.weight, fc2.weight)
        seq = fo.Sequential(fc1, fo.SwiGLU(), fc2)
        w1, w2 = fc1.weight, fc2.weight
        splits = torch.tensor(sizes, dtype=torch.int64, device=ctx.device)
        offs = torch.cumsum(splits, 0).to(torch.int32)

        def loop(x, sizes=sizes, w1=w1, w2=w2):
            outs = []
            for g, xg in enumerate(torch.split(x, sizes)):
                if sizes[g] == 0:
                    continue
                h = F.linear(xg, w1[g])
                a, b = h.chunk(2, dim=-1)
                outs.append(F.linear(F.silu(a) * b, w2[g]))
            return torch.cat(outs)

        def grouped_mm(x, offs=offs, w1=w1, w2=w2):
            h = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)
            a, b = h.chunk(2, dim=-1)
            return torch._grouped_mm(F.silu(a) * b, w2.transpose(-2, -1), offs=offs)

        def new_copy():
            return (ctx.randn(T, H, requires_grad=True),), ctx.randn(T, H)

        def fused(x, seq=seq, splits=splits):
            return seq(x, splits, splits)

        def mlp_args(inp, splits=splits):
            return (inp[0], splits, splits)

        variants = {"fused": fused, **fp8_variants(ctx, fused), "eager_loop": loop, "grouped_mm": grouped_mm}
        _with_compile(ctx, variants, loop, "compile_loop")
        variants.update(graphed(ctx, seq, mlp_args))
        variants.update(graphed(ctx, seq, mlp_args, recipe=fo.Float8CurrentScaling()) if "fp8_current" in variants else {})
        variants.update(tuned(ctx, seq, mlp_args))
        variants.update(unfused(ctx, fused, fp8=True))
        fwd_flops = 2 * T * H * 2 * Fd + 2 * T * Fd * H
        bench = Bench(
            case=name, config=routing, shape=f"E={E} T={T} H={H} F={Fd}", dtype=ctx.dtype, metric="flops",
            work=3 * fwd_flops, new_copy=new_copy, params=[w1, w2], variants=variants, fused_module=seq,
            plan_args=mlp_args, expected_rules=(),
            baseline="eager_loop", tolerances=dict.fromkeys(("fp8_current", "fp8_delayed", "fp8_block", "graphed_fp8",
                                                            "fp8_unfused", "fp8_no_hints"),
                                                            FP8_REL_ERR),
            notes={"eager_loop": "per-expert F.linear loop; split sizes known on the host (no sync timed)",
                   "compile_loop": "torch.compile(dynamic=False) of the loop, split sizes baked in"},
        )
        del fc1, fc2, seq, w1, w2, splits, offs, variants, loop, grouped_mm, new_copy, fused, mlp_args
        yield bench
        del bench


def grouped_mlp_8e(ctx: BenchContext) -> Iterator[Bench]:
    yield from _grouped(ctx, "grouped_mlp_8e", E=8, T=16384, H=4096, Fd=7168)


def grouped_mlp_64e(ctx: BenchContext) -> Iterator[Bench]:
    yield from _grouped(ctx, "grouped_mlp_64e", E=64, T=16384, H=2048, Fd=1408)


CASES: dict[str, Case] = {
    "bias_gelu": Case("Bias(16384) + GELU fwd+bwd at [16384, 16384]; eager F.gelu(x + b)", bias_gelu),
    "swiglu": Case("SwiGLU fwd+bwd at [16384, 2*8192]; eager F.silu(a) * b", swiglu),
    "residual_rmsnorm": Case("AddExtraInput + RMSNorm(16384) fwd+bwd at [16384, 16384], seq(x, residual)",
                             residual_rmsnorm),
    "gelu_dropout": Case("GELU + Dropout(0.1) fwd+bwd at [16384, 16384]", gelu_dropout),
    "layernorm": Case("LayerNorm(16384) fwd+bwd at [16384, 16384]", layernorm),
    "norm_sizes": Case("LayerNorm and RMSNorm fwd+bwd, 16384 tokens, hidden 1024..16384 (configs "
                       "layernorm_N, rmsnorm_N)", norm_sizes),
    "mlp_block": Case("RMSNorm, Linear(4096,16384), GELU, Linear(16384,4096), residual; 16384 tokens", mlp_block),
    "mlp_block_swiglu": Case("RMSNorm, Linear(4096,2*16384), SwiGLU, Linear(16384,4096), residual; 16384 tokens",
                             mlp_block_swiglu),
    "grouped_mlp_8e": Case("GroupedLinear(8,4096,2*7168), SwiGLU, GroupedLinear(8,7168,4096); 16384 tokens; "
                           "configs uniform, skewed", grouped_mlp_8e),
    "grouped_mlp_64e": Case("GroupedLinear(64,2048,2*1408), SwiGLU, GroupedLinear(64,1408,2048); 16384 tokens; "
                            "configs uniform, skewed", grouped_mlp_64e),
}

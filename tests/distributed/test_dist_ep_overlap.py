"""The overlapped expert-parallel MoE layer (rule ``moe_ep_overlap``: the local experts in
``Dispatch.ep_chunks`` chunks, each chunk's all-to-all overlapping another chunk's expert GEMMs)
against ONE process running the whole layer on every rank's tokens at once.

Each chunk's GEMMs see the rows of its experts in the order the single process's GEMMs see
them (whose plan runs the same unfused ops: the single process's fused grouped MLP would be a
different kernel, not a different layer), but a chunk's GEMM has fewer rows than the single
process's, and a BLAS may pick another kernel (another summation order) for another size: on
CPU (gloo, float64) as on GPUs (NCCL, float32) outputs, input gradients and the local experts'
weight and bias gradients are judged by the tolerance table of their dtype. Bit equality is
asserted only where the same ops run on the same shapes (the gradient contract: the unfused
exchange against the overlapped one, expert by expert). Also: the gradient contract through the fused op (main_grad, delayed, frozen), FP8
(declined: the unfused exchange runs) and bad settings.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_launch import BACKENDS, WORLDS, run_ranks
from test_dist_expert_parallel import H, _dtype, _full_and_ep

import fusible_ops as fo
from fusible_ops.ops.moe import record_routing
from fusible_ops.testing import SQNR_DB, assert_close_scaled, assert_sqnr, sqnr

SINGLE_PROCESS_RULES = ("grouped_mlp", "moe_dispatch_mlp")
"""Disabled in the single process: its plan then runs the unfused ops, as the EP ranks do."""


def _rules(seq, x) -> list:
    return [g["rule"] for g in seq.fusion_plan("forward", x)]


def _data(world, leads, seed, **factory):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(*lead, H, generator=g).to(**factory), torch.randn(*lead, H, generator=g).to(**factory))
            for lead in leads]


def _single_process(full, data):
    """The full layer on all ranks' tokens at once: (output rows, input-gradient rows), per rank."""
    xs = [x.reshape(-1, H) for x, _ in data]
    xa = torch.cat(xs).requires_grad_()
    with fo.fusion_rules.disabled(*SINGLE_PROCESS_RULES):
        y, _ = full(xa)
        (y * torch.cat([dy.reshape(-1, H) for _, dy in data])).sum().backward()
    ends = torch.tensor([0] + [x.shape[0] for x in xs]).cumsum(0).tolist()
    return [(y[a:b], xa.grad[a:b]) for a, b in zip(ends, ends[1:])]


def _same(actual, expected, exact: bool, dtype, what: str) -> None:
    if exact:
        assert torch.equal(actual, expected), f"{what}: not bit-equal (max diff {(actual - expected).abs().max()})"
    else:
        assert_close_scaled(actual, expected, dtype, what)


def one_step_equals_one_process(full, ep, mine, data, rank, world, experts, what) -> bool:
    """One training step of this rank's EP layer ``ep`` against ``full`` run on every rank's tokens
    at once (``data``: per rank (x, dy)): outputs, input gradients, the local experts' weight and
    bias gradients, by the tolerance table (the GEMMs have other row counts). Returns whether some
    expert got no copy from some rank (asserted to occur by the callers)."""
    x, dy = data[rank]
    device, dtype = x.device, x.dtype
    for p in (*full.parameters(), *ep.parameters()):
        p.grad = None
    y_ref, dx_ref = _single_process(full, data)[rank]
    x = x.clone().requires_grad_()
    assert "moe_ep_overlap" in _rules(ep, x), (what, ep.explain(x))
    with record_routing() as log:
        y, _ = ep(x)
    (y * dy).sum().backward()
    counts = torch.bincount(log[0].reshape(-1), minlength=experts)
    every = torch.empty(world * experts, dtype=counts.dtype, device=device)
    dist.all_gather_into_tensor(every, counts.to(device), group=dist.group.WORLD)
    assert_close_scaled(y.reshape(-1, H), y_ref, dtype, f"output ({what})")
    assert_close_scaled(x.grad.reshape(-1, H), dx_ref, dtype, f"input grad ({what})")
    for i in (2, 4):
        assert_close_scaled(ep[i].weight.grad, full[i].weight.grad[mine], dtype, f"expert weight {i} grad ({what})")
        assert_close_scaled(ep[i].bias.grad, full[i].bias.grad[mine], dtype, f"expert bias {i} grad ({what})")
    return bool((every == 0).any())


def body_overlap_equals_one_process(rank, world, device):
    factory = dict(device=device, dtype=_dtype(device))
    # (experts, top_k, chunks, token lead shape per rank): uneven token counts; chunks that do not
    # divide the local experts; top_k=1 over 4-7 tokens leaves experts empty; a rank with no tokens
    cases = [(2 * world, 2, 2, [(5 + 3 * r,) for r in range(world)]),
             (8 * world, 2, 2, [(6 + r,) for r in range(world)]),  # several experts per chunk and source
             (4 * world, 2, 3, [(2, 3)] + [(0,)] + [(r, 2) for r in range(2, world)]),
             (4 * world, 1, 4, [(4 + r,) for r in range(world)])]
    empty_seen = False
    for case, (experts, top_k, chunks, leads) in enumerate(cases):
        what = f"E={experts} top_k={top_k} ep_chunks={chunks} tokens {leads}, rank {rank}/{world}"
        full, ep, mine = _full_and_ep(experts, top_k, "softmax", dist.group.WORLD, rank, world, **factory)
        ep[1].ep_chunks = chunks
        data = _data(world, leads, 20 + case, **factory)
        empty_seen |= one_step_equals_one_process(full, ep, mine, data, rank, world, experts, what)
    assert empty_seen, "no case routed zero copies of some expert from some rank"


def body_gradient_contract(rank, world, device):
    """main_grad + delayed weight gradients for FC1, a frozen FC2: what the unfused exchange
    (``ep_chunks=1``) delivers, bit for bit on CPU."""
    dtype = _dtype(device)
    factory = dict(device=device, dtype=dtype)
    results = []
    for chunks in (1, 3):
        _, ep, _ = _full_and_ep(6 * world, 2, "softmax", dist.group.WORLD, rank, world, **factory)
        fc1, fc2 = ep[2], ep[4]
        fc1.accumulate_into_main_grad = fc1.delay_wgrad_compute = True
        fc1.weight.main_grad = torch.full_like(fc1.weight, 0.5)
        fc2.weight.requires_grad_(False)
        ep[1].ep_chunks = chunks
        x, dy = _data(world, [(4 + 2 * r,) for r in range(world)], 3, **factory)[rank]
        x.requires_grad_()
        with fo.fusion_rules.disabled(*SINGLE_PROCESS_RULES):
            assert ("moe_ep_overlap" in _rules(ep, x)) == (chunks > 1)
            y, _ = ep(x)
            (y * dy).sum().backward()
        assert fc1.weight.grad is None and fc2.weight.grad is None
        assert fc1.has_pending_wgrad() and torch.equal(fc1.weight.main_grad, torch.full_like(fc1.weight, 0.5))
        fc1.backward_dw()
        assert not fc1.has_pending_wgrad()
        results.append((y, x.grad, fc1.weight.main_grad, fc1.bias.grad, fc2.bias.grad))
    for a, b, name in zip(*results, ("output", "input grad", "FC1 main_grad", "FC1 bias grad", "FC2 bias grad")):
        _same(b, a, device.type == "cpu", dtype, f"{name}, rank {rank}")


def body_fp8_declines(rank, world, device):
    """Under FP8 autocast the rule declines (a chunk would take its own per-tensor scales) and
    explain() says so; the unfused exchange runs, so ep_chunks changes nothing."""
    factory = dict(device=device, dtype=torch.float32)
    outs = []
    for chunks in (1, 4):
        _, ep, _ = _full_and_ep(4 * world, 2, "softmax", dist.group.WORLD, rank, world, **factory)
        ep[1].ep_chunks = chunks
        x = _data(world, [(6,)] * world, 4, **factory)[rank][0].requires_grad_()
        with fo.autocast(recipe=fo.Float8CurrentScaling()):
            assert "moe_ep_overlap" not in _rules(ep, x)
            if chunks > 1:
                text = ep.explain(x)
                assert "moe_ep_overlap" in text and "FP8 autocast" in text, text
            y, aux = ep(x)
            (y.square().sum() + aux).backward()
        outs.append((y, x.grad))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def body_fp8_equals_one_process(rank, world, device):
    """Under FP8 current scaling with ``autocast(amax_reduction_group=<the EP group>)`` every
    per-tensor amax (the experts' inputs, weights, output gradients; forward and backward) is the
    max over the ranks, i.e. the one a single process holding every rank's rows takes, so the EP
    layer casts to the same FP8 values as one process under the same recipe. What remains is the
    GEMMs' fp32 rounding (a group's rows are another M here than in the single process): judged
    by the SQNR table's threshold for an FP8 kernel's own error. On CPU most results are bit-equal
    (seen: every one at 2 ranks; 134 and 145 dB for two at 4). Without the group the scales are
    each rank's own: some result must then fall below the threshold (seen: 12-39 dB), so the
    comparison can fail."""
    factory = dict(device=device, dtype=torch.float32)
    recipe = fo.Float8CurrentScaling()
    min_db = SQNR_DB[("kernel", "fp8 operands")]
    cases = [(2 * world, 2, [(5 + 3 * r,) for r in range(world)]),
             (4 * world, 1, [(2, 3)] + [(0,)] + [(r, 2) for r in range(2, world)])]
    worst_without = float("inf")
    for case, (experts, top_k, leads) in enumerate(cases):
        what = f"FP8 current, E={experts} top_k={top_k} tokens {leads}, rank {rank}/{world}"
        data = _data(world, leads, 60 + case, **factory)
        for group in (dist.group.WORLD, None):
            full, ep, mine = _full_and_ep(experts, top_k, "softmax", dist.group.WORLD, rank, world, **factory)
            with fo.autocast(recipe=recipe):
                y_ref, dx_ref = _single_process(full, data)[rank]
            x, dy = data[rank]
            x = x.clone().requires_grad_()
            with fo.fusion_rules.disabled(*SINGLE_PROCESS_RULES):
                with fo.autocast(recipe=recipe, amax_reduction_group=group):
                    y, _ = ep(x)
                (y * dy).sum().backward()  # (outside the block: the backward reduces over the forward's group)
            results = [(y.reshape(-1, H), y_ref, "output"), (x.grad.reshape(-1, H), dx_ref, "input grad")]
            results += [(ep[i].weight.grad, full[i].weight.grad[mine], f"expert weight {i} grad") for i in (2, 4)]
            for a, b, name in results:
                if group is None:
                    worst_without = min(worst_without, sqnr(a, b))
                else:
                    assert_sqnr(a, b, min_db, msg=f"{name} ({what})")
    worst = torch.tensor([worst_without], device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MIN)
    assert worst.item() < min_db, f"without the reduction group every result still reached {worst.item():.1f} dB"
    body_fp8_declines(rank, world, device)  # (in the same launch of the ranks)


def body_bench_case(rank, world, device):
    """The harness case ``ep_moe`` (quick shapes): every variant agrees with ``single_gpu``, the
    plan holds the overlap, and the exchange-alone bench runs (no timing here)."""
    from fusible_ops.bench.cases import BenchContext
    from fusible_ops.bench.cases_dist import ep_moe

    benches = list(ep_moe(BenchContext(device=device, dtype=torch.float32, quick=True)))
    assert [b.config for b in benches] == [f"ep{world}", f"ep{world}_comm"]
    layer, comm = benches
    (x,), dy = layer.new_copy()
    assert "moe_ep_overlap" in _rules(layer.fused_module, x)
    ref = layer.variants["single_gpu"](x)
    for name, fn in layer.variants.items():
        assert_close_scaled(fn(x), ref, torch.float32, f"ep_moe variant {name}, rank {rank}")
    (t,), _ = comm.new_copy()
    assert comm.variants["comm_alone"](t).shape == (t.shape[0] * 8, t.shape[1])


def test_ep_moe_bench_case_runs():
    run_ranks(body_bench_case, 2, "gloo")


@pytest.mark.parametrize("backend, world", WORLDS)
def test_ep_overlap_equals_one_process(backend, world):
    run_ranks(body_overlap_equals_one_process, world, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ep_overlap_gradient_contract(backend):
    run_ranks(body_gradient_contract, 2, backend)


@pytest.mark.parametrize("backend, world", [pytest.param("gloo", 2, id="gloo-2"), pytest.param("gloo", 4, id="gloo-4"),
                                            pytest.param("nccl", 2, id="nccl-2", marks=pytest.mark.gpu)])
def test_ep_fp8_with_amax_reduction_equals_one_process_and_the_overlap_declines(backend, world):
    run_ranks(body_fp8_equals_one_process, world, backend)


@pytest.mark.parametrize("chunks", [0, -1, 2.0, True])
def test_ep_chunks_must_be_a_positive_int(chunks):
    with pytest.raises(ValueError, match="Dispatch: ep_chunks must be a positive int"):
        fo.Dispatch(ep_chunks=chunks)


def body_capture_refused(rank, world, device):
    """Capturing the expert-parallel layer in a CUDA graph is refused with a clear error on every
    rank, before any collective or host read is captured (the exchange still reads its split sizes
    on the host), whether the overlap rule runs it or not."""
    for chunks in (1, 2):
        _, ep, _ = _full_and_ep(4 * world, 2, "softmax", dist.group.WORLD, rank, world, device=device,
                                dtype=torch.float32)
        ep[1].ep_chunks = chunks
        assert_capture_refused(ep, torch.randn(64, H, device=device), "expert parallel .* is not graph-capturable")
        dist.barrier()


def assert_capture_refused(layer, x, match: str) -> None:
    """After one warm-up call (the first also compares the ranks' layouts), capturing ``layer(x)``
    in a CUDA graph raises a ``RuntimeError`` matching ``match``."""
    layer(x)
    torch.cuda.synchronize(x.device)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match=match):
        with torch.cuda.graph(graph):
            layer(x)


@pytest.mark.gpu
def test_ep_capture_is_refused_on_every_rank():
    run_ranks(body_capture_refused, 2, "nccl")

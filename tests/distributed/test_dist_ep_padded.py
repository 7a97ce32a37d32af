"""The expert-parallel exchange with no host read (``Dispatch(ep_exchange="padded")``): every rank
sends every peer a fixed capacity of rows and the split sizes stay on the device, so the layer can
be captured in a CUDA graph.

Checked against ONE process running the whole layer on every rank's tokens (bit for bit on CPU in
float64, by the tolerance table on GPUs), over several routings of the same token count (empty
experts included, and a step with no tokens at all); the host reads of a step counted (none after
the first call of a shape); mismatched token counts raise the same error on every rank; settings
validated. On GPUs (NCCL): the layer captured by ``fo.make_graphed_callables`` and replayed on new
tokens (new routings) equals eager; the unfused path refuses capture with the reason.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from dist_launch import BACKENDS, WORLDS, run_ranks
from test_dist_ep_overlap import _data, _same, assert_capture_refused, one_step_equals_one_process
from test_dist_expert_parallel import H, _dtype, _full_and_ep

import fusible_ops as fo
from fusible_ops.testing import assert_close_scaled


def _padded(ep):
    ep[1].ep_exchange, ep[1].ep_chunks = "padded", 1
    return ep


def body_padded_equals_one_process(rank, world, device):
    factory = dict(device=device, dtype=_dtype(device))
    # (experts, top_k, token lead shape per rank): same count on every rank, any shape; top_k=1 over
    # 5 tokens leaves experts empty; several experts per rank; no tokens anywhere
    cases = [(2 * world, 2, [(7,)] * world), (8 * world, 2, [(2, 3) if r % 2 else (6,) for r in range(world)]),
             (4 * world, 1, [(5,)] * world), (2 * world, 2, [(0,)] * world)]
    empty_seen = False
    for case, (experts, top_k, leads) in enumerate(cases):
        full, ep, mine = _full_and_ep(experts, top_k, "softmax", dist.group.WORLD, rank, world, **factory)
        _padded(ep)
        for step in range(2):  # (a second routing through the same layer: nothing stale)
            what = f"E={experts} top_k={top_k} tokens {leads} step {step}, rank {rank}/{world}"
            data = _data(world, leads, 40 + 10 * case + step, **factory)
            empty_seen |= one_step_equals_one_process(full, ep, mine, data, rank, world, experts, what)
    assert empty_seen, "no case routed zero copies of some expert from some rank"


def _gradient_contract(rank, world, device):
    """main_grad + delayed weight gradients for FC1, a frozen FC2: what the synced exchange
    delivers (bit for bit on CPU)."""
    dtype = _dtype(device)
    factory = dict(device=device, dtype=dtype)
    results = []
    for exchange in ("sync", "padded"):
        _, ep, _ = _full_and_ep(6 * world, 2, "softmax", dist.group.WORLD, rank, world, **factory)
        if exchange == "padded":
            _padded(ep)
        fc1, fc2 = ep[2], ep[4]
        fc1.accumulate_into_main_grad = fc1.delay_wgrad_compute = True
        fc1.weight.main_grad = torch.full_like(fc1.weight, 0.5)
        fc2.weight.requires_grad_(False)
        x, dy = _data(world, [(6,)] * world, 3, **factory)[rank]
        x.requires_grad_()
        y, _ = ep(x)
        (y * dy).sum().backward()
        assert fc1.weight.grad is None and fc2.weight.grad is None
        assert fc1.has_pending_wgrad() and torch.equal(fc1.weight.main_grad, torch.full_like(fc1.weight, 0.5))
        fc1.backward_dw()
        results.append((y, x.grad, fc1.weight.main_grad, fc1.bias.grad, fc2.bias.grad))
    for a, b, name in zip(*results, ("output", "input grad", "FC1 main_grad", "FC1 bias grad", "FC2 bias grad")):
        _same(b, a, device.type == "cpu", dtype, f"{name}, rank {rank}")


def _host_reads(rank, world, device):
    """No host read in a step after the first call of a shape (on CPU the reference kernels read
    split sizes on the host: only the MoE ops' own reads are counted there; on GPUs every read)."""
    from fusible_ops.testing.host_reads import count_host_reads

    factory = dict(device=device, dtype=_dtype(device))
    _, ep, _ = _full_and_ep(2 * world, 2, "softmax", dist.group.WORLD, rank, world, **factory)
    _padded(ep)
    x = torch.randn(6, H, **factory, requires_grad=True)
    y, aux = ep(x)  # (the first call compares the ranks' layouts and token counts)
    (y.sum() + aux).backward()
    mine = ("moe_ep.py", "moe.py", "moe_ep_overlap.py")
    for step in range(2):
        x = torch.randn(6, H, **factory, requires_grad=True)
        with count_host_reads() as reads:
            y, aux = ep(x)
            (y.sum() + aux).backward()
        seen = reads.where if device.type == "cuda" else [w for w in reads.where if w.split(":")[0].endswith(mine)]
        assert not seen, (step, seen)


def _mismatch(rank, world, device):
    """Different token counts on the ranks: the same clear error on every rank, no hang."""
    factory = dict(device=device, dtype=_dtype(device))
    _, ep, _ = _full_and_ep(2 * world, 2, "softmax", dist.group.WORLD, rank, world, **factory)
    _padded(ep)
    with pytest.raises(ValueError, match=r"ep_exchange='padded' needs the same number of token copies.*"
                                         r"rank 0: 8 copies, hidden 8, torch.float\d+; rank 1: 10 copies"):
        ep(torch.randn(4 + rank, H, **factory))
    y, _ = ep(torch.randn(4, H, **factory))  # (then equal counts run)
    assert y.shape == (4, H)


@pytest.mark.parametrize("backend, world", WORLDS)
def test_padded_exchange_equals_one_process(backend, world):
    run_ranks(body_padded_equals_one_process, world, backend)


def body_padded_contract_reads_mismatch(rank, world, device):
    """Three 2-rank checks in one launch of the ranks (each launch costs seconds of start-up)."""
    _mismatch(rank, world, device)
    _gradient_contract(rank, world, device)
    _host_reads(rank, world, device)


@pytest.mark.parametrize("backend", BACKENDS)
def test_padded_exchange_mismatch_contract_and_host_reads(backend):
    """Different token counts: the same error on every rank; the gradient contract equals the
    synced exchange's; no host read in a step after the first."""
    run_ranks(body_padded_contract_reads_mismatch, 2, backend)


def test_padded_exchange_settings():
    with pytest.raises(ValueError, match="ep_exchange must be 'sync' or 'padded'"):
        fo.Dispatch(ep_exchange="capacity")
    with pytest.raises(ValueError, match="ep_exchange='padded' exchanges in one piece"):
        fo.Dispatch(ep_exchange="padded", ep_chunks=2)
    assert fo.Dispatch(ep_exchange="padded").ep_chunks == 1 and fo.Dispatch().ep_chunks == 2


def body_padded_capture(rank, world, device):
    """The padded layer captured by fo.make_graphed_callables, replayed on new tokens (new
    routings), equals the same layer run eagerly; the synced exchange and a padded Dispatch whose
    layer does not fuse refuse capture with the reason."""
    full, ep, _ = _full_and_ep(4 * world, 2, "softmax", dist.group.WORLD, rank, world, device=device,
                               dtype=torch.float32)
    _padded(ep)
    eager = _padded(_full_and_ep(4 * world, 2, "softmax", dist.group.WORLD, rank, world, device=device,
                                 dtype=torch.float32)[1])
    x = torch.randn(64, H, device=device, requires_grad=True)
    graphed = fo.make_graphed_callables(ep, (x,))
    for step in range(3):
        xs = torch.randn(64, H, device=device, generator=torch.Generator(device).manual_seed(step))
        dy = torch.randn(64, H, device=device, generator=torch.Generator(device).manual_seed(100 + step))
        outs = []
        for layer in (graphed, eager):
            xi = xs.clone().requires_grad_()
            for p in layer.parameters():
                p.grad = None
            y, aux = layer(xi)
            (y * dy).sum().add(aux).backward()
            outs.append((y, xi.grad, layer[2].weight.grad, layer[4].weight.grad, layer[0].weight.grad))
        for a, b, name in zip(*outs, ("output", "input grad", "FC1 weight grad", "FC2 weight grad", "router grad")):
            assert_close_scaled(a, b, torch.float32, f"replay {step}: {name}, rank {rank}")
    torch.cuda.synchronize(device)
    for how in ("sync", "unfused"):
        _, layer, _ = _full_and_ep(4 * world, 2, "softmax", dist.group.WORLD, rank, world, device=device,
                                   dtype=torch.float32)
        if how == "unfused":
            _padded(layer)
        match = "takes effect only where the layer fuses" if how == "unfused" else "Dispatch\\(ep_exchange='padded'\\)"
        with fo.fusion_rules.disabled("moe_ep_overlap") if how == "unfused" else contextlib.nullcontext():
            assert_capture_refused(layer, torch.randn(64, H, device=device), match)
        dist.barrier()


@pytest.mark.gpu
def test_padded_exchange_is_graph_capturable():
    run_ranks(body_padded_capture, 2, "nccl")


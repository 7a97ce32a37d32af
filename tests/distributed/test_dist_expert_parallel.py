"""Expert parallelism: ``Dispatch(ep_group=...)`` / ``Combine`` exchange token copies with
all-to-all, each rank holding ``E / ep`` experts. The EP layer is checked against the single-process
MoE layer (the full model, run in every process on every rank's token slice): outputs, aux loss,
input gradients, the local experts' weight and bias gradients (the full run's, summed over all
ranks' slices, for those experts) and the router weight gradient after an all-reduce (the router
is replicated: data parallel). Plus the plain-autograd reference (``reference_forward``) and bad
input. CI runs the gloo variants; on GPUs: ``torchrun --nproc-per-node 2 -m pytest tests/distributed -m gpu``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_launch import BACKENDS, WORLDS, run_ranks

import fusible_ops as fo
from fusible_ops.ops.moe import RoutingError, record_routing
from fusible_ops.testing import assert_close_scaled, assert_matches_reference

H, F = 8, 6


def _dtype(device) -> torch.dtype:
    return torch.float64 if device.type == "cpu" else torch.float32


def _layer(experts, top_k, *, groups=None, ep_group=None, score="softmax", hidden=H, fc2_bias=True, **factory):
    groups = experts if groups is None else groups
    return fo.Sequential(
        fo.Router(hidden, experts, top_k, score=score, normalize=score == "sigmoid", z_loss_coeff=1e-2, **factory),
        fo.Dispatch(ep_group=ep_group),
        fo.GroupedLinear(groups, hidden, 2 * F, **factory),
        fo.SwiGLU(),
        fo.GroupedLinear(groups, F, hidden, bias=fc2_bias, **factory),
        fo.Combine(),
    )


def _full_and_ep(experts, top_k, score, group, rank, world, fc2_bias=True, **factory):
    """The single-process layer (same on every rank: fixed seed) and this rank's EP layer: the
    same router, the GroupedLinears holding experts [rank * E / ep, (rank + 1) * E / ep)."""
    torch.manual_seed(0)
    full = _layer(experts, top_k, score=score, fc2_bias=fc2_bias, **factory)
    with torch.no_grad():
        for p in full.parameters():
            p.uniform_(-1, 1)
    local = experts // world
    ep = _layer(experts, top_k, groups=local, ep_group=group, score=score, fc2_bias=fc2_bias, **factory)
    mine = slice(rank * local, (rank + 1) * local)
    with torch.no_grad():
        ep[0].weight.copy_(full[0].weight)
        for i in (2, 4):
            ep[i].weight.copy_(full[i].weight[mine])
            if ep[i].bias is not None:
                ep[i].bias.copy_(full[i].bias[mine])
    return full, ep, mine


def _tokens(world, lead_shapes, seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(*lead, H, generator=g), torch.randn(*lead, H, generator=g), float(1 + r))
            for r, lead in enumerate(lead_shapes)]  # (x, dy, daux) per rank


def _step_equals_single_process(full, ep, mine, data, rank, what) -> bool:
    """One step of this rank's EP layer against ``full`` on every rank's slice (``data``: per rank
    (x, dy, daux)): output, aux loss, input, local expert and all-reduced router gradients. Returns
    whether some (source rank, expert) pair got no token copies (the same answer on every rank)."""
    group, dtype, device = dist.group.WORLD, data[rank][0].dtype, data[rank][0].device
    # the full layer on every rank's slice (its aux loss is per slice, as each rank's Router computes it)
    ref = []
    for x, dy, daux in data:
        xf = x.clone().requires_grad_()
        y, aux = full(xf)
        ((y * dy).sum() + daux * aux).backward()
        ref.append((y.detach(), aux.detach(), xf.grad))
    x, dy, daux = data[rank]
    xe = x.clone().requires_grad_()
    with record_routing() as log:
        y, aux = ep(xe)
    ((y * dy).sum() + daux * aux).backward()
    assert_close_scaled(y, ref[rank][0], dtype, f"output ({what})")
    assert_close_scaled(aux, ref[rank][1], dtype, f"aux loss ({what})")
    assert_close_scaled(xe.grad, ref[rank][2], dtype, f"input grad ({what})")
    for i in (2, 4):
        assert_close_scaled(ep[i].weight.grad, full[i].weight.grad[mine], dtype, f"expert weight {i} grad ({what})")
        if ep[i].bias is not None:
            assert_close_scaled(ep[i].bias.grad, full[i].bias.grad[mine], dtype, f"expert bias {i} grad ({what})")
    router_grad = ep[0].weight.grad.clone()
    dist.all_reduce(router_grad, group=group)  # the replicated router: data-parallel all-reduce
    assert_close_scaled(router_grad, full[0].weight.grad, dtype, f"router weight grad after all-reduce ({what})")
    counts = torch.bincount(log[0].reshape(-1), minlength=full[0].num_experts).to(device)
    every = torch.empty(dist.get_world_size(group) * counts.numel(), dtype=counts.dtype, device=device)
    dist.all_gather_into_tensor(every, counts, group=group)
    return bool((every == 0).any())


def body_ep_equals_single_process(rank, world, device):
    group = dist.group.WORLD
    dtype = _dtype(device)
    factory = dict(device=device, dtype=dtype)
    experts = 2 * world
    # (top_k, score, token lead shape per rank): uneven token counts; top_k=1 with 1-2 tokens on a
    # rank leaves experts that get no token from that rank; a rank with no tokens at all
    cases = [(2, "softmax", [(5 + 3 * r,) for r in range(world)]),
             (1, "sigmoid", [(1 + r,) for r in range(world)]),
             (2, "softmax", [(2, 3)] + [(0,)] + [(r, 2) for r in range(2, world)])]
    empty_seen = False
    for case, (top_k, score, leads) in enumerate(cases):
        what = f"top_k={top_k} {score} tokens {leads}, rank {rank}/{world}"
        full, ep, mine = _full_and_ep(experts, top_k, score, group, rank, world, **factory)
        data = [(x.to(**factory), dy.to(**factory), daux) for x, dy, daux in _tokens(world, leads, 10 + case)]
        empty_seen = _step_equals_single_process(full, ep, mine, data, rank, what) or empty_seen
    assert empty_seen, "no case routed zero copies of some expert from some rank"
    # FC2 without a bias and ep_chunks=1 (moe_ep_overlap declines): moe_act_combine takes SwiGLU,
    # FC2 and Combine and runs the ops' own forward and backward around the exchange
    full, ep, mine = _full_and_ep(experts, 2, "softmax", group, rank, world, fc2_bias=False, **factory)
    ep[1].ep_chunks = 1
    data = [(x.to(**factory), dy.to(**factory), daux) for x, dy, daux in _tokens(world, [(5 + r,) for r in range(world)], 7)]
    with fo.fusion_rules.disabled("grouped_mlp"):
        assert [g["rule"] for g in ep.fusion_plan("forward", data[rank][0])][-1] == "moe_act_combine"
        _step_equals_single_process(full, ep, mine, data, rank, f"moe_act_combine after the exchange, rank {rank}")
    # the plain-autograd reference path (reference_forward: the exchange as an autograd function)
    full, ep, _ = _full_and_ep(experts, 2, "softmax", group, rank, world, **factory)
    assert_matches_reference(ep, _tokens(world, [(4 + r,) for r in range(world)], 3)[rank][0].to(**factory)
                             .requires_grad_())
    text = ep.explain(torch.randn(3, H, **factory))
    assert f"expert parallel over {world} ranks ({experts // world} local experts)" in text, text


def body_bad_input(rank, world, device):
    group = dist.group.WORLD
    factory = dict(device=device, dtype=_dtype(device))
    # experts not divisible by the EP group size
    with pytest.raises(RoutingError, match=rf"Dispatch .*: the {2 * world + 1} experts of Router .* do not split "
                                           rf"evenly over its expert-parallel group of {world} ranks"):
        _layer(2 * world + 1, 2, groups=2, ep_group=group, **factory)(torch.randn(3, H, **factory))
    # a routed GroupedLinear with all experts instead of E / ep
    with pytest.raises(RoutingError, match=rf"GroupedLinear .* has {2 * world} groups for {2 * world} experts over an "
                                           rf"expert-parallel group of {world} ranks \(2 local\)"):
        _layer(2 * world, 2, ep_group=group, **factory)(torch.randn(3, H, **factory))
    # one rank's layer is wrong (a routed GroupedLinear with the wrong group count): that rank alone
    # finds it when its fuser is built; every rank raises it at the Dispatch, none is left waiting
    odd = _layer(2 * world, 2, groups=3 if rank == 0 else 2, ep_group=group, **factory)
    with pytest.raises(RoutingError, match=r"Dispatch: the expert-parallel group \(\d ranks\) cannot run this MoE "
                                           r"layer: rank 0: GroupedLinear .* has 3 groups for \d experts"):
        odd(torch.randn(3, H, **factory))
    # ranks whose Routers have different numbers of experts (each layout fine on its own rank)
    uneven = _layer(2 * world * (1 + (rank == 0)), 2, groups=2 * (1 + (rank == 0)), ep_group=group, **factory)
    with pytest.raises(RoutingError, match=r"the ranks' Routers have different numbers of experts \(rank 0: "
                                           rf"{4 * world}, rank 1: {2 * world}"):
        uneven(torch.randn(3, H, **factory))
    # ranks passing different hidden sizes: the same error on every rank (no rank left in a collective)
    bad = _layer(2 * world, 2, groups=2, ep_group=group, hidden=H + rank, **factory)
    with pytest.raises(ValueError, match=r"Dispatch: the ranks of the expert-parallel group .* \(rank 0: hidden 8 "
                                         r"torch.float\d+; rank 1: hidden 9"):
        bad(torch.randn(3, H + rank, **factory))
    # a one-rank group (or None) keeps every expert local
    alone = [dist.new_group([r]) for r in range(world)][rank]  # collective: every rank makes every group
    solo = _layer(4, 2, ep_group=alone, **factory)
    assert solo[1].ep_size == 1 and solo(torch.randn(3, H, **factory))[0].shape == (3, H)
    dist.barrier()


def body_host_reads(rank, world, device):
    """The exchange's host reads per step, counted (issue 46 takes them to zero): one forward
    reads the received split sizes once; the backward reuses them. (CPU runs read more: the
    reference kernels read split sizes on the host; only the exchange's own reads are counted.)"""
    from fusible_ops.testing.host_reads import count_host_reads

    factory = dict(device=device, dtype=_dtype(device))
    _, ep, _ = _full_and_ep(2 * world, 2, "softmax", dist.group.WORLD, rank, world, **factory)
    x = torch.randn(6 + rank, H, **factory, requires_grad=True)
    for _ in range(2):  # (the first call also compares the ranks' layouts)
        y, aux = ep(x)
        (y.sum() + aux).backward()
    with count_host_reads() as reads:
        y, aux = ep(x)
    forward = [w for w in reads.where if "moe_ep.py" in w]
    with count_host_reads() as reads:
        (y.sum() + aux).backward()
    backward = [w for w in reads.where if "moe_ep.py" in w]
    assert len(forward) == 1 and not backward, (forward, backward)


# world 4 on gloo costs ~13 s on a 2-core CI runner (mostly process start-up); the suite stays well
# inside its time budget, and the issue asks for world sizes 2 and 4
@pytest.mark.parametrize("backend, world", WORLDS)
def test_expert_parallel_moe_equals_single_process(backend, world):
    run_ranks(body_ep_equals_single_process, world, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_expert_parallel_bad_input_is_a_clear_error(backend):
    run_ranks(body_bad_input, 2, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_expert_parallel_host_reads_per_step(backend):
    run_ranks(body_host_reads, 2, backend)

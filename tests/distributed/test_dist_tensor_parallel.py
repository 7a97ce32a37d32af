"""Tensor and sequence parallelism on torch.distributed: the comm ops against plain autograd over
functional collectives, the tensor-parallel MLP block against the single-process block, the
overlap rules (forced on gloo with a rule set whose rules have no checker), and bad input.

CI runs the gloo variants (spawned CPU processes); on 2+ GPUs:
``torchrun --nproc-per-node 2 -m pytest tests/distributed -m gpu`` (or ``pytest -m gpu``).
Each body batches several checks into one spawned run (process start-up dominates).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from dist_launch import BACKENDS, run_ranks

import fusible_ops as fo
from fusible_ops.fusion_rules import comm_overlap
from fusible_ops.parallel import load_full_state_dict, mark_sequence_parallel, tensor_parallel_mlp
from fusible_ops.rules import rule
from fusible_ops.testing import assert_close_scaled, assert_matches_reference

H, F = 16, 24  # hidden, ffn (divisible by 2 and 4)


def forced_overlap_rules() -> fo.RuleSet:
    """The built-in rules with the overlap rules' checkers removed (they decline on CPU/gloo)."""
    rs = fo.RuleSet.builtin()
    for r in comm_overlap.RULES:
        rs.add(rule(r.name, r.pattern, pass_=r.pass_, build=r.build, priority=r.priority))
    return rs


def _dtype(device) -> torch.dtype:
    return torch.float64 if device.type == "cpu" else torch.float32


def _rules_used(seq, x) -> set:
    return {g["rule"] for p in ("forward", "backward") for g in seq.fusion_plan(p, x)}


# --------------------------------------------------------------------------------------- bodies
def body_comm_ops(rank, world, device):
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(rank)
    f64 = dict(device=device, dtype=torch.float64)
    # each op alone and in a chain, against autograd over functional collectives
    for make, rows in ((fo.AllGather, 3), (fo.ReduceScatter, 2 * world), (fo.AllReduce, 3), (fo.AllReduceGrad, 3)):
        x = torch.randn(rows, 5, generator=g).to(**f64).requires_grad_()
        assert_matches_reference(fo.Sequential(make(group)), x)
    x = torch.randn(3, 2, 8, generator=g).to(**f64).requires_grad_()  # [tokens, batch, hidden]
    torch.manual_seed(0)
    chain = fo.Sequential(fo.AllGather(group), fo.Linear(8, 6, **f64), fo.GELU(), fo.BasicLinear(6, 8, **f64),
                          fo.ReduceScatter(group))
    assert_matches_reference(chain, x)
    if device.type == "cuda":  # NCCL: the overlap rules fire with the default rules once opted in
        assert not {"all_gather_linear", "linear_reduce_scatter"} & _rules_used(chain, x)
        chain[0].overlap = chain[4].overlap = True
        assert {"all_gather_linear", "linear_reduce_scatter"} <= _rules_used(chain, x)
    chain.rules = forced_overlap_rules()
    assert {"all_gather_linear", "all_gather_linear_backward", "linear_reduce_scatter",
            "linear_reduce_scatter_backward"} <= _rules_used(chain, x)
    assert_matches_reference(chain, x)
    replicated = fo.Sequential(fo.AllReduceGrad(group), fo.Linear(8, 6, **f64), fo.ReLU(), fo.BasicLinear(6, 8, **f64),
                               fo.AllReduce(group))
    assert_matches_reference(replicated, x)
    # the overlap rules decline on CPU/gloo, with the reason
    text = fo.Sequential(fo.AllGather(group), fo.BasicLinear(8, 6, **f64)).explain(x)
    if device.type == "cpu":
        assert "all_gather_linear" in text and "CPU tensors: gloo runs the collectives on the host" in text
    # a single-rank group and process_group=None are identities, and the rules say why they decline
    solo = [dist.new_group([r]) for r in range(world)][rank]  # collective: every rank makes every group
    for op in (fo.AllGather(solo), fo.ReduceScatter(solo), fo.AllReduce(solo), fo.AllReduceGrad(solo)):
        assert torch.equal(op(x), x)
    text = fo.Sequential(fo.AllGather(solo), fo.BasicLinear(8, 6, **f64)).explain(x)
    assert "single-rank group" in text


def _full_and_tp(world, device, dtype, act, sequence_parallel, rules=None):
    torch.manual_seed(1)
    full = tensor_parallel_mlp(H, F, None, activation=act(), sequence_parallel=sequence_parallel, device=device,
                               dtype=dtype)
    tp = tensor_parallel_mlp(H, F, dist.group.WORLD, activation=act(), sequence_parallel=sequence_parallel,
                             device=device, dtype=dtype)
    load_full_state_dict(tp, full.state_dict(), dist.group.WORLD)
    if rules is not None:
        tp.rules = rules
    return full, tp


def body_tp_mlp(rank, world, device):
    """TP MLP forward + backward equals the single-process block: outputs, input and weight
    gradients; sequence parallel ([tokens, batch, hidden] input) and not; GELU and SwiGLU;
    unfused and with the overlap rules forced."""
    dtype = _dtype(device)
    n = 4 * world  # tokens
    g = torch.Generator().manual_seed(7)  # the same full batch on every rank
    x_full = torch.randn(n, 3, H, generator=g).to(device, dtype)
    dy_full = torch.randn(n, 3, H, generator=g).to(device, dtype)
    rows = slice(rank * (n // world), (rank + 1) * (n // world))
    cases = [(fo.GELU, True, None), (fo.SwiGLU, True, None), (fo.GELU, False, None),
             (fo.SwiGLU, True, forced_overlap_rules())]
    for act, sp, rules in cases:
        full, tp = _full_and_tp(world, device, dtype, act, sp, rules)
        xf = x_full.clone().requires_grad_()
        full(xf).backward(dy_full)
        xt = (x_full[rows] if sp else x_full).clone().requires_grad_()
        yt = tp(xt)
        yt.backward(dy_full[rows] if sp else dy_full)
        what = f"{act.__name__} sequence_parallel={sp} overlap={rules is not None} rank {rank}/{world}"
        ref_y = full(x_full.clone())
        assert_close_scaled(yt, ref_y[rows] if sp else ref_y, dtype, f"output ({what})")
        assert_close_scaled(xt.grad, xf.grad[rows] if sp else xf.grad, dtype, f"input grad ({what})")
        expected = _shard_grads(tp, full)
        for k, p in tp.named_parameters():
            assert_close_scaled(p.grad, expected[k], dtype, f"{k} grad ({what})")
        if rules is not None:
            assert "all_gather_linear" in _rules_used(tp, xt) and "linear_reduce_scatter" in _rules_used(tp, xt)
    # a norm in front of the AllGather sees token shards: mark_sequence_parallel sums its weight's gradient
    full, tp = _full_and_tp(world, device, dtype, fo.GELU, True)
    norm = fo.RMSNorm(H, device=device, dtype=dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    norm_tp = copy.deepcopy(norm)
    assert len(mark_sequence_parallel(norm_tp, dist.group.WORLD)) == 1 and norm_tp.weight.sequence_parallel
    fo.Sequential(norm, *full)(x_full).backward(dy_full)
    xt = x_full[rows].clone().requires_grad_()
    fo.Sequential(norm_tp, *tp)(xt).backward(dy_full[rows])
    assert_close_scaled(norm_tp.weight.grad, norm.weight.grad, dtype, f"sequence-parallel norm weight grad, rank {rank}")


def _shard_grads(tp, full) -> dict:
    """This rank's shard of each gradient of the full block, cut as load_full_state_dict cuts weights."""
    scratch = copy.deepcopy(tp)
    load_full_state_dict(scratch, {k: p.grad for k, p in full.named_parameters()})
    return dict(scratch.named_parameters())


def body_bad_input(rank, world, device):
    group = dist.group.WORLD
    dtype = _dtype(device)
    # uneven token count for ReduceScatter: the same clear error on every rank
    rs = fo.ReduceScatter(group)
    with pytest.raises(ValueError, match=rf"ReduceScatter: the first \(sequence/token\) dim, {world + 1}, is not "
                                         rf"divisible by the process group's size {world}"):
        rs(torch.randn(world + 1, 4, device=device, dtype=dtype))
    # sequence-parallel shards of unequal length (an uneven sequence): caught by the shape check
    gather = fo.AllGather(group)
    with pytest.raises(ValueError, match=r"AllGather: the ranks of the process group .* passed different inputs"):
        gather(torch.randn(3 if rank == 0 else 2, 4, device=device, dtype=dtype))
    # a rank passing another shape to a block (first call of each op): every rank raises
    block = tensor_parallel_mlp(H, F, group, device=device, dtype=dtype)
    with pytest.raises(ValueError, match=r"rank 0: shape \[2, 16\] torch.float\d+; rank 1: shape \[2, 10\]"):
        block(torch.randn(2, H if rank == 0 else 10, device=device, dtype=dtype))
    # the same through the overlapped (fused) path: the fused op runs the comm op's check
    forced = tensor_parallel_mlp(H, F, group, device=device, dtype=dtype)
    forced.rules = forced_overlap_rules()
    with pytest.raises(ValueError, match=r"AllGather: the ranks .* passed different inputs"):
        forced(torch.randn(2 + rank, H, device=device, dtype=dtype))
    # later calls are not checked by default; check_calls=None checks every call
    always = fo.AllReduce(group, check_calls=None)
    always(torch.ones(2, device=device, dtype=dtype))
    with pytest.raises(ValueError, match="passed different inputs"):
        always(torch.ones(2 + rank, device=device, dtype=dtype))
    # a group that does not match the weight shards; a checkpoint of another size
    full = tensor_parallel_mlp(H, F, None, device=device, dtype=dtype)
    alone = [dist.new_group([r]) for r in range(world)][rank]  # collective: every rank makes every group
    with pytest.raises(ValueError, match=rf"the process group has 1 ranks .* built for a group of {world}"):
        load_full_state_dict(block, full.state_dict(), alone)
    lone_block = tensor_parallel_mlp(H, F, alone, device=device, dtype=dtype)
    wrong = tensor_parallel_mlp(H, F * 2, None, device=device, dtype=dtype).state_dict()
    with pytest.raises(ValueError, match=r"'1.weight' has shape \[48, 16\] in the checkpoint"):
        load_full_state_dict(block, wrong)
    load_full_state_dict(lone_block, full.state_dict())  # a one-rank group holds the whole block
    with pytest.raises(KeyError, match="missing keys"):
        load_full_state_dict(block, {})
    with pytest.raises(ValueError, match=rf"ffn={2 * world + 1} is not divisible by the tensor-parallel group size"):
        tensor_parallel_mlp(H, 2 * world + 1, group)
    # process_group=None while several ranks run: refused (it would silently skip the reduction)
    with pytest.raises(ValueError, match="process_group=None means no communication"):
        fo.AllGather(None)
    dist.barrier()


# --------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("backend", BACKENDS)
def test_comm_ops_match_functional_collectives(backend):
    run_ranks(body_comm_ops, 2, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_mlp_equals_single_process(backend, world):
    run_ranks(body_tp_mlp, world, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_input_is_a_clear_error_on_every_rank(backend):
    run_ranks(body_bad_input, 2, backend)

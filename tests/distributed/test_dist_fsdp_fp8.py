"""FP8 under FSDP2 (``fully_shard``), plain ``.grad`` mode: gloo in CI (CPU: FP8 emulated in
float32), NCCL on GPUs.

* Each rank trains on its slice of the batch under ``fo.autocast(recipe, amax_reduction_group=
  WORLD)`` (every per-tensor scale the max over the ranks, as one process holding every row would
  take it) for a few AdamW steps, against one process on the whole batch in lockstep (each step
  from the run's parameters: loss, gradients and update to fp32 rounding): every recipe, with and
  without FP8 all-gather, at 2 and 4 ranks. A dense block (RMSNorm, Linear, SwiGLU, Linear) and
  an expert MLP (GroupedLinear, SwiGLU, GroupedLinear: the fused grouped MLP under per-tensor
  recipes) each under its own ``fully_shard``.
* FP8 all-gather (``fo.quantization.enable_fp8_all_gather``) equals FSDP2 without it bit for bit
  (losses, gradients, parameters, delayed-scaling state), also with uneven shards and bf16
  ``param_dtype``: the gathered bytes and scales are those of casting the unsharded weight. What
  it cannot do raises, naming the recipe.
* The weight cache under FSDP2: each unsharded weight is cast once per unshard (counted), also
  across an accumulation window with the weights kept unsharded, and again after every optimizer
  step (FSDP2 keeps the unsharded tensor's version counter, and often its address).
* One GPU (``gpu``): world 1 over NCCL, bf16, with and without an amax group (without, CUDA
  replays the calls from C++).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_launch import WORLDS, run_ranks

import fusible_ops as fo
from fusible_ops.testing import SQNR_DB, assert_sqnr

E, STEPS, LR = 4, 3, 1e-2
RECIPES = {
    "current": fo.Float8CurrentScaling(),
    "delayed": fo.Float8DelayedScaling(amax_history_len=4),
    "block": fo.Float8BlockScaling(),
}


def _dims(recipe: str, world: int) -> tuple[int, int, int]:
    """(hidden, ffn, tokens per rank): FP8 dims are multiples of 16 (per-tensor) or 128 (block).
    Block scaling: its FP8 all-gather needs every rank's rows of FC1's weight [2 * ffn, hidden] and
    FC2's [hidden, ffn] to be whole 128-row blocks, and each expert's rows on a rank a multiple of
    128 (the weight gradient's 1x128 tiles run along the tokens: one process holding every rank's
    rows then tiles them as the ranks do)."""
    if recipe == "block":
        return 128 * max(world, 2), 64 * max(world, 2), 384
    return 32, 48, 16


def _model(device, hidden: int, ffn: int, dtype=torch.float32):
    torch.manual_seed(0)  # the same weights on every rank and in the single process
    f = dict(device=device, dtype=dtype)
    dense = fo.Sequential(fo.RMSNorm(hidden, **f), fo.Linear(hidden, 2 * ffn, bias=False, **f), fo.SwiGLU(),
                          fo.Linear(ffn, hidden, **f))
    experts = fo.Sequential(fo.GroupedLinear(E, hidden, 2 * ffn, bias=False, **f), fo.SwiGLU(),
                            fo.GroupedLinear(E, ffn, hidden, bias=False, **f))
    return torch.nn.ModuleDict({"dense": dense, "experts": experts})


def _splits(tokens: int) -> list:
    """Each rank's rows per expert (sorted by expert; one expert gets none)."""
    q = tokens // 3
    return [tokens - 2 * q, q, 0, q]


def _expert_major(world: int, tokens: int) -> torch.Tensor:
    """The rows of the whole batch (rank slices one after another) ordered by expert, then rank:
    one process running the experts on them sees, per expert, the rows the ranks see together."""
    s, idx = _splits(tokens), []
    for e in range(E):
        for r in range(world):
            start = r * tokens + sum(s[:e])
            idx.extend(range(start, start + s[e]))
    return torch.tensor(idx)


def _forward(model, x, world: int):
    """``h + experts(h)`` with h the dense block's output; ``world`` > 1: x holds every rank's rows
    (one process on the whole batch), else this rank's."""
    h = model["dense"](x)
    tokens = h.shape[0] // world
    splits = torch.tensor([world * n for n in _splits(tokens)], device=x.device)
    if world == 1:
        return h + model["experts"](h, splits, splits)
    order = _expert_major(world, tokens).to(x.device)
    y = torch.empty_like(h)
    y[order] = model["experts"](h[order], splits, splits)
    return h + y


def _batches(world: int, tokens: int, hidden: int, device, dtype=torch.float32):
    g = torch.Generator().manual_seed(7)
    return [torch.randn(world * tokens, hidden, generator=g).to(device, dtype) for _ in range(STEPS)]


def _train(model, recipe, batches, rows: slice, tokens: int, group, after_step=None) -> list:
    """This rank's FSDP2 run: (whole-batch loss, gradients, parameters after the AdamW step) per
    step, full tensors."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    history = []
    for x in batches:
        with fo.autocast(recipe=recipe, amax_reduction_group=group):
            y = _forward(model, x[rows], 1)
        loss = y.float().square().sum() / tokens  # (this rank's mean)
        loss.backward()
        grads = {k: _full(p.grad) for k, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        if after_step is not None:
            after_step(model)
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        history.append((loss / dist.get_world_size(), grads, {k: _full(p) for k, p in model.named_parameters()}))
    return history


def _check_against_one_process(history, recipe, batches, world, tokens, device, hidden, ffn, dtype, what) -> None:
    """One process on the whole batch, in lockstep: each step starts from the FSDP2 run's
    parameters (so FP8 roundings flipped by fp32 rounding differences of earlier steps do not
    accumulate), and its loss, gradients and AdamW update must equal the run's to fp32 rounding
    (the FP8 operands are the same: the table's threshold for an FP8 GEMM's own error). Every row's
    output gradient is the one the ranks' per-rank means give it (the summed gradient then divided
    by ``world``, as FSDP2 averages), so every FP8 cast sees the same values on both sides
    (delayed scaling's first step casts with scale 1: a gradient ``world`` times smaller would
    round otherwise)."""
    model = _model(device, hidden, ffn, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    db = SQNR_DB[("kernel", "fp8 operands")]
    start = {k: p.detach().clone() for k, p in model.named_parameters()}
    for t, (x, (loss_run, grads_run, params_run)) in enumerate(zip(batches, history)):
        with torch.no_grad():
            for k, p in model.named_parameters():
                p.copy_(start[k])
        with fo.autocast(recipe=recipe):
            y = _forward(model, x, world)
        loss = y.float().square().sum() / tokens
        loss.backward()
        assert_sqnr(loss_run.reshape(1), (loss / world).detach().reshape(1), db, msg=f"loss ({what}, step {t})")
        for k, p in model.named_parameters():
            p.grad /= world
            assert_sqnr(grads_run[k], p.grad, db, msg=f"{k} gradient ({what}, step {t})")
        opt.step()
        opt.zero_grad(set_to_none=True)
        for k, p in model.named_parameters():
            assert_sqnr(params_run[k] - start[k], p.detach() - start[k], db, msg=f"{k} update ({what}, step {t})")
        start = params_run


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _shard(model, world: int, device, all_gather: bool, **kw):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if all_gather:
        assert fo.quantization.enable_fp8_all_gather(model) == 4
    mesh = init_device_mesh(device.type, (world,))
    for part in model.values():  # (two roots: the ModuleDict has no forward of its own)
        fully_shard(part, mesh=mesh, **kw)
    return model


def _delayed_state(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items() if "fp8_" in k}


def body_fsdp_fp8_equals_single_process(rank, world, device, recipe_name, dtype=torch.float32, reduce_amax=True):
    """``reduce_amax``: the ranks cast under ``amax_reduction_group=WORLD`` (needed for one
    process's scales at 2+ ranks; at one rank, without it, CUDA replays the calls from C++)."""
    recipe = RECIPES[recipe_name]
    hidden, ffn, tokens = _dims(recipe_name, world)
    batches = _batches(world, tokens, hidden, device, dtype)
    rows = slice(rank * tokens, (rank + 1) * tokens)
    group = dist.group.WORLD if reduce_amax else None
    runs = {}
    for all_gather in (False, True):
        model = _shard(_model(device, hidden, ffn, dtype), world, device, all_gather)
        after = fo.quantization.precompute_fp8_scales if all_gather else None
        runs[all_gather] = (_train(model, recipe, batches, rows, tokens, group, after), _delayed_state(model))
    what = f"{recipe_name}, {world} ranks, {dtype}"
    _check_against_one_process(runs[False][0], recipe, batches, world, tokens, device, hidden, ffn, dtype, what)
    for t, ((a, ga, pa), (b, gb, pb)) in enumerate(zip(runs[False][0], runs[True][0])):  # FP8 all-gather: bit for bit
        assert torch.equal(a, b), f"{what}, step {t}: loss {a.item()} without FP8 all-gather, {b.item()} with"
        for k in pa:
            assert torch.equal(ga[k], gb[k]) and torch.equal(pa[k], pb[k]), f"{what}, step {t}: {k} differs"
    state, state_ag = runs[False][1], runs[True][1]
    assert state.keys() == state_ag.keys() and (recipe_name != "delayed" or state)
    for k in state:
        assert torch.equal(state[k], state_ag[k]), f"{what}: {k} differs with FP8 all-gather"


@pytest.mark.parametrize("backend, world, recipe_name", [
    pytest.param(*w.values, r, id=f"{w.id}-{r}", marks=w.marks) for w in WORLDS for r in RECIPES
    if not (w.id == "gloo-4" and r == "block")])  # (block at 4 ranks: 512-wide weights, the slowest case)
def test_fsdp2_fp8_equals_single_process(backend, world, recipe_name):
    run_ranks(body_fsdp_fp8_equals_single_process, world, backend, recipe_name)


def body_single_gpu(rank, world, device):
    for recipe_name in RECIPES:
        for reduce_amax in (True, False):
            body_fsdp_fp8_equals_single_process(rank, world, device, recipe_name, torch.bfloat16, reduce_amax)
    for all_gather in (False, True):
        body_casts_once_per_unshard(rank, world, device, all_gather)


@pytest.mark.gpu
def test_fsdp2_fp8_single_gpu():
    """FSDP2 at world 1 on one GPU (NCCL), bf16: every recipe with and without FP8 all-gather
    against the unsharded model, with an amax group and without (calls replayed from C++), and the
    casts per unshard."""
    run_ranks(body_single_gpu, 1, "nccl")


def _casts(model) -> list:
    return [m.__dict__.get("fp8_weight_casts", 0) for m in (model["dense"][1], model["dense"][3],
                                                            model["experts"][0], model["experts"][2])]


def body_casts_once_per_unshard(rank, world, device, all_gather):
    recipe = fo.Float8CurrentScaling()
    hidden, ffn, tokens = _dims("current", world)
    batches = _batches(world, tokens, hidden, device)
    rows = slice(rank * tokens, (rank + 1) * tokens)
    for reshard in (True, False):
        model = _shard(_model(device, hidden, ffn), world, device, all_gather, reshard_after_forward=reshard)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        before = _casts(model)
        for t, x in enumerate(batches):  # micro-batches: a window of len(batches) - t
            window = len(batches) - t
            for mb in range(window):
                last = mb == window - 1
                for part in model.values():  # torchtitan's accumulation: no sync, weights kept unsharded
                    part.set_requires_gradient_sync(last)
                    part.set_reshard_after_backward(last)
                with fo.autocast(recipe=recipe, amax_reduction_group=dist.group.WORLD):
                    y = _forward(model, x[rows], 1)
                if not reshard:
                    w = model["dense"][1].weight
                    assert type(w) is (fo.quantization.Float8GatheredWeight if all_gather else torch.nn.Parameter)
                y.square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            after = _casts(model)
            # unshards per window (every weight's input needs a gradient, so every unshard casts):
            # resharded after forward, the first forward gathers and so does every backward (the
            # forwards after the first find the weights the previous backward left unsharded);
            # kept unsharded after forward, one gather serves the window
            want = 1 + window if reshard else 1
            assert [a - b for a, b in zip(after, before)] == [want] * 4, (
                f"all_gather={all_gather}, reshard_after_forward={reshard}, step {t} ({window} micro-batches): "
                f"casts {[a - b for a, b in zip(after, before)]}, want {want} per weight")
            before = after
        if all_gather:  # the all-gather moved one byte per element
            for fsdp_param in model["dense"]._get_fsdp_state()._fsdp_param_group.fsdp_params:
                gathered = [t.dtype for t in fsdp_param.all_gather_outputs]
                if fsdp_param._module_info.module is model["dense"][1]:
                    assert gathered == [torch.uint8], gathered


@pytest.mark.parametrize("all_gather", [False, True], ids=["bf16-gather", "fp8-gather"])
def test_fsdp2_casts_each_weight_once_per_unshard(all_gather):
    run_ranks(body_casts_once_per_unshard, 2, "gloo", all_gather)


def _two_steps(model, recipe, x, splits=None, dtype=torch.float32) -> list:
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    out = []
    for _ in range(2):
        with fo.autocast(recipe=recipe, amax_reduction_group=dist.group.WORLD):
            y = model(x.to(dtype)) if splits is None else model(x.to(dtype), splits)
        y.float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(y.detach())
    return out + [_full(p) for p in model.parameters()]


def _raises(exc, match: str, fn) -> None:
    with pytest.raises(exc, match=match):
        fn()


def body_fp8_all_gather_cases(rank, world, device):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (world,))
    current = fo.Float8CurrentScaling()

    def build(make, all_gather, **kw):
        torch.manual_seed(0)
        model = make()
        if all_gather:
            fo.quantization.enable_fp8_all_gather(model)
        fully_shard(model, mesh=mesh, **kw)
        return model

    g = torch.Generator().manual_seed(rank)
    # uneven shards (3 experts on 2 ranks: FSDP2 pads the second rank's shard) and mixed precision
    # (bf16 parameters gathered, cast from bf16 as the unsharded weight is): equal to no FP8 all-gather
    experts = lambda: fo.Sequential(fo.GroupedLinear(3, 32, 32, bias=False))  # noqa: E731
    x, splits = torch.randn(16, 32, generator=g), torch.tensor([8, 0, 8])
    runs = [_two_steps(build(experts, ag), current, x, splits) for ag in (False, True)]
    assert all(torch.equal(a, b) for a, b in zip(*runs)), "uneven expert shards: FP8 all-gather differs"
    dense = lambda: fo.Sequential(fo.Linear(32, 64), fo.GELU(), fo.Linear(64, 32))  # noqa: E731
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for recipe in (current, fo.Float8DelayedScaling(amax_history_len=4)):
        runs = [_two_steps(build(dense, ag, mp_policy=bf16), recipe, x, dtype=torch.bfloat16) for ag in (False, True)]
        assert all(torch.equal(a, b) for a, b in zip(*runs)), f"bf16 parameters, {recipe}: FP8 all-gather differs"
    # what cannot be gathered in FP8 says so, naming the recipe
    model = build(lambda: fo.Sequential(fo.Linear(128, 128)), True)  # (64 rows a rank: half a 128x128 block)
    _raises(ValueError, r"Linear: FP8 all-gather under Float8BlockScaling needs every rank's rows to be whole "
            r"128x128 weight blocks, i.e. out_features \(128\) divisible by 128 \* 2 ranks",
            lambda: _two_steps(model, fo.Float8BlockScaling(), torch.randn(128, 128)))
    model = build(dense, True)
    _raises(RuntimeError, r"Linear: FP8 all-gather .* must be unsharded inside fusible_ops.autocast",
            lambda: model(x))
    _two_steps(model, current, x)
    _raises(RuntimeError, r"gathered under Float8CurrentScaling \(tensor scales\) .* cannot be gathered under "
            r"Float8BlockScaling \(128x128 scales\)", lambda: _two_steps(model, fo.Float8BlockScaling(), x))


def test_fp8_all_gather_uneven_shards_mixed_precision_and_errors():
    run_ranks(body_fp8_all_gather_cases, 2, "gloo")

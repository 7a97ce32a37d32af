"""A small training setup shared by tests/test_resume.py and tests/test_fp8_eval.py (not a test
file): a dense block and a MoE layer of fusible ops under the full gradient contract (main_grad,
delayed weight gradients, a frozen weight), AdamW, deterministic batches, and one training step.

``D = 128`` serves every recipe (block scaling needs feature sizes and token counts that are
multiples of 128). Everything is deterministic on one machine: equal inputs give equal bits.
"""

from __future__ import annotations

import contextlib

import torch

import fusible_ops as fo

D, TOKENS, EXPERTS = 128, 128, 4
RECIPES = {
    "none": None,  # no FP8
    "current": fo.Float8CurrentScaling(),
    "delayed": fo.Float8DelayedScaling(amax_history_len=4),
    "block": fo.Float8BlockScaling(),
}
FLAGS = dict(accumulate_into_main_grad=True, delay_wgrad_compute=True)


def build(device, seed: int = 0) -> torch.nn.ModuleDict:
    """``dense``: RMSNorm -> Linear -> SwiGLU -> Linear -> + its input -> Dropout -> Linear
    (frozen weight; trainable bias); ``moe``: a top-2 sigmoid router with aux-loss-free balancing
    buffers over 4 experts. Every trainable linear weight has a float32 ``main_grad``."""
    torch.manual_seed(seed)
    f = dict(device=device)
    dense = fo.Sequential(
        fo.RMSNorm(D, **f), fo.Linear(D, 2 * D, bias=False, **f, **FLAGS), fo.SwiGLU(),
        fo.Linear(D, D, **f, **FLAGS), fo.AddExtraInput(from_input=True), fo.Dropout(0.1),
        fo.Linear(D, D, **f, **FLAGS),
    )
    dense[6].weight.requires_grad_(False)
    moe = fo.Sequential(
        fo.Router(D, EXPERTS, top_k=2, score="sigmoid", normalize=True, expert_bias=True, **f, **FLAGS),
        fo.Dispatch(), fo.GroupedLinear(EXPERTS, D, 2 * D, bias=False, **f, **FLAGS), fo.SwiGLU(),
        fo.GroupedLinear(EXPERTS, D, D, bias=False, **f, **FLAGS), fo.Combine(),
    )
    model = torch.nn.ModuleDict({"dense": dense, "moe": moe})
    for p in main_grad_params(model).values():
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
    return model


def main_grad_params(model) -> dict:
    """The weights whose gradients go to ``main_grad`` (trainable weights of the flagged ops)."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad and n.endswith("weight")
            and not n.startswith("dense.0.")}


def optimizer(model) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.01)


def batch(t: int, device) -> tuple:
    """Step ``t``'s input and target (a function of ``t`` alone, as a resumable data loader's)."""
    g = torch.Generator().manual_seed(1000 + t)
    return (torch.randn(TOKENS, D, generator=g).to(device), torch.randn(TOKENS, D, generator=g).to(device))


def forward(model, x: torch.Tensor, recipe) -> tuple:
    """``(y, aux_loss)`` of the model under ``recipe`` (None: no FP8)."""
    with fo.autocast(recipe=recipe) if recipe is not None else contextlib.nullcontext():
        h = model["dense"](x)
        return model["moe"](h)


def train_step(model, opt, recipe, t: int) -> dict:
    """One step on batch ``t``: forward, backward, the delayed weight gradients, main_grad handed
    to the optimizer as ``.grad``, AdamW, the router's balancing step. Returns the loss and every
    gradient the optimizer used and the router's ``expert_bias`` after the step (clones)."""
    x, target = batch(t, next(model.parameters()).device)
    y, aux = forward(model, x, recipe)
    loss = (y - target).square().mean() + aux
    loss.backward()
    for seq in model.values():
        seq.backward_dw()
    mains = main_grad_params(model)
    for p in mains.values():
        p.grad = p.main_grad  # (main_grad is float32, as the parameters)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    opt.step()
    opt.zero_grad(set_to_none=True)
    for p in mains.values():
        p.main_grad.zero_()
    model["moe"][0].update_expert_bias(1e-2)
    return {"loss": loss.detach().clone(), "grads": grads, "expert_bias": model["moe"][0].expert_bias.clone()}


def run(model, opt, recipe, steps: range) -> list:
    """``train_step`` for each step index; the rules' cost hints off, as in the test suite."""
    with fo.fusion_rules.disabled("cost hints"):
        return [train_step(model, opt, recipe, t) for t in steps]


def flat_optimizer_state(opt) -> dict:
    """The optimizer's per-parameter tensors by ``"<index>.<name>"``."""
    out = {}
    for i, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            out[f"{i}.{k}"] = v if isinstance(v, torch.Tensor) else torch.tensor(v)
    return out

"""The golden checkpoint: a small model whose state dict holds every kind of library state
(FP8 delayed-scaling buffers of a ``Linear`` and a ``GroupedLinear``, a router's balancing
buffers, the format version entries), written once by this module and kept in the tree
(``tests/data/golden_checkpoint.safetensors``, a few KB). tests/test_checkpoint_format.py loads it
into a freshly built :func:`golden_model` and checks its values, so a change of the checkpoint
format (a key, a shape, a dtype, the meaning of an entry) fails a test instead of old checkpoints.

Rewrite it only with a deliberate format change (and a new
:data:`~fusible_ops.training_state.FORMAT_VERSION`)::

    python -m fusible_ops.testing.golden tests/data/golden_checkpoint.safetensors

Needs ``safetensors`` (the ``test`` extra).
"""

from __future__ import annotations

import sys

import torch

import fusible_ops as fo

RECIPE = fo.Float8DelayedScaling(amax_history_len=4)
TOKENS, STEPS = 32, 3


def golden_model() -> fo.Sequential:
    """A Linear, a GELU, then a top-2 sigmoid-routed MoE layer of 4 experts (one GroupedLinear)
    with aux-loss-free balancing buffers; features 16 (the FP8 per-tensor minimum)."""
    torch.manual_seed(0)
    return fo.Sequential(
        fo.Linear(16, 16), fo.GELU(),
        fo.Router(16, 4, top_k=2, score="sigmoid", normalize=True, expert_bias=True), fo.Dispatch(),
        fo.GroupedLinear(4, 16, 16, bias=False), fo.Combine(),
    )


def train_golden(model: fo.Sequential) -> None:
    """``STEPS`` SGD steps under :data:`RECIPE`; the router's balancing step (a shrinking rate)
    after each but the last (so ``expert_load`` holds the last step's count)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        x = torch.randn(TOKENS, 16, generator=g)
        with fo.autocast(recipe=RECIPE):
            y, aux = model(x)
        (y.square().mean() + aux).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step < STEPS - 1:
            model[2].update_expert_bias(0.1 / (step + 1))


def write(path: str) -> dict:
    """Train :func:`golden_model` and write its state dict to ``path`` (safetensors). Returns it."""
    from safetensors.torch import save_file

    model = golden_model()
    train_golden(model)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(state, path, metadata={"fusible_ops_format": str(fo.training_state.FORMAT_VERSION),
                                     "written_by": "python -m fusible_ops.testing.golden"})
    return state


if __name__ == "__main__":
    write(sys.argv[1] if len(sys.argv) > 1 else "tests/data/golden_checkpoint.safetensors")

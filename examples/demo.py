"""fusible_ops demo: a transformer MLP block and a mixture-of-experts block built from op
sequences. Prints the fusion plans, trains a few steps, and checks the fused model against the
same ops run unfused (float64 reference). CPU by default, CUDA when present.

    python examples/demo.py [--device cpu|cuda] [--steps N]
"""

import argparse

import torch

import fusible_ops as fo
from fusible_ops.testing import assert_matches_reference


def build(hidden: int, experts: int, ffn: int, device, dtype):
    mlp = fo.Sequential(
        fo.RMSNorm(hidden, device=device, dtype=dtype),
        fo.Linear(hidden, 4 * hidden, device=device, dtype=dtype),
        fo.GELU(approximate="tanh"),
        fo.Dropout(0.1),
        fo.Linear(4 * hidden, hidden, device=device, dtype=dtype),
        fo.AddExtraInput(),  # residual
    )
    moe = fo.Sequential(
        fo.GroupedLinear(experts, hidden, 2 * ffn, bias=False, device=device, dtype=dtype),
        fo.SwiGLU(),
        fo.GroupedLinear(experts, ffn, hidden, bias=False, device=device, dtype=dtype),
    )
    return mlp, moe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    tokens, hidden, experts, ffn = 64, 32, 4, 24
    mlp, moe = build(hidden, experts, ffn, device, dtype)

    print(f"device: {device}, dtype: {dtype}\n")
    print("== MLP block ==")
    print(mlp.explain())
    print("\n== MoE experts ==")
    print(moe.explain())

    splits = torch.tensor([20, 0, 30, 14], device=device)  # one empty expert
    params = list(mlp.parameters()) + list(moe.parameters())
    opt = torch.optim.AdamW(params, lr=1e-2)
    x = torch.randn(tokens, hidden, device=device, dtype=dtype)
    target = torch.randn(tokens, hidden, device=device, dtype=dtype)
    print("\ntraining:")
    for step in range(args.steps):
        h = mlp(x, x)
        y = moe(h, splits, splits)
        loss = (y.float() - target.float()).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"  step {step}: loss {loss.item():.4f}")

    mlp.eval()  # dropout off for a deterministic comparison (also fine in training mode)
    xr = torch.randn(tokens, hidden, device=device, dtype=dtype, requires_grad=True)
    assert_matches_reference(mlp, xr, xr.detach().clone().requires_grad_())
    assert_matches_reference(moe, xr, splits, splits)
    print("\nfused == unfused float64 reference (outputs and all gradients): OK")


if __name__ == "__main__":
    main()

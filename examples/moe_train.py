"""Train a small mixture-of-experts model built from fusible ops: a few pre-norm MoE blocks
(RMSNorm -> Router -> Dispatch -> grouped SwiGLU MLP -> Combine -> residual) on random tokens
with a regression target from a fixed random teacher. The router's load-balancing loss is added
to the loss. Prints the plan of one block and the loss, which decreases. CPU (float32) by
default, CUDA (bfloat16) when present.

    python examples/moe_train.py [--device cpu|cuda] [--steps N] [--blocks N]
"""

import argparse
import time

import torch

import fusible_ops as fo


def moe_block(hidden: int, ffn: int, experts: int, top_k: int, **factory) -> fo.Sequential:
    """``y = x + MoE(RMSNorm(x))``; called as ``block(x, x)`` (the residual is an extra input),
    returns ``(y, aux_loss)``."""
    return fo.Sequential(
        fo.RMSNorm(hidden, **factory),
        fo.Router(hidden, experts, top_k, score="softmax", normalize=True, aux_loss_coeff=1e-2, z_loss_coeff=1e-3,
                  **factory),
        fo.Dispatch(),
        fo.GroupedLinear(experts, hidden, 2 * ffn, bias=False, **factory),
        fo.SwiGLU(),
        fo.GroupedLinear(experts, ffn, hidden, bias=False, **factory),
        fo.Combine(),
        fo.AddExtraInput(),
    )


def tokens_per_expert(block: fo.Sequential, x: torch.Tensor) -> list:
    """How the block's router splits ``x``'s tokens (token copies per expert), for monitoring."""
    norm, router = block[0], block[1]
    with torch.no_grad():
        logits = norm(x).reshape(-1, router.in_features).float() @ router.weight.float().t()
        ids, _ = router.select(router.scores(logits))
    return torch.bincount(ids.flatten(), minlength=router.num_experts).tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--blocks", type=int, default=2)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    factory = dict(device=device, dtype=dtype)
    torch.manual_seed(0)
    batch, seq, hidden, ffn, experts, top_k = 4, 32, 32, 48, 8, 2

    blocks = torch.nn.ModuleList(moe_block(hidden, ffn, experts, top_k, **factory) for _ in range(args.blocks))
    with torch.no_grad():
        for block in blocks:  # small expert outputs at start: the residual stream dominates
            block[5].weight.mul_(0.1)
    head = fo.Linear(hidden, hidden, **factory)
    print(f"device: {device}, dtype: {dtype}, {args.blocks} MoE blocks ({experts} experts, top_k={top_k})\n")
    print(blocks[0].explain(), "\n")

    teacher = torch.randn(hidden, hidden, device=device) / hidden**0.5
    params = [p for m in (*blocks, head) for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=3e-3)
    first = last = None
    t0 = time.perf_counter()
    for step in range(args.steps):
        x = torch.randn(batch, seq, hidden, device=device)
        target = torch.tanh(x @ teacher) * 2
        h, aux = x.to(dtype), 0.0
        for block in blocks:
            h, block_aux = block(h, h)
            aux = aux + block_aux
        loss = (head(h).float() - target).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        (loss + aux).backward()
        opt.step()
        last = loss.item()
        first = last if first is None else first
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {last:.4f}  aux {float(aux.detach()):.4f}  block-0 tokens/expert "
                  f"{tokens_per_expert(blocks[0], x.to(dtype))}")
    print(f"\nloss {first:.4f} -> {last:.4f} in {time.perf_counter() - t0:.1f} s")
    if not last < first:
        raise SystemExit("loss did not decrease")


if __name__ == "__main__":
    main()

"""Same-process before/after of the host path: an older fusible_ops tree against this one, with
plain PyTorch, each ``host_overhead`` workload timed in turns (one call of each per round, so
all three see the same host state; on CUDA the process is pinned to one CPU core).

Across processes the H200 host's speed drifts by up to 1.5x, which hides changes of a few
percent; in one process it moves all three alike, so ``after / before`` is steady.

    git archive <rev> fusible_ops | tar -x -C /tmp/before     # the older tree
    PYTHONPATH=. python3 scripts/host_ab_bench.py /tmp/before [--device cpu] [--rounds 3] [--no-grad]

``--no-grad`` times forward calls under ``torch.no_grad()`` (inference) instead of forward + backward.
An A/A run (``/tmp/before`` holding this very tree) shows the harness's own bias: the renamed
copy has run 0-6% slower than the in-repo tree on the H100 hosts and 1-2% on CPU, so read
``after / before`` against an A/A run of the same call.

The older package is imported under the name ``fusible_ops_before`` (a renamed copy of it,
custom-op namespace included, is made in a temporary directory).
"""
import argparse
import importlib
import os
import shutil
import sys
import tempfile

import torch

import fusible_ops.bench.host as now_host


def _renamed_copy(tree: str) -> str:
    """A copy of ``tree``/fusible_ops as ``fusible_ops_before`` (every ``fusible_ops`` name in its
    sources renamed, so its custom ops register under their own namespace); returns the copy's root."""
    root = tempfile.mkdtemp(prefix="fo_before_")
    dst = os.path.join(root, "fusible_ops_before")
    shutil.copytree(os.path.join(tree, "fusible_ops"), dst, ignore=shutil.ignore_patterns("__pycache__"))
    for dirpath, _, files in os.walk(dst):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                with open(path) as fh:
                    text = fh.read()
                with open(path, "w") as fh:
                    fh.write(text.replace("fusible_ops", "fusible_ops_before"))
    return root


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("before", help="a directory holding the older tree's fusible_ops/")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rep", type=int, default=300)
    ap.add_argument("--no-grad", action="store_true", help="time forward calls under torch.no_grad() (inference)")
    args = ap.parse_args()
    sys.path.insert(0, _renamed_copy(args.before))
    before_host = importlib.import_module("fusible_ops_before.bench.host")
    dev = torch.device(args.device)
    if dev.type == "cuda" and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
    dtype, small = (torch.bfloat16, False) if dev.type == "cuda" else (torch.float32, True)
    torch.manual_seed(0)
    before = list(before_host._workloads(dev, dtype, small))
    torch.manual_seed(0)
    after = list(now_host._workloads(dev, dtype, small))
    # Plain PyTorch gets a third set: a workload's peer shares tensors with its module (x, the
    # weights), and before and after should be treated alike. (This did not remove the A/A bias
    # the module docstring describes: on CPU it stayed at 1-2%.)
    torch.manual_seed(0)
    plain = list(now_host._workloads(dev, dtype, small))
    what = "forward (no_grad)" if args.no_grad else "fwd+bwd"
    print(f"host us per {what}, median [p20, p80], {torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'CPU'}")
    for b_w, a_w, p_w in zip(before, after, plain):  # (older trees yield 7-tuples, newer 8)
        (name, _, b_mod, b_args, _, _, dy), (a_mod, a_args), (peer, p_args) = b_w[:7], a_w[2:4], p_w[4:6]
        if args.no_grad:
            fns = [_no_grad(b_mod, b_args), _no_grad(a_mod, a_args), _no_grad(peer, p_args)]
        else:
            fns = [lambda: b_mod(*b_args).backward(dy), lambda: a_mod(*a_args).backward(dy),
                   lambda: peer(*p_args).backward(dy)]
        for _ in range(args.rounds):
            b, a, p = now_host.host_times_interleaved(fns, dev, 20, args.rep)
            print(f"{name:18s} before {b[0]:6.0f} [{b[1]:.0f}, {b[2]:.0f}]  after {a[0]:6.0f} [{a[1]:.0f}, {a[2]:.0f}]  "
                  f"plain {p[0]:6.0f} [{p[1]:.0f}, {p[2]:.0f}]  after/before {a[0] / b[0]:.3f}  "
                  f"before/plain {b[0] / p[0]:.2f}x  after/plain {a[0] / p[0]:.2f}x", flush=True)


def _no_grad(fn, args):
    def call():
        with torch.no_grad():
            fn(*args)
    return call


if __name__ == "__main__":
    main()

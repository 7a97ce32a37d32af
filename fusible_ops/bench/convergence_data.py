"""The convergence case's text: the bytes of the Python standard library's own ``.py`` files,
which every machine running this has without a download.

* Files: every ``*.py`` under ``sysconfig.get_paths()["stdlib"]``, by relative path in sorted
  order, leaving out ``site-packages`` and test folders (a path part named ``test``, ``tests`` or
  ``idle_test``: large generated data files live there), read whole until the next file would
  pass ``max_bytes``.
* Split by file, not by position: a file is validation when the first 8 bytes of the SHA-1 of
  its relative path (``/``-separated), as an integer, fall below ``val_fraction`` of 2^64. The
  same file lands on the same side on every machine and in every run.
* Tokens: the bytes themselves (vocabulary 256), each side's files concatenated in order.
* Batches: training windows of ``seq + 1`` bytes at offsets drawn up front from a CPU
  ``torch.Generator`` seeded with the data seed (the same for every variant: the same order);
  validation windows at evenly spaced offsets over the validation bytes (no seed).

A different Python version has a different standard library: a row records the corpus' size and
digest (:attr:`Corpus.digest`), and runs are compared only where they agree.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sysconfig
from typing import Optional

import torch

SKIP_PARTS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
"""Folders whose files are left out."""


def stdlib_root() -> str:
    """The standard library's folder."""
    return sysconfig.get_paths()["stdlib"]


def source_files(root: str) -> list[str]:
    """Relative paths (``/``-separated) of the ``.py`` files under ``root``, sorted, without
    :data:`SKIP_PARTS` folders."""
    out = []
    for d, dirs, files in os.walk(root):
        rel = os.path.relpath(d, root)
        parts = [] if rel == "." else rel.split(os.sep)
        if SKIP_PARTS.intersection(parts):
            dirs[:] = []
            continue
        out += ["/".join(parts + [f]) for f in files if f.endswith(".py")]
    return sorted(out)


def is_validation(relpath: str, val_fraction: float) -> bool:
    """Whether the file ``relpath`` belongs to the validation side (see the module docstring)."""
    h = int.from_bytes(hashlib.sha1(relpath.encode("utf-8")).digest()[:8], "big")
    return h < val_fraction * 2**64


@dataclasses.dataclass
class Corpus:
    """The two sides' bytes (uint8 CPU tensors) and their files."""

    train: torch.Tensor
    val: torch.Tensor
    train_files: list[str]
    val_files: list[str]
    digest: str  # SHA-1 of both sides' bytes (hex, first 12 digits)

    def describe(self) -> dict:
        """What a row records about the corpus."""
        return {"train_bytes": int(self.train.numel()), "val_bytes": int(self.val.numel()),
                "train_files": len(self.train_files), "val_files": len(self.val_files), "digest": self.digest}


def load_corpus(max_bytes: int, val_fraction: float = 0.05, root: Optional[str] = None) -> Corpus:
    """The corpus of at most ``max_bytes`` from ``root`` (default: :func:`stdlib_root`)."""
    root = root or stdlib_root()
    sides: dict[bool, tuple[list[bytes], list[str]]] = {False: ([], []), True: ([], [])}
    total = 0
    for rel in source_files(root):
        with open(os.path.join(root, *rel.split("/")), "rb") as f:
            data = f.read()
        if total + len(data) > max_bytes:
            break
        total += len(data)
        chunks, names = sides[is_validation(rel, val_fraction)]
        chunks.append(data)
        names.append(rel)
    train, val = b"".join(sides[False][0]), b"".join(sides[True][0])
    if not train or not val:
        raise ValueError(f"convergence: the corpus under {root} (first {max_bytes} bytes) has {len(train)} training and "
                         f"{len(val)} validation bytes; both must be non-empty (raise max_bytes)")
    digest = hashlib.sha1(train + b"\0" + val).hexdigest()[:12]
    as_tensor = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8)  # noqa: E731
    return Corpus(as_tensor(train), as_tensor(val), sides[False][1], sides[True][1], digest)


def train_offsets(n_bytes: int, seq: int, batch: int, steps: int, seed: int) -> torch.Tensor:
    """[steps, batch] int64 start offsets of the training windows (``seq + 1`` bytes each), drawn
    on the CPU from ``seed``: the same on every device."""
    if n_bytes < seq + 2:
        raise ValueError(f"convergence: {n_bytes} training bytes are too few for windows of {seq + 1}")
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, n_bytes - seq, (steps, batch), generator=g)


def val_offsets(n_bytes: int, seq: int, count: int) -> torch.Tensor:
    """``count`` int64 start offsets evenly spaced over ``n_bytes`` validation bytes."""
    if n_bytes < seq + 1:
        raise ValueError(f"convergence: {n_bytes} validation bytes are too few for windows of {seq + 1}")
    last = n_bytes - seq - 1
    return torch.tensor([round(i * last / max(count - 1, 1)) for i in range(count)], dtype=torch.int64)


def windows(stream: torch.Tensor, offsets: torch.Tensor, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets, int64 [*offsets.shape, seq], of the windows of ``stream`` (uint8, on
    the offsets' device) at ``offsets``: a gather on the device, no host sync."""
    idx = offsets.unsqueeze(-1) + torch.arange(seq + 1, device=offsets.device)
    tok = stream[idx].long()
    return tok[..., :-1], tok[..., 1:]


__all__ = ["Corpus", "SKIP_PARTS", "is_validation", "load_corpus", "source_files", "stdlib_root", "train_offsets",
           "val_offsets", "windows"]

"""What FP8 does in a chain of basic ops under a recipe: the lines ``Sequential.explain()`` prints."""

from __future__ import annotations

from .recipes import Float8BlockScaling, fp8_dtype

_NAMES = {"float8_e4m3fn": "E4M3", "float8_e5m2": "E5M2"}


def _mode(recipe) -> str:
    from .casting import InputQuantizer

    return InputQuantizer(recipe, None).fused_mode()


def _fmt(recipe, role: str) -> str:
    return _NAMES[str(fp8_dtype(recipe, role)).replace("torch.", "")]


_HOW = {"fp8": ("FP8 bytes and amax in the producer's own pass (no cast) when no transposed copy is needed "
                "(frozen weight, no grad); else the amax in that pass, then one cast + transpose"),
        "amax": "the producer's pass also takes the amax, then one cast (current scaling needs the amax first)",
        "cast": "a standalone cast after the producer (block scales are not fused into producers yet)"}


def fp8_lines(ops, recipe, producers=frozenset(), grad_producers=frozenset()) -> list[str]:
    """One line per op that FP8 touches (or skips), in order; empty when ``recipe`` is None.
    ``producers``: indices of ops whose fused op writes the next op's FP8 input itself;
    ``grad_producers``: first indices of backward groups that write the previous op's FP8
    output gradient."""
    if recipe is None:
        return []
    from ..ops.grouped_linear import GroupedLinear
    from ..ops.linear import BasicLinear
    from ..ops.quantize import Quantize

    lines = [f"fp8 ({type(recipe).__name__}, format {recipe.fp8_format}):"]
    for i, op in enumerate(ops):
        name = f"[{i}] {type(op).__name__}"
        if isinstance(op, Quantize):
            what = []
            if op.quantize_forward:
                what.append(f"casts its input ({_fmt(recipe, 'input')}); the next linear reads it as it is")
            if op.quantize_backward:
                what.append(f"casts its output gradient ({_fmt(recipe, 'grad_output')})")
            lines.append(f"  {name}: " + ("; ".join(what) or "does nothing (forward=False, backward=False)"))
        elif isinstance(op, BasicLinear):
            prev = ops[i - 1] if i > 0 else None
            if isinstance(prev, Quantize) and prev.quantize_forward:
                src = f"input already FP8 from Quantize [{i - 1}] (no cast here)"
            elif i - 1 in producers:
                how = _HOW[_mode(recipe)]
                src = f"input written for it by the fused producer of [{i - 1}] {type(prev).__name__}: {how}"
            elif prev is None:
                src = (f"input: a Float8Tensor is used as it is, else a standalone cast ({_fmt(recipe, 'input')}) "
                       "in this op")
            else:
                src = (f"input: standalone cast ({_fmt(recipe, 'input')}) in this op; the producer "
                       f"[{i - 1}] {type(prev).__name__} does not write FP8 itself")
            extra = ""
            if isinstance(recipe, Float8BlockScaling) and (op.in_features % 512 or op.out_features % 512):
                extra = ("; on CUDA a 128x128-scaled GEMM with a reduction dim not a multiple of 512 runs as emulation "
                         "(dequantized fp32 matmul)")
            if i + 1 in grad_producers:
                grad = (f"output gradient ({_fmt(recipe, 'grad_output')}) written for it by the fused backward of "
                        f"[{i + 1}...]: " + ("a standalone cast after it" if _mode(recipe) == "cast" else
                                             "the amax in its pass, then one cast + transpose"))
            else:
                grad = f"output gradient: standalone cast ({_fmt(recipe, 'grad_output')}) in its backward"
            lines.append(f"  {name}: FP8 GEMMs; {src}; weight cast once per weight change (cache); {grad}{extra}")
        elif isinstance(op, GroupedLinear):
            if isinstance(recipe, Float8BlockScaling):
                lines.append(f"  {name}: block-scaled FP8 grouped GEMMs (1x128 tiles of input and output "
                             f"gradient, 128x128 blocks of each expert's weight); the weight gradient's column-wise "
                             f"copies are cast after padding every group to a multiple of 128 rows (no tile spans "
                             f"two experts); weight cast once per weight change (cache)")
            else:
                lines.append(f"  {name}: FP8 grouped GEMMs (one scale per tensor; all experts' weights share "
                             f"one); weight cast once per weight change (cache); inside the fused grouped MLP "
                             f"the FC1 + GLU pass takes the amax of FC2's input ({_fmt(recipe, 'input')}) and "
                             f"FC2's input-gradient + dGLU pass the amax of FC1's output gradient "
                             f"({_fmt(recipe, 'grad_output')}), each followed by one cast (both layouts); "
                             f"otherwise standalone casts of its input and output gradient")
    return lines


__all__ = ["fp8_lines"]

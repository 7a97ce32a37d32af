"""Basic ops (one file per family) and the Linear convenience op."""

from .activation import ACTIVATION_CLASSES, GEGLU, GELU, Activation, ReGLU, ReLU, ScaledSwiGLU, SiLU, SwiGLU
from .grouped_linear import GroupedLinear
from .linear import Bias, BasicLinear, Linear
from .misc import AddExtraInput, ConstantScale, Dropout, Identity, MakeExtraOutput, Reshape
from .norm import NORM_CLASSES, LayerNorm, RMSNorm
from .quantize import Quantize

__all__ = [
    "ACTIVATION_CLASSES", "Activation", "AddExtraInput", "BasicLinear", "Bias", "ConstantScale", "Dropout",
    "GEGLU", "GELU", "GroupedLinear", "Identity", "LayerNorm", "Linear", "MakeExtraOutput", "NORM_CLASSES",
    "Quantize", "RMSNorm", "ReGLU", "ReLU", "Reshape", "ScaledSwiGLU", "SiLU", "SwiGLU",
]

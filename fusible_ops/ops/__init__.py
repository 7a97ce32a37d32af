"""Basic ops (one file per family) and the Linear convenience op."""

from .activation import ACTIVATION_CLASSES, GEGLU, GELU, Activation, ReGLU, ReLU, ScaledSwiGLU, SiLU, SwiGLU
from .comm import COMM_CLASSES, AllGather, AllReduce, AllReduceGrad, ReduceScatter
from .grouped_linear import GroupedLinear
from .linear import Bias, BasicLinear, Linear
from .loss import CrossEntropy
from .misc import AddExtraInput, ConstantScale, Dropout, Identity, MakeExtraOutput, Reshape
from .moe import Combine, Dispatch, Router, Routing
from .norm import NORM_CLASSES, LayerNorm, RMSNorm
from .quantize import Quantize

__all__ = [
    "ACTIVATION_CLASSES", "Activation", "AddExtraInput", "AllGather", "AllReduce", "AllReduceGrad",
    "COMM_CLASSES", "BasicLinear", "Bias", "Combine", "ConstantScale", "CrossEntropy", "Dispatch", "Dropout", "Router", "Routing",
    "GEGLU", "GELU", "GroupedLinear", "Identity", "LayerNorm", "Linear", "MakeExtraOutput", "NORM_CLASSES",
    "Quantize", "RMSNorm", "ReGLU", "ReduceScatter", "ReLU", "Reshape", "ScaledSwiGLU", "SiLU", "SwiGLU",
]

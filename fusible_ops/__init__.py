"""fusible_ops: fusible PyTorch training ops.

Chain basic ops in a :class:`Sequential`; its fuser replaces runs of adjacent ops by fused ops
(declarative rules, see :func:`register_fusion`), all under one gradient contract
(:mod:`fusible_ops.grad`).
"""

# torch imports torch._dynamo lazily, at the first call of a function it wraps (a dispatch mode, as
# the replay recorder's, makes one). That import runs torch.fx.wrap, whose frame holds itself
# (inspect.currentframe() in a local): a reference cycle that keeps the whole calling stack, a
# model's forward and its parameters included, alive until the cyclic GC runs. Imported here,
# outside any call.
import torch._dynamo  # noqa: F401

from . import kernels
from .errors import check_errors, device_checks, set_device_checks
from .fuser import OperationFuser
from . import fuser_routing, replay  # (built on the fuser: importing them registers their plan extensions)
from .grad import delayed_wgrad, flush_wgrad
from .graphs import make_graphed_callables
from .op import BasicOperation, FusedOperation, FusibleOperation, OperationContext
from .ops import (
    GEGLU, GELU, AddExtraInput, AllGather, AllReduce, AllReduceGrad, BasicLinear, Bias, ConstantScale, CrossEntropy,
    Dropout,
    GroupedLinear, Identity, LayerNorm,
    Linear, MakeExtraOutput, Quantize, ReduceScatter, ReGLU, ReLU, Reshape, RMSNorm, ScaledSwiGLU, SiLU, SwiGLU,
    Combine, Dispatch, Router,  # MoE routing (ops/moe.py)
)
from . import quantization
from .quantization import Float8BlockScaling, Float8CurrentScaling, Float8DelayedScaling, Float8Tensor, autocast
from .rules import FusionContext, RuleSet, match, register_fusion
from .sequential import Sequential
from . import training_state, tuning
from .tuning import tune
from . import fusion_rules, rules  # noqa: E402
from . import parallel  # noqa: E402
from .convert import convert  # noqa: E402  (the function; the package stays importable: from fusible_ops.convert import ...)

rules.install_builtin(fusion_rules.BUILTIN_RULES)

__version__ = "0.1.0"

__all__ = [
    "AddExtraInput", "AllGather", "AllReduce", "AllReduceGrad", "BasicLinear", "Float8BlockScaling",
    "Float8CurrentScaling", "Float8DelayedScaling",
    "Float8Tensor", "Quantize", "autocast", "quantization", "BasicOperation", "Bias", "ConstantScale", "CrossEntropy",
    "Dropout", "FusedOperation",
    "FusibleOperation", "FusionContext", "GEGLU", "GELU", "GroupedLinear", "Identity", "LayerNorm", "Linear",
    "MakeExtraOutput", "OperationContext", "OperationFuser", "ReGLU", "ReLU", "ReduceScatter", "Reshape", "RMSNorm", "RuleSet",
    "ScaledSwiGLU", "SiLU", "Sequential", "SwiGLU", "check_errors", "delayed_wgrad", "device_checks", "flush_wgrad", "fusion_rules", "kernels", "make_graphed_callables",
    "match", "parallel", "register_fusion", "set_device_checks", "fuser_routing", "replay",
    "Combine", "Dispatch", "Router", "training_state", "tune", "tuning", "convert",
]

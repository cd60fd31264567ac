"""tensor_ops for torch: every op as torch.ops.tensor_ops.<name> (fake
kernels for torch.compile, autograd through our backward kernels), drop-in
modules, prepare_model / validate_model, and the backend factory API.

Imported on demand only: `import tensor_ops` does not import torch."""
from .custom_ops import FUNCTIONS, OPS
from .factory import (
    Backend, BackendFactory, BackendType, detect_best_backend, get_backend, list_available_backends, optimize_for_training,
)
from .functional import (
    add_rms_norm, attention, attention_backward, cross_entropy, cross_entropy_with_grad, geglu, geglu_backward,
    gelu, gelu_backward, layer_norm, layer_norm_backward, linear, log_softmax, log_softmax_backward, rms_norm,
    rms_norm_backward, rope, rope_backward, silu, silu_backward, softmax, softmax_backward, swiglu, swiglu_backward,
)
from .modules import GELU, Attention, HFRMSNorm, LayerNorm, Linear, RMSNorm, SiLU, SwiGLU
from .prepare import (
    OptimizationLevel, OptimizationResult, ValidationResult, prepare_model, validate_model,
)
from .flash_attention import FlashAttention, FlashAttention3, scaled_dot_product_attention
from .linear_cross_entropy import FusedLinearCrossEntropyLoss, fused_linear_cross_entropy
from .fused_linear import (FusedLinearGELU, FusedLinearSiLU, FusingSequential, linear_activation,
                           prepare_model_with_custom_kernels)
from tensor_ops import BackendUnavailableError, DeviceInfo


def __getattr__(name: str):
    if name == "Conv1D":  # transformers' Conv1D on our linear kernel, made on first use (modules.conv1d_class)
        from .modules import conv1d_class

        return conv1d_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "OPS", "FUNCTIONS", "Backend", "BackendFactory", "BackendType", "detect_best_backend", "get_backend",
    "list_available_backends", "optimize_for_training", "DeviceInfo", "BackendUnavailableError",
    "add_rms_norm", "attention", "attention_backward", "cross_entropy", "cross_entropy_with_grad", "geglu",
    "geglu_backward", "gelu", "gelu_backward", "layer_norm", "layer_norm_backward", "linear", "log_softmax",
    "log_softmax_backward", "rms_norm", "rms_norm_backward", "rope", "rope_backward", "silu", "silu_backward",
    "softmax", "softmax_backward", "swiglu", "swiglu_backward",
    "GELU", "Attention", "HFRMSNorm", "LayerNorm", "Linear", "RMSNorm", "SiLU", "SwiGLU",
    "OptimizationLevel", "OptimizationResult", "ValidationResult", "prepare_model", "validate_model",
    "FlashAttention", "FlashAttention3", "scaled_dot_product_attention",
    "FusedLinearGELU", "FusedLinearSiLU", "FusingSequential", "linear_activation", "prepare_model_with_custom_kernels",
    "FusedLinearCrossEntropyLoss", "fused_linear_cross_entropy",
]

"""Names for the op signatures' types (for editors and mypy)."""
from __future__ import annotations

from typing import Any, Literal

# A numpy array, torch tensor, tensor_ops.Tensor or any DLPack producer; an
# op returns the caller's kind of array. Any: the frameworks share no type.
Array = Any
Approximate = Literal["none", "tanh"]
CausalAlignment = Literal["bottom_right", "top_left"]
Reduction = Literal["mean", "sum", "none"]

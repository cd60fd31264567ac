"""A -inf (masked) column has probability exactly 0, as in torch, and a
column far below the row's max (e^x under float's normal range) is 0 too,
at every ISA level (the vectorised e^x once returned e^-86.5 = 2.7e-38)."""
import numpy as np
import pytest

import tensor_ops

ml_dtypes = pytest.importorskip("ml_dtypes")
DTYPES = (np.float32, np.float16, ml_dtypes.bfloat16)


@pytest.mark.parametrize("isa", tensor_ops._C.cpu_supported_isas())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [3, 8, 17, 64, 1000])
def test_masked_columns_are_exactly_zero(isa, dtype, cols):
    rng = np.random.default_rng(cols)
    x = rng.standard_normal((5, cols)).astype(np.float32)
    x[:, 1::3] = -np.inf
    x[:, 2::5] = -200.0  # e^(x - max) far below float's normal range
    with tensor_ops.use("cpu"):
        tensor_ops._C.cpu_set_isa(isa)
        try:
            y = np.asarray(tensor_ops.softmax(x.astype(dtype)), dtype=np.float64)
        finally:
            tensor_ops._C.cpu_set_isa("auto")
    assert (y[:, 1::3] == 0).all(), y[:, 1::3]
    assert (y[:, 2::5] == 0).all(), y[:, 2::5]
    ref = np.exp(x - x.max(-1, keepdims=True))
    ref /= ref.sum(-1, keepdims=True)
    np.testing.assert_allclose(y, ref, rtol=2e-2 if dtype is not np.float32 else 1e-5, atol=1e-6)

"""The check the emulator's shape scripts share: an op on an emulated GPU
backend against the CPU backend, and two runs for the same bits. Test code."""
import numpy as np

import tensor_ops as to


def against_cpu(backend, what, fn, close, problems):
    """fn() on the CPU backend and twice on `backend`: every output (a tuple's
    items; None outputs skipped) within close(got, ref) -> (ok, max error),
    and the two runs bit for bit the same. Appends what is wrong to problems."""
    with to.use("cpu"):
        ref = fn()
    with to.use(backend):
        got, again = fn(), fn()
    ref, got, again = ((r,) if not isinstance(r, tuple) else r for r in (ref, got, again))
    for i, (g, r, g2) in enumerate(zip(got, ref, again)):
        if r is None:
            continue
        ok, err = close(g, r)
        if not ok:
            problems.append(f"{backend} {what} output {i}: max error {err:.3g}")
        if np.asarray(g).tobytes() != np.asarray(g2).tobytes():
            problems.append(f"{backend} {what} output {i}: two runs differ")

#!/usr/bin/env python3
"""The sticky bad-index flag of the emulated cuda / hip plugins (cuda/common.cuh,
BadIndexFlag): rope and cross-entropy do not wait for their kernel; a bad
position or target is reported by the next copy or synchronize on the device.
With host arrays that is the copy of the call's own output, so the call
raises; with tensors resident on the device the call returns and the next
copy (Tensor.numpy()) raises, once; the device stays usable.

    python3 tests/gpu_emulation/bad_index_sticky.py [--backends cuda,hip]
(with the emulated plugins on TENSOR_OPS_PLUGIN_PATH, as .ci/gpu_emulation runs it)
"""
import argparse
import sys

import numpy as np

import tensor_ops as to


def expect_raise(what, match, fn, problems):
    try:
        fn()
    except to.InvalidArgumentError as e:
        if match not in str(e):
            problems.append(f"{what}: raised {e!r}, without {match!r}")
        return
    except Exception as e:  # noqa: BLE001 (any other kind is the failure reported)
        problems.append(f"{what}: raised {type(e).__name__}: {e} instead of InvalidArgumentError")
        return
    problems.append(f"{what}: did not raise")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="cuda,hip")
    a = ap.parse_args()
    usable = {b.name for b in to.backends() if b.usable}
    problems = []
    x = np.arange(8, dtype=np.float32).reshape(1, 2, 1, 4)
    cos, sin = np.ones((3, 2), np.float32), np.zeros((3, 2), np.float32)
    bad_pos, good_pos = np.array([[0, 5]], np.int64), np.array([[0, 2]], np.int64)
    logits, bad_t, good_t = np.zeros((2, 3), np.float32), np.array([0, 7], np.int64), np.array([0, 2], np.int64)
    for b in a.backends.split(","):
        if b not in usable:
            problems.append(f"{b}: not usable")
            continue
        dev = f"{b}:0"
        with to.use(b):
            # Host arrays: the copy back of the call's output reports it.
            expect_raise(f"{b} rope, host arrays", "position is outside the cos/sin tables [0, 3)",
                         lambda: to.rope(x, cos, sin, bad_pos), problems)
            expect_raise(f"{b} cross_entropy, host arrays", "target is outside [0, 3)",
                         lambda: to.cross_entropy(logits, bad_t, reduction="none"), problems)
            if not np.array_equal(to.rope(x, cos, sin, good_pos), x):
                problems.append(f"{b}: rope after a reported bad position is wrong")
        # Resident tensors: the call returns, the next copy reports, once.
        xd, cd, sd = (to.from_numpy(t, device=dev) for t in (x, cos, sin))
        try:
            y = to.rope(xd, cd, sd, to.from_numpy(bad_pos, device=dev))
        except Exception as e:  # noqa: BLE001
            problems.append(f"{b} rope, resident tensors: the call raised ({e}); it should not wait for the kernel")
        else:
            expect_raise(f"{b} rope, resident tensors, the next copy", "position", y.numpy, problems)
        y = to.rope(xd, cd, sd, to.from_numpy(good_pos, device=dev))
        if not np.array_equal(y.numpy(), x):
            problems.append(f"{b}: a copy after the report raised again or the result is wrong")
    print(f"bad_index_sticky: {a.backends}: {'ok' if not problems else 'failed'}")
    if problems:
        print("\n".join(problems), file=sys.stderr)
        sys.exit(f"bad_index_sticky: {len(problems)} problem(s)")


if __name__ == "__main__":
    main()

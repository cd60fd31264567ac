"""pytest plugin for the emulated GPU backends (-p pytest_emu, with this
directory on PYTHONPATH): keeps only the conformance tests that run on a
`target` (tests/python/conftest.py) and only the targets named in
TENSOR_OPS_EMU_TARGETS (default "cuda,hip"), and fails the session when one
of those targets is not usable, so a plugin that did not load can never pass
as "nothing to run"."""
import os

import pytest

EMULATED = [t for t in os.environ.get("TENSOR_OPS_EMU_TARGETS", "cuda,hip").split(",") if t]


def pytest_configure(config):
    import tensor_ops

    usable = {b.name: b for b in tensor_ops.backends()}
    for name in EMULATED:
        b = usable.get(name)
        if b is None or not b.usable:
            raise pytest.UsageError(
                f"emulated backend {name!r} is not usable: "
                f"{getattr(b, 'reason', 'not found') if b else 'not found'} "
                "(is TENSOR_OPS_PLUGIN_PATH set to the emulated plugin's directory?)"
            )


def pytest_collection_modifyitems(config, items):
    keep, drop = [], []
    for item in items:
        spec = getattr(item, "callspec", None)
        target = spec.params.get("target") if spec else None
        (keep if target is not None and target[1] in EMULATED else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep

"""Where the installed package keeps its C/C++ SDK, for outside CMake projects:
``cmake -Dtensor_ops_DIR=$(python -m tensor_ops --cmake-dir)`` (or
``CMAKE_PREFIX_PATH``), then ``find_package(tensor_ops CONFIG REQUIRED)`` and
``target_link_libraries(app PRIVATE tensor_ops::tensor_ops)``."""
from __future__ import annotations

from pathlib import Path

from . import _C

# The installed files lie beside the compiled module (in an editable install
# that is site-packages, not the source tree this file is in).
_PACKAGE = Path(_C.__file__).parent


def cmake_dir() -> str:
    """The folder of tensor_opsConfig.cmake in the installed package."""
    return str(_PACKAGE / "lib" / "cmake" / "tensor_ops")


def get_include() -> str:
    """The folder holding tensor_ops/tensor_ops.h (the C ABI), the C++ API and plugin.h."""
    return str(_PACKAGE / "include")

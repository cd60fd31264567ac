"""Strided 2-D views into a tensor_ops.Tensor's device memory, as DLPack
producers: how strided device data reaches the GPU kernels (the halves of a
fused [N, 2H] projection from torch CUDA tensors, say). Without a GPU no
framework hands us such views, and tensor_ops.Tensor has no slicing, so the
emulator's checks make their own. Test code."""
import ctypes

import numpy as np


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]
_capsule = ctypes.pythonapi.PyCapsule_New
_capsule.restype = ctypes.py_object
_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_keep = _DELETER(lambda p: None)  # the view's memory belongs to `base`, kept alive by the view
_CODES = {"float32": (2, 32, 4), "float16": (2, 16, 2), "bfloat16": (4, 16, 2)}  # kDLFloat, kDLBfloat
_DL_TYPES = {"cuda": 2, "hip": 10}  # kDLCUDA, kDLROCM


class DeviceView:
    """base (a tensor_ops.Tensor on a GPU backend) seen from element `offset`
    as `shape` with element `strides`."""

    def __init__(self, base, offset, shape, strides, dtype):
        self.base, self.shape, self.dtype = base, tuple(shape), dtype
        backend, dev = base.device.split(":")
        self.device = (_DL_TYPES[backend], int(dev))
        code, bits, item = _CODES[dtype]
        self._shape = (ctypes.c_int64 * len(shape))(*shape)
        self._strides = (ctypes.c_int64 * len(strides))(*strides)
        self._m = _DLManagedTensor(
            _DLTensor(base.data_ptr + offset * item, _DLDevice(*self.device), len(shape), _DLDataType(code, bits, 1),
                      self._shape, self._strides, 0), None, _keep)

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, stream=None, **kwargs):
        return _capsule(ctypes.addressof(self._m), b"dltensor", None)


def halves(base, rows, cols, dtype, lo=0):
    """Columns [lo, lo + cols) and [cols, 2 cols - lo) of a [rows, 2 cols] base: two strided views."""
    n = cols - lo
    return (DeviceView(base, lo, (rows, n), (2 * cols, 1), dtype),
            DeviceView(base, cols, (rows, n), (2 * cols, 1), dtype))


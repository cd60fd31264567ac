"""Arrays in, the caller's kind of array out.

numpy arrays, torch tensors (any device) and any other DLPack producer reach
the core zero-copy. Outputs are allocated with the caller's framework, so a
torch tensor in gives a torch tensor out and numpy gives numpy.
"""
from __future__ import annotations

import math
import os
import sys

import numpy as np

from . import _C
from .errors import ArgumentTypeError, DTypeError, InvalidArgumentError, LayoutError, UnsupportedError

_BF16_NAME = "bfloat16"


def is_bf16(dt) -> bool:
    """ml_dtypes' bfloat16 (a 'V'-kind numpy dtype). dtype.name is computed
    in Python by numpy (~1-3 us a read), so it stays off the per-call path."""
    return dt.kind == "V" and dt.type.__name__ == _BF16_NAME


def _torch():
    return sys.modules.get("torch")


def is_torch(x) -> bool:
    t = _torch()
    return t is not None and isinstance(x, t.Tensor)


# Note [DLPack streams]
# Device data with streams (CUDA, ROCm) is read on one stream per op call: the
# caller's. For torch tensors that is torch's current stream on their device,
# for cupy arrays cupy's; otherwise the stream set for this thread on the
# device (memory.use_stream), else the default. Each device input and output
# is imported with __dlpack__(stream=<that stream>), so its producer makes the
# stream wait for its pending work (the DLPack spec: 1 is CUDA's legacy default
# stream, 0 ROCm's), and the core runs the kernels on it. Exports
# (memory.Tensor.__dlpack__) do the converse with consumer_stream below.

# DLPack device types whose data is ordered by streams, and their backends.
_KDL_CUDA, _KDL_ROCM, _KDL_CUDA_MANAGED = 2, 10, 13
STREAM_BACKENDS = {_KDL_CUDA: "cuda", _KDL_CUDA_MANAGED: "cuda", _KDL_ROCM: "hip"}


def dlpack_stream(dl_type: int, handle: int) -> int:
    """The __dlpack__(stream=...) value naming stream `handle` (0: the default)."""
    if handle == 0:
        return 0 if dl_type == _KDL_ROCM else 1
    return handle


def consumer_stream(dl_type: int, stream):
    """The stream handle a DLPack consumer's __dlpack__(stream=...) names, 0
    for the default stream, or None when it asks for no synchronisation (-1).
    Raises for values the spec does not allow on that device type."""
    if stream is not None and (isinstance(stream, bool) or not isinstance(stream, int)):
        raise TypeError(f"__dlpack__: stream must be an int or None, got {type(stream).__name__}")
    if stream == -1:
        return None
    if dl_type not in STREAM_BACKENDS:
        if stream is None:
            return None
        raise InvalidArgumentError(
            f"__dlpack__: stream={stream} for data on DLPack device type {dl_type}, which has no streams; "
            "pass stream=None (or -1)"
        )
    if stream is None:
        return 0  # the legacy default stream on CUDA, the default on ROCm
    if dl_type == _KDL_ROCM:
        if stream in (1, 2):
            raise InvalidArgumentError(
                f"__dlpack__: stream={stream} is a CUDA sentinel; ROCm takes None or 0 (the default stream), "
                "-1 or a hipStream_t"
            )
        if stream < 0:
            raise InvalidArgumentError(f"__dlpack__: stream={stream} is not a ROCm stream")
        return stream
    if stream == 0:
        raise InvalidArgumentError(
            "__dlpack__: stream=0 is ambiguous on CUDA and the DLPack spec disallows it; "
            "pass 1 (legacy default stream), 2 (per-thread default stream), -1 or a cudaStream_t"
        )
    if stream < 0:
        raise InvalidArgumentError(f"__dlpack__: stream={stream} is not a CUDA stream")
    return 0 if stream == 1 else stream  # 2 stays cudaStreamPerThread, a valid handle


def stream_device(value, kind: str):
    """(DLPack device type, device id) of device data ordered by streams, else None."""
    if kind == "torch":
        if not value.is_cuda:  # ROCm builds of torch call their GPUs cuda too
            return None
        t = _torch()
        return (_KDL_ROCM if getattr(t.version, "hip", None) else _KDL_CUDA), value.device.index or 0
    if kind == "dlpack":
        try:
            dl_type, dev_id = value.__dlpack_device__()
        except (AttributeError, TypeError):
            return None
        return (int(dl_type), int(dev_id)) if int(dl_type) in STREAM_BACKENDS else None
    return None


def _framework_stream(value, kind: str, dev_id: int):
    """The framework's current stream for value's device (a handle), or None."""
    if kind == "torch":
        t = _torch()
        return int(t.cuda.current_stream(dev_id).cuda_stream)
    cupy = sys.modules.get("cupy")
    if cupy is not None and (type(value).__module__ or "").startswith("cupy"):
        with cupy.cuda.Device(dev_id):
            return int(cupy.cuda.get_current_stream().ptr)
    return None


# numpy dtypes the core reads: the float types, and int32 / int64 indices.
# uint16 is not among them: it is how the core gets bfloat16 bits, so a real
# uint16 array would be read as bfloat16 beside a bfloat16 peer.
_NUMPY_KINDS = {"f": (2, 4), "i": (4, 8)}


def check_numpy_dtype(dt, name: str) -> None:
    """Raises DTypeError naming dt unless the core can read it: native byte
    order float16 / float32 / int32 / int64, or ml_dtypes' bfloat16."""
    if is_bf16(dt):
        return
    if dt.fields is not None or dt.subdtype is not None:
        raise DTypeError(f"{name} has the structured dtype {dt}; tensor_ops takes float32, float16 or bfloat16 "
                         "arrays (int32 or int64 for indices)")
    if dt.itemsize in _NUMPY_KINDS.get(dt.kind, ()):
        if not dt.isnative:
            raise DTypeError(f"{name} has the byte-swapped dtype {dt.str} ({dt.name}, non-native byte order); "
                             f"convert it with .astype({dt.name!r})")
        return
    hint = "; a uint16 array is not read as bfloat16: use ml_dtypes.bfloat16" if dt == np.uint16 else ""
    raise DTypeError(f"{name} has dtype {dt} ({dt.str}); tensor_ops takes float32, float16 or bfloat16 arrays "
                     f"(int32 or int64 for indices){hint}")


def check_torch(t, name: str):
    """t as the core may read it: lazy negation / conjugation resolved (Note
    [lazy torch state] in convert.cpp), layouts the core cannot read refused."""
    torch = _torch()
    if t.is_meta or type(t).__name__ in ("FakeTensor", "FunctionalTensor"):
        what = "on the meta device" if t.is_meta else f"a {type(t).__name__} (tracing)"
        raise UnsupportedError(f"{name} is {what}: shape {tuple(t.shape)}, dtype {t.dtype}, no data to run on; "
                               f"tensor_ops' array ops need real data (tensor_ops.torch's ops and modules have "
                               f"meta / fake kernels for tracing and torch.compile)")
    if t.layout is not torch.strided:
        raise UnsupportedError(f"{name}: torch tensors with layout {t.layout} are not supported "
                               f"(shape {tuple(t.shape)}, dtype {t.dtype}); pass {name}.to_dense()")
    if t.is_nested:
        raise UnsupportedError(f"{name}: nested torch tensors are not supported (dtype {t.dtype}); "
                               f"pass {name}.to_padded_tensor(0.0)")
    if t.is_quantized:
        raise DTypeError(f"{name}: quantized torch tensors ({t.dtype}) are not supported; dequantize first")
    if t.is_neg() or t.is_conj():
        t = t.resolve_neg().resolve_conj()
    return t


def check_out(o, name: str = "out"):
    """Refuses outputs whose contents torch would not read back as written,
    or that would silently cut the autograd graph."""
    if isinstance(o, np.ndarray):
        if o.dtype == np.uint16:
            raise DTypeError(f"{name} has dtype uint16 (shape {o.shape}); a bfloat16 output must be an "
                             "ml_dtypes.bfloat16 array")
        check_numpy_dtype(o.dtype, name)
    elif is_torch(o):
        if o.requires_grad:
            raise InvalidArgumentError(f"{name}= does not support automatic differentiation, but {name} "
                                       f"(shape {tuple(o.shape)}, dtype {o.dtype}) requires grad")
        if o.is_inference() and not _torch().is_inference_mode_enabled():
            raise InvalidArgumentError(f"{name} (shape {tuple(o.shape)}, dtype {o.dtype}) is an inference tensor "
                                       "and inference mode is off: torch refuses to update it in place (clone it "
                                       "first, or call under torch.inference_mode())")
        if o.is_neg() or o.is_conj():
            raise InvalidArgumentError(f"{name} (shape {tuple(o.shape)}, dtype {o.dtype}) has the negative or "
                                       "conjugate bit set: writing into a lazy view would store negated values")
        check_torch(o, name)


class Arg:
    """One array argument as the core sees it."""

    __slots__ = ("kind", "array", "bf16_view", "original")

    def __init__(self, value, name: str):
        self.original = value
        if isinstance(value, np.ndarray):
            self.kind = "numpy"
            if is_bf16(value.dtype):  # ml_dtypes.bfloat16: pass the bits
                self.array, self.bf16_view = value.view(np.uint16), True
            else:
                check_numpy_dtype(value.dtype, name)
                self.array, self.bf16_view = value, False
        elif isinstance(value, _C.Tensor):
            self.kind = "tensor_ops"
            self.array, self.bf16_view = value, False
        elif is_torch(value):
            self.kind = "torch"
            self.array = check_torch(value.detach() if value.requires_grad else value, name)
            self.bf16_view = False
        elif hasattr(value, "__dlpack__"):
            self.kind = "dlpack"
            self.array, self.bf16_view = value, False
        else:
            raise ArgumentTypeError(
                f"{name} must be an array (numpy.ndarray, torch.Tensor or a DLPack producer), "
                f"got {type(value).__name__}"
            )

    def contiguous(self):
        if self.kind == "tensor_ops":
            return  # always contiguous
        if self.kind == "torch":
            self.array = self.array.contiguous()
        elif self.kind == "numpy":
            # ascontiguousarray hands back a contiguous array as it is, even
            # one whose start is not element-aligned (np.frombuffer at an odd
            # offset): the core refuses that, so it is copied too.
            a = self.array
            self.array = np.ascontiguousarray(a) if a.flags.aligned else a.copy()
        else:
            self.kind = "numpy"
            self.array = np.ascontiguousarray(np.from_dlpack(self.array))


def empty_like(arg: Arg, shape=None, dtype: str | None = None):
    """A contiguous output in arg's framework and on arg's device: arg's shape
    and dtype unless given (dtype as a name: "float32", "int64", ...). For a
    DLPack producer on a GPU (CuPy, JAX, ...) that is a tensor_ops.Tensor on
    the same device (itself a DLPack producer); on the CPU a numpy array."""
    a = arg.original if arg.kind == "numpy" else arg.array
    if arg.kind == "dlpack":
        where = stream_device(a, "dlpack")
        if where is not None:  # GPU data (CuPy, JAX on a GPU, ...): a tensor_ops.Tensor on that device
            shape = tuple(a.shape) if shape is None else tuple(shape)
            return _C.empty(list(shape), dtype or str(a.dtype), f"{STREAM_BACKENDS[where[0]]}:{where[1]}")
        a = np.from_dlpack(a)
    shape = tuple(a.shape) if shape is None else tuple(shape)
    if arg.kind == "tensor_ops":
        return _C.empty(list(shape), dtype or a.dtype, a.device)
    if arg.kind == "torch":
        t = _torch()
        dt = getattr(t, dtype) if dtype else a.dtype
        big = math.prod(shape) * dt.itemsize >= POOL_OUTPUT_BYTES
        if big and a.is_cpu and dt in (t.float32, t.float16, t.bfloat16):  # see POOL_OUTPUT_BYTES
            return _pooled_torch(t, shape, dt)
        if dtype is None and shape == tuple(a.shape):  # ~1.2 us against ~1.8 us for t.empty(...)
            return t.empty_like(a, memory_format=t.contiguous_format)
        return t.empty(shape, dtype=dt, device=a.device)
    dt = np.dtype(dtype) if dtype else a.dtype
    if dt in FAST_NP and math.prod(shape) * dt.itemsize >= POOL_OUTPUT_BYTES:
        return _pooled_numpy(shape, dt)
    return np.empty(shape, dtype=dt)


def native(value):
    """The array the core reads for an output or extra argument (numpy
    bfloat16 as its uint16 bits)."""
    if isinstance(value, np.ndarray) and is_bf16(value.dtype):
        return value.view(np.uint16)
    return value


def _kind(value) -> str:
    if is_torch(value):
        return "torch"
    if not isinstance(value, (np.ndarray, _C.Tensor)) and hasattr(value, "__dlpack__"):
        return "dlpack"
    return "other"


class _Streams:
    """The stream of one op call on device data with streams (Note [DLPack
    streams]); inactive (no cost) for host data, numpy and tensor_ops.Tensor."""

    __slots__ = ("device", "dl_type", "handle")

    def __init__(self, args: list, outs: list):
        self.device = None
        first = next((a for a in args if a is not None), None)
        if first is None or first.kind not in ("torch", "dlpack") or (first.kind == "torch" and not first.array.is_cuda):
            return
        where = stream_device(first.array, first.kind)
        if where is None:
            return
        self.dl_type, dev_id = where
        self.device = f"{STREAM_BACKENDS[self.dl_type]}:{dev_id}"
        handle = None
        for value, kind in [(a.array, a.kind) for a in args if a is not None] + [(o, _kind(o)) for o in outs]:
            if kind in ("torch", "dlpack") and stream_device(value, kind) == where:
                handle = _framework_stream(value, kind, dev_id)
                if handle is not None:
                    break
        self.handle = _C._current_stream(self.device) if handle is None else handle

    def export(self, value, kind: str):
        """value as the core should get it: device data with streams as a
        capsule made for our stream, anything else as it is."""
        if self.device is None or kind not in ("torch", "dlpack") or stream_device(value, kind) is None:
            return value
        return value.__dlpack__(stream=dlpack_stream(self.dl_type, self.handle))

    def call(self, fn, ins: list, outs: list, extra, bf16: bool):
        if self.device is None:
            return fn(*ins, *outs, *extra, bf16=bf16)
        ins = [None if v is None else self.export(v, _kind(v)) for v in ins]
        outs = [None if o is None else self.export(o, _kind(o)) for o in outs]
        previous = _C._exchange_stream(self.device, self.handle)
        try:
            return fn(*ins, *outs, *extra, bf16=bf16)
        finally:
            _C._exchange_stream(self.device, previous)


def run(fn, args: list[Arg], outs: list, *extra):
    """fn(*inputs, *outputs, *extra, bf16=...) with a contiguous retry for
    strided inputs; outputs must be writable."""
    bf16 = any(a.bf16_view for a in args if a is not None) or any(
        isinstance(o, np.ndarray) and is_bf16(o.dtype) for o in outs if o is not None
    )
    for o in outs:
        if isinstance(o, np.ndarray) and not o.flags.writeable:
            raise InvalidArgumentError(f"output is a read-only numpy array (shape {o.shape}, dtype {o.dtype})")
        if o is not None:
            check_out(o, "output")
    outs_n = [native(o) for o in outs]
    streams = _Streams(args, outs_n)
    try:
        streams.call(fn, [a.array if a is not None else None for a in args], outs_n, extra, bf16)
    except LayoutError:
        for a in args:
            if a is not None:
                a.contiguous()
        streams.call(fn, [a.array if a is not None else None for a in args], outs_n, extra, bf16)


def bump_version(t) -> None:
    """Counts an in-place write into the torch tensor t (torch's version
    counter, as its own in-place ops): a graph that saved t then refuses to
    backpropagate through stale values instead of using what we wrote."""
    if is_torch(t):
        bump_torch_version(t)


_increment_version = None  # torch._C._increment_version as bump_torch_version calls it, set on first use


def bump_torch_version(t) -> None:
    """bump_version for t known to be a torch tensor: torch._C's
    _increment_version, which takes a tuple of tensors from torch 2.5 and one
    tensor in torch 2.4 (torch.autograd.graph.increment_version hides the
    difference at ~0.3 us more per call: the out= fast lane pays this one)."""
    global _increment_version
    if _increment_version is None:
        torch = _torch()
        bump = torch._C._increment_version
        try:
            bump((torch.empty(0),))
            _increment_version = bump
        except (TypeError, RuntimeError):  # torch 2.4
            _increment_version = lambda ts: bump(ts[0])  # noqa: E731
    _increment_version((t,))


def call(fn, args: list[Arg], out, *extra):
    """Runs fn(*arrays, out_array, *extra), copying strided inputs the core
    cannot take as they are (a correct answer beats a refusal)."""
    bf16 = any(a.bf16_view for a in args if a is not None)
    if isinstance(out, np.ndarray) and not out.flags.writeable:
        raise InvalidArgumentError(f"out is a read-only numpy array (shape {out.shape}, dtype {out.dtype})")
    check_out(out)
    out_arr = out.view(np.uint16) if isinstance(out, np.ndarray) and is_bf16(out.dtype) else out
    if bf16 and not (isinstance(out_arr, np.ndarray) and out_arr.dtype == np.uint16):
        raise DTypeError("a numpy bfloat16 input needs a numpy bfloat16 out")
    if not bf16 and isinstance(out_arr, np.ndarray) and out_arr is not out:
        raise DTypeError("out is bfloat16 but the inputs are not")
    streams = _Streams(args, [out_arr])
    try:
        streams.call(fn, [None if a is None else a.array for a in args], [out_arr], extra, bf16)
    except LayoutError:
        for a in args:
            if a is not None:
                a.contiguous()
        try:
            streams.call(fn, [None if a is None else a.array for a in args], [out_arr], extra, bf16)
        except LayoutError:
            # A strided out the backend cannot write in place (OpenCL / SYCL stage whole
            # tensors): written through a contiguous buffer, then copied into out.
            tmp = _dense_like(out_arr)
            if tmp is None:
                raise
            streams.call(fn, [None if a is None else a.array for a in args], [tmp], extra, bf16)
            if isinstance(out_arr, np.ndarray):
                out_arr[...] = tmp
            else:
                out_arr.copy_(tmp)
    bump_version(out)
    return out


def _dense_like(o):
    """A contiguous array like the output o (numpy or torch) when o is
    row-strided (rows in order with gaps between them, each row dense: what
    the CPU writes in place; a staging backend cannot), else None (a
    contiguous o, a transposed, overlapping or other layout: refused as before)."""
    if isinstance(o, np.ndarray):
        if o.flags.c_contiguous:
            return None
        shape, strides = o.shape, tuple(st // o.itemsize for st in o.strides)
        if any(st * o.itemsize != b for st, b in zip(strides, o.strides)):
            return None
        make = lambda: np.empty(o.shape, o.dtype)  # noqa: E731
    elif is_torch(o):
        if o.is_contiguous():
            return None
        shape, strides = tuple(o.shape), o.stride()
        make = lambda: o.new_empty(o.shape)  # noqa: E731
    else:
        return None
    if not shape or strides[-1] != 1 and shape[-1] > 1:
        return None
    inner = shape[-1]
    for n, st in zip(reversed(shape[:-1]), reversed(strides[:-1])):
        if n > 1 and st < inner:  # overlapping or out of order
            return None
        inner = st * n if n > 1 else inner
    return make()


# numpy dtypes of the fast lane (_optable.invoke): no bfloat16 view needed.
FAST_NP = (np.dtype(np.float32), np.dtype(np.float16))


# Outputs from this size up come from the host memory pool (a numpy array or
# torch tensor viewing a pool block, returned to the pool when it dies).
# glibc serves allocations past 32 MiB with a fresh mmap each time, and the
# kernel then pays a page fault per page it writes: tensor_ops.softmax on a
# float32 4096x4096 array took 15.8 ms with np.empty, 8.8 ms with a pooled
# output. Below 32 MiB malloc reuses freed memory and is faster than the pool.
POOL_OUTPUT_BYTES = 32 << 20


def _pooled_numpy(shape, dt):
    """A numpy array of shape and dtype dt (float32 / float16) on a host pool block."""
    return _C.empty(list(shape), dt.name, "cpu")._host_bits().view(dt)


def _pooled_torch(torch, shape, dt):
    """A CPU torch tensor of shape and float dtype dt on a host pool block."""
    return torch.from_dlpack(_C.empty(list(shape), str(dt)[len("torch."):], "cpu"))


def fast_out(x):
    """An output like x for the fast path, or None when x does not qualify."""
    t = type(x)
    if t is np.ndarray:
        if x.dtype not in FAST_NP:
            return None
        if x.nbytes < POOL_OUTPUT_BYTES:
            return np.empty(x.shape, x.dtype)
        return _pooled_numpy(x.shape, x.dtype)
    if t.__name__ == "Tensor" and t.__module__ == "torch" and not x.requires_grad and x.is_cpu:
        torch = sys.modules["torch"]
        if x.layout is not torch.strided or x.is_nested:
            return None  # the general path words the refusal
        if x.nbytes >= POOL_OUTPUT_BYTES and x.dtype in (torch.float32, torch.float16, torch.bfloat16):
            return _pooled_torch(torch, x.shape, x.dtype)
        # empty_like: ~1.2 us against new_empty's ~2.8 us (strides kept for
        # a dense permuted input: a layout the core refuses takes the general path)
        return torch.empty_like(x)
    return None


# torch.Tensor and nn.Parameter once torch is imported (filled by
# note_torch(): torch may be imported after tensor_ops).
TORCH_TYPES = set()


class _NoDualLevel:
    _current_level = -1


# [torch.autograd.forward_ad] once torch is noted: its _current_level is the
# dual level, -1 outside one (the op routing's torch lane reads it: Note
# [forward-mode AD])
FORWARD_AD: list = [_NoDualLevel]


def note_torch() -> None:
    """Record torch's plain tensor types (tensor_ops.torch and the op
    routing call this; a no-op until torch is imported)."""
    torch = sys.modules.get("torch")
    if torch is not None and not TORCH_TYPES:
        FORWARD_AD[0] = torch.autograd.forward_ad
        TORCH_TYPES.update((torch.Tensor, torch.nn.Parameter))
        use_torch_openmp()


def use_torch_openmp() -> bool:
    """Runs the CPU pool's parallel regions on torch's OpenMP threads (Note
    [torch's OpenMP threads], cpp/cpu/thread_pool.cpp): torch's workers spin
    after each of its ops, and ours lost their core to them. True when on;
    off with TENSOR_OPS_TORCH_OPENMP=0, or when torch's libgomp is not found
    (only torch's own copy is used, never another OpenMP runtime)."""
    if os.environ.get("TENSOR_OPS_TORCH_OPENMP", "1").strip() == "0" or "torch" not in sys.modules:
        return False
    if _C.cpu_uses_openmp():
        return True
    addr, max_threads = _torch_gomp()
    if addr:
        _C.cpu_set_openmp(addr, max_threads)
    return bool(addr)


def _torch_gomp() -> tuple[int, int]:
    """The addresses of GOMP_parallel and omp_get_max_threads in the libgomp
    torch loaded (torch/lib/), or zeros. The second keeps our regions' teams
    within torch.set_num_threads (Note [team size], thread_pool.cpp)."""
    import ctypes

    torch_dir = os.path.dirname(os.path.abspath(sys.modules["torch"].__file__))
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line}
    except OSError:
        return 0, 0
    for path in sorted(p for p in paths if p.startswith(torch_dir + os.sep)):
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            gomp = int(ctypes.cast(lib.GOMP_parallel, ctypes.c_void_p).value or 0)
        except (OSError, AttributeError):
            continue
        try:
            max_threads = int(ctypes.cast(lib.omp_get_max_threads, ctypes.c_void_p).value or 0)
        except AttributeError:
            max_threads = 0
        return gomp, max_threads
    return 0, 0

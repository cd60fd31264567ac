#include "convert.h"

#include <nanobind/stl/string.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <vector>

#include "tensor_ops/errors.h"
#include "tensor_ops/stream.h"

namespace nb = nanobind;

namespace tensor_ops::python {
namespace {

std::string dl_dtype_name(nb::dlpack::dtype d) {
  std::string base;
  switch (nb::dlpack::dtype_code(d.code)) {
    case nb::dlpack::dtype_code::Int: base = "int"; break;
    case nb::dlpack::dtype_code::UInt: base = "uint"; break;
    case nb::dlpack::dtype_code::Float: base = "float"; break;
    case nb::dlpack::dtype_code::Bfloat: base = "bfloat"; break;
    case nb::dlpack::dtype_code::Complex: base = "complex"; break;
    case nb::dlpack::dtype_code::Bool: return "bool";
    default: base = "code" + std::to_string(int(d.code)) + "_"; break;
  }
  return base + std::to_string(int(d.bits)) + (d.lanes > 1 ? "x" + std::to_string(int(d.lanes)) : "");
}

Device device_of(const nb::ndarray<nb::ro>& a, const char* arg) {
  const int32_t id = a.device_id();
  switch (a.device_type()) {
    case nb::device::cpu::value:
    case nb::device::cuda_host::value:
    case nb::device::rocm_host::value: return Device{"host", 0};
    case nb::device::cuda::value:
    case nb::device::cuda_managed::value: return Device{"cuda", id};
    case nb::device::rocm::value: return Device{"hip", id};
    case nb::device::opencl::value: return Device{"opencl", id};
    case nb::device::oneapi::value: return Device{"sycl", id};
    default:
      throw InvalidArgument(std::string(arg) + " lives on DLPack device type " + std::to_string(a.device_type()) +
                            ", which tensor_ops cannot reach");
  }
}

}  // namespace

// The core's dtype for a DLPack dtype (as_bfloat16: uint16 holds bfloat16
// bits); false for one the core lacks.
bool core_dtype(nb::dlpack::dtype d, bool as_bfloat16, DType& dt) {
  if (d.lanes != 1) return false;
  const auto code = nb::dlpack::dtype_code(d.code);
  if (code == nb::dlpack::dtype_code::Float && d.bits == 32) dt = DType::Float32;
  else if (code == nb::dlpack::dtype_code::Float && d.bits == 16) dt = DType::Float16;
  else if (code == nb::dlpack::dtype_code::Bfloat && d.bits == 16) dt = DType::BFloat16;
  else if (as_bfloat16 && code == nb::dlpack::dtype_code::UInt && d.bits == 16) dt = DType::BFloat16;
  else if (code == nb::dlpack::dtype_code::Int && d.bits == 32) dt = DType::Int32;
  else if (code == nb::dlpack::dtype_code::Int && d.bits == 64) dt = DType::Int64;
  else return false;
  return true;
}

Tensor to_tensor(const nb::ndarray<nb::ro>& a, const char* arg, bool as_bfloat16) {
  const nb::dlpack::dtype d = a.dtype();
  DType dt;
  if (!core_dtype(d, as_bfloat16, dt))
    throw DTypeError(std::string(arg) + " has dtype " + dl_dtype_name(d) +
                     "; tensor_ops ops take float32, float16 or bfloat16 data (int32 or int64 for indices)");
  std::vector<int64_t> shape(a.ndim()), strides(a.ndim());
  for (size_t i = 0; i < a.ndim(); ++i) {
    shape[i] = a.shape(i);
    strides[i] = a.stride(i);
  }
  return Tensor(const_cast<void*>(a.data()), dt, std::move(shape), std::move(strides), device_of(a, arg));
}

namespace {

// torch's CPU tensors read directly (data_ptr, shape, stride): about 1 us
// instead of the ~3 us torch spends producing a DLPack capsule. Anything
// else (other devices, other dtypes) takes the DLPack path.
struct TorchTypes {
  PyObject* tensor = nullptr;
  PyObject* f32 = nullptr;
  PyObject* f16 = nullptr;
  PyObject* bf16 = nullptr;
  PyObject* i32 = nullptr;
  PyObject* i64 = nullptr;
  PyObject* strided = nullptr;
  PyObject* parameter = nullptr;  // torch.nn.Parameter, or nullptr
};

// Note [lazy torch state]
// torch tensors may carry state applied only when torch reads them: the
// negative and conjugate bits (z.conj().imag, torch._neg_view), and layouts
// whose data_ptr is not the values (sparse, nested). Reading the memory as it
// is would give a silently wrong answer. The bits raise LayoutError, which the
// op layer answers by resolving them (a copy) before the call; the layouts
// raise UnsupportedError.
// The four reads go through torch's own descriptors, cached, for exactly
// torch.Tensor and nn.Parameter (no attribute lookup: ~4x cheaper); any other
// subclass may override them and is asked by name.
struct LazyStateReaders {
  PyObject* layout = nullptr;     // getset descriptors of torch._C.TensorBase
  PyObject* is_nested = nullptr;
  PyObject* is_neg = nullptr;     // method descriptors
  PyObject* is_conj = nullptr;
};

const LazyStateReaders* lazy_state_readers() {
  static const LazyStateReaders readers = [] {
    LazyStateReaders r;
    PyObject* c = PyDict_GetItemString(PyImport_GetModuleDict(), "torch._C");
    PyObject* base = c ? PyObject_GetAttrString(c, "TensorBase") : nullptr;  // kept for the process
    PyObject* dict = base ? PyObject_GetAttrString(base, "__dict__") : nullptr;
    if (dict) {
      r.layout = PyMapping_GetItemString(dict, "layout");
      r.is_nested = PyMapping_GetItemString(dict, "is_nested");
      r.is_neg = PyMapping_GetItemString(dict, "is_neg");
      r.is_conj = PyMapping_GetItemString(dict, "is_conj");
    }
    PyErr_Clear();
    const bool ok = r.layout && Py_TYPE(r.layout)->tp_descr_get && r.is_nested && Py_TYPE(r.is_nested)->tp_descr_get &&
                    r.is_neg && r.is_conj;
    return ok ? r : LazyStateReaders{};
  }();
  return readers.layout ? &readers : nullptr;
}

nb::object read_getset(PyObject* descr, nb::handle h) {
  PyObject* v = Py_TYPE(descr)->tp_descr_get(descr, h.ptr(), reinterpret_cast<PyObject*>(Py_TYPE(h.ptr())));
  if (!v) throw nb::python_error();
  return nb::steal(v);
}

bool call_flag(PyObject* method, nb::handle h) {
  PyObject* v = PyObject_CallOneArg(method, h.ptr());
  if (!v) throw nb::python_error();
  const bool set = v == Py_True;
  Py_DECREF(v);
  return set;
}

bool refuse_lazy_torch_state_fast(nb::handle h, PyObject* strided) {
  const LazyStateReaders* r = lazy_state_readers();
  if (!r) return false;
  nb::object layout = read_getset(r->layout, h);
  if (layout.ptr() != strided)
    throw Unsupported("torch tensors with layout " + std::string(nb::str(layout).c_str()) +
                      " are not supported; pass a dense tensor (x.to_dense())");
  if (read_getset(r->is_nested, h).ptr() == Py_True)
    throw Unsupported("nested torch tensors are not supported; pass a dense tensor (x.to_padded_tensor(0.0))");
  // The conjugate bit exists only on complex tensors (torch asserts it), and
  // no op takes a complex dtype: the dtype check refuses those (after a
  // resolve_conj() as well), so only the negative bit is asked here, one
  // method call instead of two on every tensor of every call.
  if (call_flag(r->is_neg, h))
    throw LayoutError("a torch tensor with the negative or conjugate bit set (a lazy view) must be resolved "
                      "first (x.resolve_neg().resolve_conj())");
  return true;
}

void refuse_lazy_torch_state(nb::handle h, PyObject* strided) {
  nb::object layout = h.attr("layout");
  if (layout.ptr() != strided)
    throw Unsupported("torch tensors with layout " + std::string(nb::str(layout).c_str()) +
                      " are not supported; pass a dense tensor (x.to_dense())");
  if (nb::cast<bool>(h.attr("is_nested")))
    throw Unsupported("nested torch tensors are not supported; pass a dense tensor (x.to_padded_tensor(0.0))");
  if (nb::cast<bool>(h.attr("is_neg")()) || nb::cast<bool>(h.attr("is_conj")()))
    throw LayoutError("a torch tensor with the negative or conjugate bit set (a lazy view) must be resolved "
                      "first (x.resolve_neg().resolve_conj())");
}

const TorchTypes* torch_types() {
  static TorchTypes types;  // references kept for the process (torch is never unloaded)
  if (types.tensor) return &types;
  PyObject* modules = PyImport_GetModuleDict();
  PyObject* torch = PyDict_GetItemString(modules, "torch");
  if (!torch) return nullptr;
  nb::handle t(torch);
  if (!nb::hasattr(t, "Tensor") || !nb::hasattr(t, "bfloat16")) return nullptr;
  types.f32 = nb::object(t.attr("float32")).release().ptr();
  types.f16 = nb::object(t.attr("float16")).release().ptr();
  types.bf16 = nb::object(t.attr("bfloat16")).release().ptr();
  types.i32 = nb::object(t.attr("int32")).release().ptr();
  types.i64 = nb::object(t.attr("int64")).release().ptr();
  types.strided = nb::object(t.attr("strided")).release().ptr();
  PyObject* nn = PyDict_GetItemString(modules, "torch.nn.parameter");
  if (nn) {
    PyObject* p = PyObject_GetAttrString(nn, "Parameter");  // kept for the process
    if (!p) PyErr_Clear();
    types.parameter = p;
  }
  types.tensor = nb::object(t.attr("Tensor")).release().ptr();
  return &types;
}

// Note [DLPack exchange API]
// torch (2.10 on) publishes DLPack's C exchange table on its tensor type,
// `__dlpack_c_exchange_api__` (a capsule named "dlpack_exchange_api"; the
// layout is the DLPack 1.x specification's DLPackExchangeAPI, declared here
// from the specification). Its dltensor_from_py_object_no_sync fills a
// non-owning DLTensor from the tensor in one C call, in place of five Python
// attribute calls (is_cpu, dtype, shape, stride(), data_ptr()). It does not
// look at torch's lazy state (the negative bit is ignored, a sparse tensor
// crashes it), so refuse_lazy_torch_state runs first; and it is used only on
// exactly torch.Tensor and nn.Parameter, whose data is real (a subclass such
// as FakeTensor takes the attribute path).
struct ManagedVersioned {  // DLManagedTensorVersioned
  uint32_t major, minor;
  void* manager_ctx;
  void (*deleter)(ManagedVersioned* self);
  uint64_t flags;
  nb::dlpack::dltensor dl_tensor;
};

struct ExchangeApi {
  uint32_t major, minor;  // DLPackVersion
  void* prev_api;
  int (*managed_tensor_allocator)(nb::dlpack::dltensor* prototype, ManagedVersioned** out, void* error_ctx,
                                  void (*set_error)(void* error_ctx, const char* kind, const char* message));
  void* managed_tensor_from_py_object_no_sync;
  int (*managed_tensor_to_py_object_no_sync)(ManagedVersioned* tensor, void** out_py_object);
  int (*dltensor_from_py_object_no_sync)(void* py_object, nb::dlpack::dltensor* out);
  void* current_work_stream;
};

const ExchangeApi* exchange_api(PyObject* tensor_type) {
  static const ExchangeApi* api = [&]() -> const ExchangeApi* {
    PyObject* cap = PyObject_GetAttrString(tensor_type, "__dlpack_c_exchange_api__");
    if (!cap) {
      PyErr_Clear();
      return nullptr;
    }
    auto* a = static_cast<const ExchangeApi*>(PyCapsule_GetPointer(cap, "dlpack_exchange_api"));
    if (!a) PyErr_Clear();
    // The capsule stays referenced: the table must outlive every use.
    return a && a->major == 1 && a->dltensor_from_py_object_no_sync && a->managed_tensor_allocator &&
                   a->managed_tensor_to_py_object_no_sync
               ? a
               : nullptr;
  }();
  return api;
}

// A DLTensor's strides in elements (NULL strides: compact row-major over shape).
std::vector<int64_t> strides_of(const nb::dlpack::dltensor& dl, const std::vector<int64_t>& shape) {
  if (dl.strides) return std::vector<int64_t>(dl.strides, dl.strides + dl.ndim);
  std::vector<int64_t> st(size_t(dl.ndim));
  int64_t s = 1;
  for (int i = dl.ndim - 1; i >= 0; --i) st[size_t(i)] = s, s *= shape[size_t(i)];
  return st;
}

bool read_exchange(nb::handle h, const ExchangeApi* api, Tensor& out, bool& cpu) {
  nb::dlpack::dltensor dl;
  if (api->dltensor_from_py_object_no_sync(h.ptr(), &dl) != 0) {
    PyErr_Clear();
    return false;  // the attribute path decides
  }
  cpu = dl.device.device_type == nb::device::cpu::value;
  if (!cpu) return true;
  DType d;
  if (!core_dtype(dl.dtype, false, d)) return cpu = false, true;
  std::vector<int64_t> sh(dl.shape, dl.shape + dl.ndim), st = strides_of(dl, sh);
  out = Tensor(static_cast<char*>(dl.data) + dl.byte_offset, d, std::move(sh), std::move(st), Device{"host", 0});
  return true;
}

bool torch_cpu_tensor(nb::handle h, Tensor& out) {
  const TorchTypes* tt = torch_types();
  if (!tt || !PyObject_TypeCheck(h.ptr(), reinterpret_cast<PyTypeObject*>(tt->tensor))) return false;
  PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(h.ptr()));
  const bool exact = type == tt->tensor || type == tt->parameter;
  if (!exact || !refuse_lazy_torch_state_fast(h, tt->strided)) refuse_lazy_torch_state(h, tt->strided);
  if (exact) {
    if (const ExchangeApi* api = exchange_api(tt->tensor)) {
      bool cpu = false;
      if (read_exchange(h, api, out, cpu)) return cpu;
    }
  }
  if (!nb::cast<bool>(h.attr("is_cpu"))) return false;
  nb::object dt = h.attr("dtype");
  DType d;
  if (dt.ptr() == tt->f32) d = DType::Float32;
  else if (dt.ptr() == tt->f16) d = DType::Float16;
  else if (dt.ptr() == tt->bf16) d = DType::BFloat16;
  else if (dt.ptr() == tt->i32) d = DType::Int32;
  else if (dt.ptr() == tt->i64) d = DType::Int64;
  else return false;
  nb::tuple shape = nb::cast<nb::tuple>(h.attr("shape"));
  nb::tuple stride = nb::cast<nb::tuple>(h.attr("stride")());
  std::vector<int64_t> sh(shape.size()), st(stride.size());
  for (size_t i = 0; i < sh.size(); ++i) sh[i] = nb::cast<int64_t>(shape[i]);
  for (size_t i = 0; i < st.size(); ++i) st[i] = nb::cast<int64_t>(stride[i]);
  void* data = reinterpret_cast<void*>(nb::cast<uintptr_t>(h.attr("data_ptr")()));
  out = Tensor(data, d, std::move(sh), std::move(st), Device{"host", 0});
  return true;
}

// numpy arrays (exactly numpy.ndarray) through the buffer protocol: about
// 0.3 us less per array than nanobind's import, which asks numpy for a
// DLPack capsule. Unusual formats (byte-swapped, strides that are not whole
// elements, dtypes the core lacks) return false: the general path decides
// (and words the error).
bool numpy_array(nb::handle h, Tensor& out, bool as_bfloat16) {
  static PyTypeObject* ndarray = [] {
    PyObject* np = PyDict_GetItemString(PyImport_GetModuleDict(), "numpy");
    PyObject* t = np ? PyObject_GetAttrString(np, "ndarray") : nullptr;  // kept for the process
    if (!t) PyErr_Clear();
    return reinterpret_cast<PyTypeObject*>(t);
  }();
  if (!ndarray || Py_TYPE(h.ptr()) != ndarray) return false;
  Py_buffer view;
  if (PyObject_GetBuffer(h.ptr(), &view, PyBUF_RECORDS_RO) != 0) {
    PyErr_Clear();
    return false;
  }
  DType d;
  bool ok = view.format && view.format[0] && !view.format[1];
  if (ok) {
    switch (view.format[0]) {
      case 'f': d = DType::Float32, ok = view.itemsize == 4; break;
      case 'e': d = DType::Float16, ok = view.itemsize == 2; break;
      case 'H': d = DType::BFloat16, ok = as_bfloat16 && view.itemsize == 2; break;
      case 'i': d = DType::Int32, ok = view.itemsize == 4; break;
      case 'l':
      case 'q': d = DType::Int64, ok = view.itemsize == 8; break;
      default: ok = false;
    }
  }
  std::vector<int64_t> sh(size_t(view.ndim)), st(size_t(view.ndim));
  for (int i = 0; ok && i < view.ndim; ++i) {
    sh[size_t(i)] = view.shape[i];
    ok = view.strides[i] % view.itemsize == 0;
    st[size_t(i)] = view.strides[i] / view.itemsize;
  }
  void* data = view.buf;
  PyBuffer_Release(&view);  // the array itself stays referenced by the caller
  if (!ok) return false;
  out = Tensor(data, d, std::move(sh), std::move(st), Device{"host", 0});
  return true;
}

void set_alloc_error(void*, const char* kind, const char* message) {
  PyErr_Format(PyExc_MemoryError, "%s: %s", kind ? kind : "allocation failed", message ? message : "");
}

// Outputs at or above this size come from the core's pool in the Python
// layer (_arrays.POOL_OUTPUT_BYTES: fewer page faults than torch's allocator).
constexpr int64_t kPoolOutputBytes = int64_t(32) << 20;

}  // namespace

// Note [outputs made in C++]
// An op called with torch tensors and no out= needs a new tensor per output:
// torch.empty_like from Python costs about as much as a small kernel. Made
// here through the exchange API's allocator (torch's own allocator, a plain
// row-major tensor), it costs one C call. Anything else (numpy, other
// frameworks, large outputs, torch without the exchange API) is refused with
// LayoutError, which the Python layer answers by allocating the output itself.
Tensor output(nb::handle out, nb::handle like, const Tensor& tlike, const char* arg, bool as_bfloat16,
              nb::object& made) {
  if (!out.is_none()) return to_tensor(out, arg, as_bfloat16);
  return output(out, like, tlike, tlike.shape(), tlike.dtype(), arg, as_bfloat16, made);
}

Tensor output(nb::handle out, nb::handle like, const Tensor& tlike, std::vector<int64_t> shape, DType dtype,
              const char* arg, bool as_bfloat16, nb::object& made) {
  if (!out.is_none()) return to_tensor(out, arg, as_bfloat16);
  const TorchTypes* tt = torch_types();
  PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(like.ptr()));
  const ExchangeApi* api = tt && (type == tt->tensor || type == tt->parameter) ? exchange_api(tt->tensor) : nullptr;
  int64_t bytes = int64_t(dtype_size(dtype));
  for (int64_t d : shape) bytes *= d;
  if (!api || !tlike.device().is_host() || bytes >= kPoolOutputBytes)
    throw LayoutError(std::string(arg) + ": no output given, and none is made here for this input");
  nb::dlpack::dltensor proto;
  proto.device = {int32_t(nb::device::cpu::value), 0};
  proto.ndim = int32_t(shape.size());
  proto.dtype = dl_dtype(dtype);
  proto.shape = shape.data();
  ManagedVersioned* mt = nullptr;
  if (api->managed_tensor_allocator(&proto, &mt, nullptr, set_alloc_error) != 0 || !mt) throw nb::python_error();
  nb::dlpack::dltensor& dl = mt->dl_tensor;
  std::vector<int64_t> st = strides_of(dl, shape);
  Tensor t(static_cast<char*>(dl.data) + dl.byte_offset, dtype, std::move(shape), std::move(st), Device{"host", 0});
  void* py = nullptr;
  if (api->managed_tensor_to_py_object_no_sync(mt, &py) != 0 || !py) throw nb::python_error();  // mt is torch's now
  made = nb::steal(static_cast<PyObject*>(py));
  return t;
}

Tensor to_tensor(nb::handle h, const char* arg, bool as_bfloat16) {
  sync_scope();  // every op reads its arrays here first, with the GIL (Note [use() per context])
  if (nb::isinstance<Tensor>(h)) return nb::cast<const Tensor&>(h);
  Tensor t;
  if (numpy_array(h, t, as_bfloat16)) return t;
  if (torch_cpu_tensor(h, t)) return t;
  nb::ndarray<nb::ro> a;
  if (!nb::try_cast(h, a))
    throw DTypeError(std::string(arg) + " of type " + nb::inst_name(h).c_str() +
                     " is not an array tensor_ops can read (numpy, torch, DLPack or tensor_ops.Tensor)");
  return to_tensor(a, arg, as_bfloat16);
}

nb::dlpack::dtype dl_dtype(DType t) {
  switch (t) {
    case DType::Float32: return nb::dtype<float>();
    case DType::Float16: return nb::dlpack::dtype{uint8_t(nb::dlpack::dtype_code::Float), 16, 1};
    case DType::BFloat16: return nb::dlpack::dtype{uint8_t(nb::dlpack::dtype_code::Bfloat), 16, 1};
    case DType::Int32: return nb::dtype<int32_t>();
    case DType::Int64: return nb::dtype<int64_t>();
  }
  return nb::dtype<float>();
}

int32_t dl_device_type(const Device& d) {
  if (d.is_host()) return nb::device::cpu::value;
  if (d.backend == "cuda") return nb::device::cuda::value;
  if (d.backend == "hip") return nb::device::rocm::value;
  if (d.backend == "opencl") return nb::device::opencl::value;
  if (d.backend == "sycl") return nb::device::oneapi::value;
  // A plugin's own backend: exported as anything else, a consumer would
  // read device memory as something it is not.
  throw nb::buffer_error(("DLPack has no device type for backend '" + d.backend +
                          "': copy the tensor to the host first (tensor.to('cpu'))").c_str());
}

namespace {

// Note [DLPack capsule ownership]
// The protocol: the consumer takes the capsule's DLManagedTensor, renames
// the capsule "used_dltensor" and calls the deleter when done; a capsule
// that dies still named "dltensor" was never taken, and its destructor calls
// the deleter. Consumers that fail part-way break this: torch.from_dlpack of
// an OpenCL tensor calls the deleter (its error path) but leaves the name,
// so the capsule destructor freed the managed tensor a second time. Here the
// managed tensor lives in a context with two references, the capsule's and
// the deleter's: the deleter releases the data and its reference once (a
// flag the capsule can still read), the capsule destructor calls it only if
// it has not run and the capsule was not consumed, then drops its own.
struct ManagedTensor {  // DLPack's DLManagedTensor, field for field
  nb::dlpack::dltensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(ManagedTensor*);
};

struct ExportContext {
  ManagedTensor mt{};
  std::shared_ptr<void> owner;
  std::vector<int64_t> shape, strides;
  std::atomic<int> refs{2};
  std::atomic<bool> deleted{false};
};

void drop_ref(ExportContext* c) {
  if (c->refs.fetch_sub(1) == 1) delete c;
}

void managed_deleter(ManagedTensor* mt) {
  auto* c = static_cast<ExportContext*>(mt->manager_ctx);
  if (c->deleted.exchange(true)) return;
  c->owner.reset();
  drop_ref(c);
}

void capsule_destructor(PyObject* capsule) {
  const char* name = PyCapsule_GetName(capsule);
  auto* mt = static_cast<ManagedTensor*>(PyCapsule_GetPointer(capsule, name));
  if (!mt) {
    PyErr_Clear();
    return;
  }
  if (name && std::strcmp(name, "dltensor") == 0) managed_deleter(mt);
  drop_ref(static_cast<ExportContext*>(mt->manager_ctx));
}

}  // namespace

nb::object dlpack_capsule(const Tensor& t) {
  const int32_t device_type = dl_device_type(t.device());
  auto c = std::make_unique<ExportContext>();
  c->owner = t.owner();
  c->shape.assign(t.shape().begin(), t.shape().end());
  c->strides.assign(t.strides().begin(), t.strides().end());
  nb::dlpack::dltensor& dl = c->mt.dl_tensor;
  dl.data = static_cast<char*>(t.data()) + t.byte_offset();
  dl.device = {device_type, int32_t(t.device().id)};
  dl.ndim = int32_t(t.ndim());
  dl.dtype = dl_dtype(t.dtype());
  dl.shape = c->shape.data();
  dl.strides = c->strides.data();
  c->mt.manager_ctx = c.get();
  c->mt.deleter = managed_deleter;
  PyObject* capsule = PyCapsule_New(&c->mt, "dltensor", capsule_destructor);
  if (!capsule) throw nb::python_error();
  c.release();
  return nb::steal(capsule);
}

// Streams as the DLPack consumer / producer code in _arrays.py and memory.py
// uses them: handles are integers (a cudaStream_t's address, 0 the default).
namespace {

// "cuda:1", "hip" (device 0): a stream's device, named without asking the
// registry, so a stream can be set (and a DLPack producer asked for it)
// before the backend is known to be usable; the op itself says if it is not.
Device stream_device(const std::string& name) {
  const size_t colon = name.find(':');
  Device d{name.substr(0, colon), 0};
  if (colon != std::string::npos) {
    const std::string num = name.substr(colon + 1);
    if (num.empty() || num.size() > 6 || num.find_first_not_of("0123456789") != std::string::npos)
      throw InvalidArgument("bad device '" + name + "': expected 'backend' or 'backend:index'");
    d.id = std::stoi(num);
  }
  if (d.backend == "cpu") d.backend = "host";
  return d;
}

}  // namespace

void init_streams(nb::module_& m) {
  auto ptr = [](uintptr_t h) { return reinterpret_cast<void*>(h); };
  m.def(
      "_exchange_stream",
      [ptr](const std::string& device, uintptr_t stream) {
        return reinterpret_cast<uintptr_t>(exchange_stream(stream_device(device), ptr(stream)));
      },
      nb::arg("device"), nb::arg("stream"),
      "Makes `stream` the one this thread's ops on `device` run on; returns the previous one (0: the default).");
  m.def(
      "_current_stream",
      [](const std::string& device) { return reinterpret_cast<uintptr_t>(current_stream(stream_device(device))); },
      nb::arg("device"));
  m.def("_has_streams", [](const std::string& device) { return has_streams(stream_device(device)); },
        nb::arg("device"));
  m.def(
      "_stream_wait",
      [ptr](const std::string& device, uintptr_t consumer, uintptr_t producer) {
        stream_wait(stream_device(device), ptr(consumer), ptr(producer));
      },
      nb::arg("device"), nb::arg("consumer"), nb::arg("producer"),
      "Work queued later on `consumer` waits (on the device) for the work queued so far on `producer`.");
}

}  // namespace tensor_ops::python

// The C ABI (tensor_ops.h) over the C++ API: handles are checked against the
// set of live ones, every exception becomes a status plus a thread-local
// message, and every op goes through to_op_run (the typed functions pack
// their arguments for it), so there is one path to test and fuzz.
#include "tensor_ops/tensor_ops.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <new>
#include <shared_mutex>
#include <string>
#include <vector>
#include <unordered_set>

#include "tensor_ops/errors.h"
#include "tensor_ops/ops.h"
#include "tensor_ops/registry.h"

struct to_tensor_handle {
  tensor_ops::Tensor tensor;
};

namespace tensor_ops {
namespace {

static_assert(TO_OP_COUNT <= TENSOR_OPS_MAX_OPS, "op ids must fit the plugin table");

// Fixed storage: recording an error never allocates, so it cannot throw.
thread_local char last_error_text[4096];

void set_error(const char* message) { std::snprintf(last_error_text, sizeof(last_error_text), "%s", message); }

template <class F>
to_status guarded(F&& f) noexcept {
  try {
    f();
    last_error_text[0] = '\0';
    return TO_OK;
  } catch (const Error& e) {
    set_error(e.what());
    return e.status() == TO_OK ? TO_ERR_INTERNAL : e.status();
  } catch (const std::bad_alloc&) {
    set_error("out of host memory (std::bad_alloc)");
    return TO_ERR_OUT_OF_MEMORY;
  } catch (const std::exception& e) {
    std::snprintf(last_error_text, sizeof(last_error_text), "internal error: %s", e.what());
    return TO_ERR_INTERNAL;
  } catch (...) {
    set_error("internal error: unknown exception");
    return TO_ERR_INTERNAL;
  }
}

// The live handles. Leaked on purpose: a handle destroyed from another
// static destructor at exit still finds the set.
struct LiveHandles {
  std::shared_mutex mutex;
  std::unordered_set<const to_tensor_handle*> set;
};
LiveHandles& live() {
  static LiveHandles* h = new LiveHandles;
  return *h;
}

bool is_live(const to_tensor_handle* h) {
  LiveHandles& l = live();
  std::shared_lock<std::shared_mutex> lock(l.mutex);
  return l.set.count(h) != 0;
}

const Tensor* optional_tensor(to_tensor_h h, const char* fn, const char* arg) {
  if (!h) return nullptr;
  if (!is_live(h))
    throw InvalidArgument(std::string(fn) + ": " + arg +
                          " is not a live tensor handle (never created by to_tensor_create, or already destroyed)");
  return &h->tensor;
}

const Tensor& required_tensor(to_tensor_h h, const char* fn, const char* arg) {
  if (!h) throw InvalidArgument(std::string(fn) + ": " + arg + " is NULL");
  return *optional_tensor(h, fn, arg);
}

template <class T>
void require_out(T* p, const char* fn, const char* arg) {
  if (!p) throw InvalidArgument(std::string(fn) + ": " + arg + " is NULL");
}

void copy_out(char* buf, size_t len, const std::string& s, const char* fn) {
  require_out(buf, fn, "buf");
  if (len == 0) throw InvalidArgument(std::string(fn) + ": buf_len is 0");
  std::snprintf(buf, len, "%s", s.c_str());
  if (s.size() >= len)
    throw InvalidArgument(std::string(fn) + ": buffer of " + std::to_string(len) + " bytes is too small, need " +
                          std::to_string(s.size() + 1));
}

// "cpu", "host", "" or NULL: host memory; "<backend>[:<id>]" otherwise.
Device parse_device(const char* text) {
  if (!text || !*text) return {};
  const std::string s = text;
  const size_t colon = s.find(':');
  const std::string name = s.substr(0, colon);
  auto bad = [&](const std::string& why) {
    return InvalidArgument("to_tensor_create: device '" + s + "' " + why +
                           "; expected \"cpu\" or \"<backend>:<id>\" such as \"cuda:0\"");
  };
  if (name.empty()) throw bad("has no backend name");
  for (char c : name)
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_')) throw bad("has a bad backend name");
  int64_t id = 0;
  if (colon != std::string::npos) {
    const std::string digits = s.substr(colon + 1);
    if (digits.empty() || digits.size() > 9 || digits.find_first_not_of("0123456789") != std::string::npos)
      throw bad("has a bad device id");
    id = std::stoll(digits);
  }
  if (name == "cpu" || name == "host") {
    if (id != 0) throw bad("names a CPU device other than 0");
    return {};
  }
  // An unknown backend name is refused here, where the embedder made the tensor (it was accepted and
  // refused at the first op); a known backend that is not usable here is still a valid descriptor.
  const std::vector<std::string> known = Registry::instance().known_names();
  if (std::find(known.begin(), known.end(), name) == known.end()) {
    std::string names;
    for (const std::string& k : known) names += (names.empty() ? "" : ", ") + k;
    throw bad("names unknown backend '" + name + "' (valid backends: " + names + ")");
  }
  return Device{name, int32_t(id)};
}

// What to_op_run takes for each op; tensor names for messages.
struct OpSpec {
  int n_in, n_out, n_scalars, n_ints;
  int optional_in, optional_out;  // index of the optional tensor, -1 for none
  const char* in_names[TENSOR_OPS_MAX_OP_TENSORS];
  const char* out_names[TENSOR_OPS_MAX_OP_TENSORS];
};

constexpr OpSpec kSpecs[] = {
    /* rms_norm */ {2, 1, 1, 0, -1, -1, {"x", "weight"}, {"out"}},
    /* silu */ {1, 1, 0, 0, -1, -1, {"x"}, {"out"}},
    /* gelu */ {1, 1, 0, 1, -1, -1, {"x"}, {"out"}},
    /* layer_norm */ {3, 1, 1, 0, 2, -1, {"x", "weight", "bias"}, {"out"}},
    /* rms_norm_backward */ {3, 2, 1, 0, -1, -1, {"dy", "x", "weight"}, {"dx", "dweight"}},
    /* layer_norm_backward */ {3, 3, 1, 0, -1, 2, {"dy", "x", "weight"}, {"dx", "dweight", "dbias"}},
    /* add_rms_norm */ {3, 2, 1, 0, -1, -1, {"x", "residual", "weight"}, {"out", "residual_out"}},
    /* softmax */ {1, 1, 1, 2, -1, -1, {"x"}, {"out"}},
    /* softmax_backward */ {2, 1, 1, 1, -1, -1, {"dy", "y"}, {"dx"}},
    /* activation_backward */ {2, 1, 0, 1, -1, -1, {"dy", "x"}, {"dx"}},
    /* glu */ {2, 1, 0, 1, -1, -1, {"gate", "up"}, {"out"}},
    /* glu_backward */ {3, 2, 0, 1, -1, -1, {"dy", "gate", "up"}, {"dgate", "dup"}},
    /* rope */ {4, 1, 0, 2, -1, -1, {"x", "cos", "sin", "positions"}, {"out"}},
    /* attention */ {3, 2, 1, 1, -1, -1, {"q", "k", "v"}, {"out", "lse"}},
    /* attention_backward */ {6, 3, 1, 1, -1, -1, {"dout", "q", "k", "v", "out", "lse"}, {"dq", "dk", "dv"}},
    /* cross_entropy */ {2, 2, 1, 1, -1, 1, {"logits", "target"}, {"loss", "dlogits"}},
    /* linear */ {3, 1, 0, 0, 2, -1, {"x", "weight", "bias"}, {"out"}},
};

// The table must follow ops.def: one row per op, the same tensor counts.
constexpr int kDefCounts[][2] = {
#define TENSOR_OPS_OP(name, id, n_in, n_out) {n_in, n_out},
#include "tensor_ops/ops.def"
#undef TENSOR_OPS_OP
};
constexpr bool specs_follow_ops_def() {
  if (sizeof(kSpecs) / sizeof(kSpecs[0]) != TO_OP_COUNT) return false;
  for (int i = 0; i < TO_OP_COUNT; ++i)
    if (kSpecs[i].n_in != kDefCounts[i][0] || kSpecs[i].n_out != kDefCounts[i][1]) return false;
  return true;
}
static_assert(specs_follow_ops_def(), "kSpecs must have one row per op of ops.def, with its tensor counts");

void run_op(int32_t op_id, const to_tensor_h* inputs, int32_t n_inputs, const to_tensor_h* outputs,
            int32_t n_outputs, const double* scalars, int32_t n_scalars, const int64_t* ints, int32_t n_ints) {
  if (op_id < 0 || op_id >= TO_OP_COUNT)
    throw InvalidArgument("to_op_run: unknown op id " + std::to_string(op_id) + "; valid ids are 0 to " +
                          std::to_string(TO_OP_COUNT - 1));
  const OpId op = OpId(op_id);
  const OpSpec& s = kSpecs[op_id];
  const char* fn = op_name(op);
  auto counts = [&](const char* what, int32_t got, int want, const void* ptr) {
    if (got != want)
      throw InvalidArgument(std::string(fn) + " takes " + std::to_string(want) + " " + what + ", got " +
                            std::to_string(got));
    if (want > 0 && !ptr) throw InvalidArgument(std::string(fn) + ": " + what + " is NULL");
  };
  counts("inputs", n_inputs, s.n_in, inputs);
  counts("outputs", n_outputs, s.n_out, outputs);
  // cross_entropy takes grad_scale alone or with label_smoothing, z_loss, softcap;
  // rms_norm and its backward eps alone or with the weight offset.
  const bool ce_options = op == OpId::cross_entropy && n_scalars == 4;
  const bool norm_offset = (op == OpId::rms_norm || op == OpId::rms_norm_backward) && n_scalars == 2;
  counts("scalars", n_scalars, ce_options ? 4 : norm_offset ? 2 : s.n_scalars, scalars);
  // linear takes its weight layout or nothing (weight [N, K], as before the layout existed).
  const bool linear_layout = op == OpId::linear && n_ints == 1;
  counts("ints", n_ints, linear_layout ? 1 : s.n_ints, ints);
  const Tensor* in[TENSOR_OPS_MAX_OP_TENSORS] = {};
  const Tensor* out[TENSOR_OPS_MAX_OP_TENSORS] = {};
  for (int i = 0; i < s.n_in; ++i)
    in[i] = i == s.optional_in ? optional_tensor(inputs[i], fn, s.in_names[i])
                               : &required_tensor(inputs[i], fn, s.in_names[i]);
  for (int i = 0; i < s.n_out; ++i)
    out[i] = i == s.optional_out ? optional_tensor(outputs[i], fn, s.out_names[i])
                                 : &required_tensor(outputs[i], fn, s.out_names[i]);
  // The causal mode arrives as an int64: checked whole (int() kept the low 32 bits: 2^32 + 1 ran as 1).
  auto causal = [fn](int64_t v) {
    if (v < 0 || v > 2)
      throw InvalidArgument(std::string(fn) + ": causal must be 0 (none), 1 (bottom-right) or 2 (top-left), got " +
                            std::to_string(v));
    return int(v);
  };
  switch (op) {
    case OpId::rms_norm: rms_norm(*in[0], *in[1], *out[0], scalars[0], norm_offset ? scalars[1] : 0.0); break;
    case OpId::silu: silu(*in[0], *out[0]); break;
    case OpId::gelu: gelu(*in[0], *out[0], ints[0] ? "tanh" : "none"); break;
    case OpId::layer_norm: layer_norm(*in[0], *in[1], in[2], *out[0], scalars[0]); break;
    case OpId::rms_norm_backward:
      rms_norm_backward(*in[0], *in[1], *in[2], *out[0], *out[1], scalars[0], norm_offset ? scalars[1] : 0.0);
      break;
    case OpId::layer_norm_backward:
      layer_norm_backward(*in[0], *in[1], *in[2], *out[0], *out[1], out[2], scalars[0]);
      break;
    case OpId::add_rms_norm: add_rms_norm(*in[0], *in[1], *in[2], *out[0], *out[1], scalars[0]); break;
    case OpId::softmax: softmax(*in[0], *out[0], scalars[0], causal(ints[0]), ints[1] != 0); break;
    case OpId::softmax_backward: softmax_backward(*in[0], *in[1], *out[0], scalars[0], ints[0] != 0); break;
    case OpId::activation_backward:
      activation_backward(*in[0], *in[1], *out[0], Activation(ints[0]));
      break;
    case OpId::glu: glu(*in[0], *in[1], *out[0], Activation(ints[0])); break;
    case OpId::glu_backward:
      glu_backward(*in[0], *in[1], *in[2], *out[0], *out[1], Activation(ints[0]));
      break;
    case OpId::rope: rope(*in[0], *in[1], *in[2], *in[3], *out[0], ints[0] != 0, ints[1] != 0); break;
    case OpId::attention: attention(*in[0], *in[1], *in[2], *out[0], *out[1], causal(ints[0]), scalars[0]); break;
    case OpId::attention_backward:
      attention_backward(*in[0], *in[1], *in[2], *in[3], *in[4], *in[5], *out[0], *out[1], *out[2],
                         causal(ints[0]), scalars[0]);
      break;
    case OpId::cross_entropy:
      cross_entropy(*in[0], *in[1], *out[0], out[1], ints[0], scalars[0], ce_options ? scalars[1] : 0.0,
                    ce_options ? scalars[2] : 0.0, ce_options ? scalars[3] : 0.0);
      break;
    case OpId::linear:
      linear(*in[0], *in[1], in[2], *out[0], linear_layout ? WeightLayout(ints[0]) : WeightLayout::NK);
      break;
  }
}

BackendStatus backend_at(int32_t index, const char* fn) {
  const std::vector<BackendStatus> all = Registry::instance().status();
  if (index < 0 || size_t(index) >= all.size())
    throw InvalidArgument(std::string(fn) + ": index " + std::to_string(index) + " is outside [0, " +
                          std::to_string(all.size()) + ")");
  return all[size_t(index)];
}

template <size_t NI, size_t NO, size_t NS = 0, size_t NN = 0>
to_status run(to_op op, const to_tensor_h (&in)[NI], const to_tensor_h (&out)[NO],
              const double* scalars = nullptr, const int64_t* ints = nullptr) {
  return guarded([&] { run_op(op, in, NI, out, NO, scalars, NS, ints, NN); });
}

}  // namespace
}  // namespace tensor_ops

using namespace tensor_ops;

extern "C" {

uint32_t to_abi_version(void) { return TENSOR_OPS_C_ABI_VERSION; }

const char* to_last_error(void) { return last_error_text; }

const char* to_status_name(to_status status) {
  switch (status) {
    case TO_OK: return "TO_OK";
    case TO_ERR_INVALID_ARGUMENT: return "TO_ERR_INVALID_ARGUMENT";
    case TO_ERR_UNSUPPORTED: return "TO_ERR_UNSUPPORTED";
    case TO_ERR_BACKEND_UNAVAILABLE: return "TO_ERR_BACKEND_UNAVAILABLE";
    case TO_ERR_OUT_OF_MEMORY: return "TO_ERR_OUT_OF_MEMORY";
    case TO_ERR_DEVICE: return "TO_ERR_DEVICE";
    case TO_ERR_INTERNAL: return "TO_ERR_INTERNAL";
  }
  return "TO_ERR_UNKNOWN";
}

to_status to_tensor_create(void* data, int32_t dtype, int32_t ndim, const int64_t* shape, const int64_t* strides,
                           const char* device, to_tensor_h* out) {
  return guarded([&] {
    const char* fn = "to_tensor_create";
    require_out(out, fn, "out");
    *out = nullptr;
    if (dtype < TO_FLOAT32 || dtype > TO_INT64)
      throw DTypeError("to_tensor_create: dtype " + std::to_string(dtype) +
                       " is not a to_dtype (0 float32, 1 float16, 2 bfloat16, 3 int32, 4 int64)");
    if (ndim < 0 || ndim > TENSOR_OPS_MAX_DIMS)
      throw InvalidArgument("to_tensor_create: ndim " + std::to_string(ndim) + " is outside [0, " +
                            std::to_string(TENSOR_OPS_MAX_DIMS) + "]");
    if (ndim > 0) require_out(shape, fn, "shape");
    std::vector<int64_t> sh(shape, shape + ndim), st;
    if (strides) st.assign(strides, strides + ndim);
    auto* h = new to_tensor_handle{Tensor(data, DType(dtype), std::move(sh), std::move(st), parse_device(device))};
    LiveHandles& l = live();
    try {
      std::unique_lock<std::shared_mutex> lock(l.mutex);
      l.set.insert(h);
    } catch (...) {
      delete h;
      throw;
    }
    *out = h;
  });
}

to_status to_tensor_destroy(to_tensor_h tensor) {
  return guarded([&] {
    if (!tensor) return;
    LiveHandles& l = live();
    {
      std::unique_lock<std::shared_mutex> lock(l.mutex);
      if (l.set.erase(tensor) == 0)
        throw InvalidArgument(
            "to_tensor_destroy: not a live tensor handle (never created by to_tensor_create, or already destroyed)");
    }
    delete tensor;
  });
}

to_status to_tensor_info(to_tensor_h tensor, void** data, int32_t* dtype, int32_t* ndim, int64_t* shape,
                         int64_t* strides) {
  return guarded([&] {
    const Tensor& t = required_tensor(tensor, "to_tensor_info", "tensor");
    if (data) *data = t.data();
    if (dtype) *dtype = int32_t(t.dtype());
    if (ndim) *ndim = int32_t(t.ndim());
    for (size_t i = 0; i < t.shape().size(); ++i) {
      if (shape) shape[i] = t.shape()[i];
      if (strides) strides[i] = t.strides()[i];
    }
  });
}

to_status to_backend_count(int32_t* count) {
  return guarded([&] {
    require_out(count, "to_backend_count", "count");
    *count = int32_t(Registry::instance().status().size());
  });
}


to_status to_backend_name(int32_t index, char* buf, size_t buf_len) {
  return guarded([&] { copy_out(buf, buf_len, backend_at(index, "to_backend_name").name, "to_backend_name"); });
}

to_status to_backend_usable(int32_t index, int32_t* usable) {
  return guarded([&] {
    require_out(usable, "to_backend_usable", "usable");
    *usable = backend_at(index, "to_backend_usable").usable;
  });
}

to_status to_backend_reason(int32_t index, char* buf, size_t buf_len) {
  return guarded(
      [&] { copy_out(buf, buf_len, backend_at(index, "to_backend_reason").reason, "to_backend_reason"); });
}

to_status to_device_count(int32_t* count) {
  return guarded([&] {
    require_out(count, "to_device_count", "count");
    *count = int32_t(Registry::instance().devices().size());
  });
}

to_status to_device_get(int32_t index, char* backend, size_t backend_len, int32_t* device_id,
                        to_device_info* info) {
  return guarded([&] {
    const char* fn = "to_device_get";
    const std::vector<DeviceRecord> all = Registry::instance().devices();
    if (index < 0 || size_t(index) >= all.size())
      throw InvalidArgument(std::string(fn) + ": index " + std::to_string(index) + " is outside [0, " +
                            std::to_string(all.size()) + ")");
    const DeviceRecord& d = all[size_t(index)];
    if (backend) copy_out(backend, backend_len, d.backend, fn);
    if (device_id) *device_id = d.device_id;
    if (info) *info = d.info;
  });
}

to_status to_set_backend(const char* name) {
  return guarded([&] { Registry::instance().set_backend(name ? name : ""); });
}

to_status to_active_backend(char* buf, size_t buf_len) {
  return guarded([&] { copy_out(buf, buf_len, Registry::instance().active().name(), "to_active_backend"); });
}

int32_t to_op_count(void) { return TO_OP_COUNT; }

const char* to_op_name(int32_t op) { return op >= 0 && op < TO_OP_COUNT ? op_name(OpId(op)) : nullptr; }

to_status to_op_id(const char* name, int32_t* op) {
  return guarded([&] {
    require_out(name, "to_op_id", "name");
    require_out(op, "to_op_id", "op");
    for (int32_t i = 0; i < TO_OP_COUNT; ++i)
      if (std::strcmp(name, op_name(OpId(i))) == 0) {
        *op = i;
        return;
      }
    throw InvalidArgument(std::string("to_op_id: unknown op '") + name + "'");
  });
}

to_status to_op_run(int32_t op, const to_tensor_h* inputs, int32_t n_inputs, const to_tensor_h* outputs,
                    int32_t n_outputs, const double* scalars, int32_t n_scalars, const int64_t* ints,
                    int32_t n_ints) {
  return guarded([&] { run_op(op, inputs, n_inputs, outputs, n_outputs, scalars, n_scalars, ints, n_ints); });
}

to_status to_rms_norm(to_tensor_h x, to_tensor_h weight, to_tensor_h out, double eps) {
  return run<2, 1, 1>(TO_OP_rms_norm, {x, weight}, {out}, &eps);
}

to_status to_silu(to_tensor_h x, to_tensor_h out) { return run<1, 1>(TO_OP_silu, {x}, {out}); }

to_status to_gelu(to_tensor_h x, to_tensor_h out, int32_t approximate_tanh) {
  const int64_t ints[] = {approximate_tanh};
  return run<1, 1, 0, 1>(TO_OP_gelu, {x}, {out}, nullptr, ints);
}

to_status to_layer_norm(to_tensor_h x, to_tensor_h weight, to_tensor_h bias, to_tensor_h out, double eps) {
  return run<3, 1, 1>(TO_OP_layer_norm, {x, weight, bias}, {out}, &eps);
}

to_status to_rms_norm_backward(to_tensor_h dy, to_tensor_h x, to_tensor_h weight, to_tensor_h dx,
                               to_tensor_h dweight, double eps) {
  return run<3, 2, 1>(TO_OP_rms_norm_backward, {dy, x, weight}, {dx, dweight}, &eps);
}

to_status to_layer_norm_backward(to_tensor_h dy, to_tensor_h x, to_tensor_h weight, to_tensor_h dx,
                                 to_tensor_h dweight, to_tensor_h dbias, double eps) {
  return run<3, 3, 1>(TO_OP_layer_norm_backward, {dy, x, weight}, {dx, dweight, dbias}, &eps);
}

to_status to_add_rms_norm(to_tensor_h x, to_tensor_h residual, to_tensor_h weight, to_tensor_h out,
                          to_tensor_h residual_out, double eps) {
  return run<3, 2, 1>(TO_OP_add_rms_norm, {x, residual, weight}, {out, residual_out}, &eps);
}

to_status to_softmax(to_tensor_h x, to_tensor_h out, double scale, int32_t causal) {
  const int64_t ints[] = {causal, 0};
  return run<1, 1, 1, 2>(TO_OP_softmax, {x}, {out}, &scale, ints);
}

to_status to_log_softmax(to_tensor_h x, to_tensor_h out, double scale, int32_t causal) {
  const int64_t ints[] = {causal, 1};
  return run<1, 1, 1, 2>(TO_OP_softmax, {x}, {out}, &scale, ints);
}

to_status to_softmax_backward(to_tensor_h dy, to_tensor_h y, to_tensor_h dx, double scale, int32_t log) {
  const int64_t ints[] = {log};
  return run<2, 1, 1, 1>(TO_OP_softmax_backward, {dy, y}, {dx}, &scale, ints);
}

to_status to_activation_backward(to_tensor_h dy, to_tensor_h x, to_tensor_h dx, int32_t activation) {
  const int64_t ints[] = {activation};
  return run<2, 1, 0, 1>(TO_OP_activation_backward, {dy, x}, {dx}, nullptr, ints);
}

to_status to_glu(to_tensor_h gate, to_tensor_h up, to_tensor_h out, int32_t activation) {
  const int64_t ints[] = {activation};
  return run<2, 1, 0, 1>(TO_OP_glu, {gate, up}, {out}, nullptr, ints);
}

to_status to_swiglu(to_tensor_h gate, to_tensor_h up, to_tensor_h out) {
  return to_glu(gate, up, out, TO_ACTIVATION_SILU);
}

to_status to_glu_backward(to_tensor_h dy, to_tensor_h gate, to_tensor_h up, to_tensor_h dgate, to_tensor_h dup,
                          int32_t activation) {
  const int64_t ints[] = {activation};
  return run<3, 2, 0, 1>(TO_OP_glu_backward, {dy, gate, up}, {dgate, dup}, nullptr, ints);
}

to_status to_rope(to_tensor_h x, to_tensor_h cos, to_tensor_h sin, to_tensor_h positions, to_tensor_h out,
                  int32_t interleaved, int32_t inverse) {
  const int64_t ints[] = {interleaved, inverse};
  return run<4, 1, 0, 2>(TO_OP_rope, {x, cos, sin, positions}, {out}, nullptr, ints);
}

to_status to_attention(to_tensor_h q, to_tensor_h k, to_tensor_h v, to_tensor_h out, to_tensor_h lse,
                       int32_t causal, double scale) {
  const int64_t ints[] = {causal};
  return run<3, 2, 1, 1>(TO_OP_attention, {q, k, v}, {out, lse}, &scale, ints);
}

to_status to_attention_backward(to_tensor_h dout, to_tensor_h q, to_tensor_h k, to_tensor_h v, to_tensor_h out,
                                to_tensor_h lse, to_tensor_h dq, to_tensor_h dk, to_tensor_h dv, int32_t causal,
                                double scale) {
  const int64_t ints[] = {causal};
  return run<6, 3, 1, 1>(TO_OP_attention_backward, {dout, q, k, v, out, lse}, {dq, dk, dv}, &scale, ints);
}

to_status to_cross_entropy(to_tensor_h logits, to_tensor_h target, to_tensor_h loss, to_tensor_h dlogits,
                           int64_t ignore_index, double grad_scale) {
  const int64_t ints[] = {ignore_index};
  return run<2, 2, 1, 1>(TO_OP_cross_entropy, {logits, target}, {loss, dlogits}, &grad_scale, ints);
}

}  // extern "C"

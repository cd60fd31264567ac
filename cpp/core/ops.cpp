// Argument checks for every op (once, here) and dispatch to a backend.
#include "tensor_ops/ops.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "tensor_ops/device_memory.h"
#include "tensor_ops/errors.h"
#include "tensor_ops/registry.h"
#include "tensor_ops/stream.h"
#include "tensor_ops/transfer.h"

namespace tensor_ops {

const char* op_name(OpId op) {
  switch (op) {
#define TENSOR_OPS_OP(name, id, n_in, n_out) \
  case OpId::name: return #name;
#include "tensor_ops/ops.def"
#undef TENSOR_OPS_OP
  }
  return "unknown";
}

namespace {

// This thread's streams, one per device that has one set (usually none or one).
struct ThreadStream {
  Device device;
  void* stream;
};
thread_local std::vector<ThreadStream> thread_streams;

// The backend of a device tensor's data; only backends with streams (plugin
// ABI >= 2: a version-1 table has no stream_wait field to read).
const to_backend_v1* stream_table(const Device& device) {
  if (device.is_host()) return nullptr;
  const Backend* b = Registry::instance().find(device.backend);
  if (!b || !b->usable()) return nullptr;
  const to_backend_v1& t = b->table();
  return t.abi_version >= 2 && t.stream_wait ? &t : nullptr;
}

}  // namespace

void* current_stream(const Device& device) {
  for (const ThreadStream& s : thread_streams)
    if (s.device == device) return s.stream;
  return nullptr;
}

void* exchange_stream(const Device& device, void* stream) {
  for (auto it = thread_streams.begin(); it != thread_streams.end(); ++it)
    if (it->device == device) {
      void* previous = it->stream;
      if (stream)
        it->stream = stream;
      else
        thread_streams.erase(it);
      return previous;
    }
  if (stream) thread_streams.push_back({device, stream});
  return nullptr;
}

StreamScope::StreamScope(const Device& device, void* stream)
    : device_(device), previous_(exchange_stream(device, stream)) {}

StreamScope::~StreamScope() { exchange_stream(device_, previous_); }

bool has_streams(const Device& device) { return stream_table(device) != nullptr; }

void stream_wait(const Device& device, void* consumer, void* producer) {
  const to_backend_v1* t = stream_table(device);
  if (!t)
    throw Unsupported("stream_wait: " + device.str() + " has no streams (" +
                      (device.is_host() ? std::string("host memory") : "backend '" + device.backend + "'") + ")");
  Registry::instance().require(device.backend).check(t->stream_wait(device.id, consumer, producer), "stream_wait");
}

namespace {

// A tensor seen as [rows, cols] with unit column stride and one row stride.
struct Rows {
  int64_t rows = 1, cols = 1, row_stride = 1;
};

// Collapses all leading dims into rows; the last dim is cols. A 0-d tensor is
// one row of one element.
Rows collapse(const Tensor& t, const char* op, const char* arg) {
  Rows r;
  const auto& sh = t.shape();
  const auto& st = t.strides();
  const int64_t n = t.ndim();
  if (n == 0) return r;
  r.cols = sh[n - 1];
  r.rows = 1;
  for (int64_t i = 0; i + 1 < n; ++i) r.rows *= sh[i];
  r.row_stride = r.cols;
  if (r.rows == 0 || r.cols == 0) return r;
  auto layout_error = [&] {
    return LayoutError(std::string(op) + ": " + arg + " " + t.describe() + " with strides " + shape_str(st) +
                       " cannot be viewed as rows with a contiguous last dimension");
  };
  if (r.cols > 1 && st[n - 1] != 1) throw layout_error();
  // Leading dims must form one arithmetic progression of rows.
  bool have = false;
  int64_t expect = 0;
  for (int64_t i = n - 2; i >= 0; --i) {
    if (sh[i] == 1) continue;
    if (!have) {
      r.row_stride = st[i];
      expect = st[i] * sh[i];
      have = true;
    } else {
      if (st[i] != expect) throw layout_error();
      expect *= sh[i];
    }
  }
  if (r.row_stride < r.cols && r.rows > 1) throw layout_error();  // rows would overlap
  return r;
}

bool handle_memory(const Tensor& t) {
  if (t.device().is_host()) return false;
  Backend* b = Registry::instance().find(t.device().backend);
  return b && (b->table().flags & TO_BACKEND_HANDLE_MEMORY);
}

to_tensor rows_view(const Tensor& t, const Rows& r) {
  to_tensor v{};
  // Pointer memory gets the offset folded in (plugin.h: byte_offset 0 there).
  if (handle_memory(t)) {
    v.data = t.data();
    v.byte_offset = t.byte_offset();
  } else {
    v.data = static_cast<char*>(t.data()) + t.byte_offset();
  }
  v.dtype = int32_t(t.dtype());
  v.ndim = 2;
  v.shape[0] = r.rows;
  v.shape[1] = r.cols;
  v.strides[0] = r.row_stride;
  v.strides[1] = 1;
  v.device_id = t.device().id;
  return v;
}

void check_dtype_match(const char* op, const char* arg, const Tensor& t, const Tensor& x) {
  if (t.dtype() != x.dtype())
    throw DTypeError(std::string(op) + ": " + arg + " has dtype " + dtype_name(t.dtype()) + " but x has " +
                     dtype_name(x.dtype()) + " (x: " + x.describe() + ", " + arg + ": " + t.describe() +
                     "); all tensors of one call must share a dtype");
}

void check_same_device(const char* op, const char* arg, const Tensor& t, const Tensor& x) {
  if (t.device() != x.device())
    throw InvalidArgument(std::string(op) + ": " + arg + " is on " + t.device().str() + " but x is on " +
                          x.device().str());
}

bool same_view(const Tensor& a, const Tensor& b) {
  return a.data() == b.data() && a.byte_offset() == b.byte_offset() && a.shape() == b.shape() && a.strides() == b.strides();
}

int64_t floor_div(int64_t x, int64_t y) { return x / y - ((x % y != 0) && ((x < 0) != (y < 0))); }

// Note [row-strided overlap]: two views whose byte spans meet may still share
// no element: the halves of a fused [N, 2I] gate / up projection (gate =
// gu[:, :I], up = gu[:, I:], swiglu(gate, up, out=gate)) interleave row by
// row, and were refused as overlapping. When both are rows of one byte stride
// S (each row inside its stride: collapse), row i of a (at a0 + i S, wa
// bytes) meets row j of b (at b0 + j S, wb bytes) only if d - wa < (i - j) S
// < d + wb, d = b0 - a0: a question about k = i - j alone.
bool disjoint_rows(const Tensor& a, const Tensor& b, uintptr_t a0, uintptr_t b0) {
  Rows ra, rb;
  try {
    ra = collapse(a, "", "");
    rb = collapse(b, "", "");
  } catch (const LayoutError&) {
    return false;  // not rows: the byte spans decide
  }
  const int64_t ia = int64_t(dtype_size(a.dtype())), ib = int64_t(dtype_size(b.dtype()));
  const int64_t sa = ra.row_stride * ia, sb = rb.row_stride * ib;
  if (ra.rows > 1 && rb.rows > 1 && sa != sb) return false;
  const int64_t S = ra.rows > 1 ? sa : (rb.rows > 1 ? sb : 1), wa = ra.cols * ia, wb = rb.cols * ib;
  const int64_t d = int64_t(b0 - a0);
  const int64_t kmin = floor_div(d - wa, S) + 1, kmax = -floor_div(-(d + wb), S) - 1;  // d - wa < k S < d + wb
  return std::max(kmin, 1 - rb.rows) > std::min(kmax, ra.rows - 1);
}

bool overlaps(const Tensor& a, const Tensor& b) {
  // Distinct handles (cl_mem) never alias; within one handle offsets compare.
  if (handle_memory(a) && a.data() != b.data()) return false;
  auto sa = a.byte_span(), sb = b.byte_span();
  if (!(sa.first < sb.second && sb.first < sa.second)) return false;
  return !disjoint_rows(a, b, sa.first, sb.first);
}

// out must match x in shape, dtype and device; it may be x itself (in place)
// but must not partially overlap any input.
void check_out(const char* op, const Tensor& out, const Tensor& x, std::initializer_list<const Tensor*> others) {
  if (out.shape() != x.shape())
    throw InvalidArgument(std::string(op) + ": out has shape " + shape_str(out.shape()) + " but x has " +
                          shape_str(x.shape()));
  check_dtype_match(op, "out", out, x);
  check_same_device(op, "out", out, x);
  if (!same_view(out, x) && overlaps(out, x))
    throw InvalidArgument(std::string(op) + ": out " + out.describe() + " partially overlaps x " + x.describe());
  for (const Tensor* t : others)
    if (overlaps(out, *t))
      throw InvalidArgument(std::string(op) + ": out " + out.describe() + " overlaps an input " + t->describe());
}

Backend& backend_for_tensor(const Tensor& x) {
  Registry& reg = Registry::instance();
  if (x.device().is_host()) return reg.host_backend();
  Backend& b = reg.require(x.device().backend);
  if (x.device().id < 0 || x.device().id >= b.device_count())
    throw InvalidArgument("device " + x.device().str() + " does not exist (" + b.name() + " has " +
                          std::to_string(b.device_count()) + " devices)");
  return b;
}

to_tensor full_view(const Tensor& t, const char* op, const char* arg) {
  if (!t.is_contiguous())
    throw LayoutError(std::string(op) + ": " + arg + " " + t.describe() + " must be contiguous");
  to_tensor v = rows_view(t, Rows{});
  v.ndim = int32_t(t.ndim());
  for (int64_t i = 0; i < t.ndim(); ++i) {
    v.shape[i] = t.shape()[size_t(i)];
    v.strides[i] = t.strides()[size_t(i)];
  }
  return v;
}

using TensorList = std::vector<const Tensor*>;  // nullptr: an absent optional tensor

// Runs op on the backend that owns the data. Host data with a device backend
// selected is staged: inputs copied to device 0 through its pool, outputs
// computed there and copied back. Staging takes contiguous tensors only (the
// Python layer retries a LayoutError with contiguous copies). Row-wise ops get
// [rows, cols] views; others (full = true) contiguous views of every dim.
void launch(OpId op, const TensorList& ins, const TensorList& outs, to_op_call& call, bool full = false) {
  const Tensor& x = *ins.front();
  Backend& b = backend_for_tensor(x);
  to_kernel_fn fn = b.table().kernels[int(op)];
  if (!fn)
    throw Unsupported(std::string("op ") + op_name(op) + " is not implemented by backend '" + b.name() + "'");
  call.op = int32_t(op);
  call.n_inputs = int32_t(ins.size());
  call.n_outputs = int32_t(outs.size());
  const char* name = op_name(op);
  auto view = [&](const Tensor& t, const char* arg) {
    return full ? full_view(t, name, arg) : rows_view(t, collapse(t, name, arg));
  };
  const bool stage = x.device().is_host() && b.name() != "cpu";
  if (!stage) {
    call.stream = current_stream(x.device());
    for (size_t i = 0; i < ins.size(); ++i)
      if (ins[i]) call.inputs[i] = view(*ins[i], "input");
    for (size_t i = 0; i < outs.size(); ++i)
      if (outs[i]) call.outputs[i] = view(*outs[i], "out");
    b.check(fn(&call), name);
    return;
  }
  const Device dev{b.name(), 0};
  for (const TensorList* list : {&ins, &outs})
    for (const Tensor* t : *list)
      if (t && !t->is_contiguous())
        throw LayoutError(std::string(name) + ": staging to " + dev.str() + " needs contiguous tensors, got " +
                          t->describe());
  std::vector<Tensor> dev_in(ins.size()), dev_out(outs.size());
  for (size_t i = 0; i < ins.size(); ++i)
    if (ins[i]) {
      dev_in[i] = to_device(*ins[i], dev);
      call.inputs[i] = view(dev_in[i], "input");
    }
  for (size_t i = 0; i < outs.size(); ++i)
    if (outs[i]) {
      dev_out[i] = DeviceMemory::of(dev).empty(outs[i]->shape(), outs[i]->dtype());
      call.outputs[i] = view(dev_out[i], "out");
    }
  b.check(fn(&call), name);
  for (size_t i = 0; i < outs.size(); ++i)
    if (outs[i]) copy_bytes(*outs[i], dev_out[i]);
}

void check_float(const char* op, const char* arg, const Tensor& t) {
  if (!is_float(t.dtype()))
    throw DTypeError(std::string(op) + ": " + arg + " has dtype " + dtype_name(t.dtype()) +
                     "; tensor_ops ops take float32, float16 or bfloat16 (" + arg + ": " + t.describe() + ")");
}

void check_like(const char* op, const char* arg, const Tensor& t, const Tensor& x) {
  if (t.shape() != x.shape())
    throw InvalidArgument(std::string(op) + ": " + arg + " has shape " + shape_str(t.shape()) + " but x has " +
                          shape_str(x.shape()));
  check_dtype_match(op, arg, t, x);
  check_same_device(op, arg, t, x);
}

void check_eps(const char* op, double eps) {
  if (!std::isfinite(eps) || eps < 0)
    throw InvalidArgument(std::string(op) + ": eps must be finite and >= 0, got " + std::to_string(eps));
}

// weight-like: 1-D of the last dim's size, same dtype and device as x.
void check_vector(const char* op, const char* arg, const Tensor& w, const Tensor& x) {
  check_dtype_match(op, arg, w, x);
  check_same_device(op, arg, w, x);
  const int64_t cols = x.ndim() ? x.shape().back() : 1;
  if (w.ndim() != 1 || w.shape()[0] != cols)
    throw InvalidArgument(std::string(op) + ": " + arg + " must have shape [" + std::to_string(cols) +
                          "] to match x " + x.describe() + ", got " + w.describe());
}

void check_activation(const char* op, Activation act) {
  if (act != Activation::Silu && act != Activation::Gelu && act != Activation::GeluTanh)
    throw InvalidArgument(std::string(op) + ": activation " + std::to_string(int64_t(act)) +
                          " is not silu (0), gelu (1) or gelu_tanh (2)");
}

// A float32 output whatever the data dtype (lse, loss).
void check_float32_out(const char* op, const char* arg, const Tensor& t, const std::vector<int64_t>& shape) {
  if (t.dtype() != DType::Float32)
    throw DTypeError(std::string(op) + ": " + arg + " must be float32, got " + t.describe());
  if (t.shape() != shape)
    throw InvalidArgument(std::string(op) + ": " + arg + " must be float32 " + shape_str(shape) + ", got " +
                          t.describe());
}

void check_rank(const char* op, const Tensor& x, int64_t min_rank) {
  if (x.ndim() < min_rank)
    throw InvalidArgument(std::string(op) + ": x must have at least " + std::to_string(min_rank) +
                          " dimension(s), got " + x.describe());
}

// Outputs must not overlap inputs (except out == x, where the op allows it)
// or each other.
void check_outputs(const char* op, const TensorList& outs, const TensorList& ins) {
  for (size_t i = 0; i < outs.size(); ++i) {
    if (!outs[i]) continue;
    for (const Tensor* in : ins)
      if (in && !same_view(*outs[i], *in) && overlaps(*outs[i], *in))
        throw InvalidArgument(std::string(op) + ": output " + outs[i]->describe() + " overlaps an input " +
                              in->describe());
    for (size_t j = 0; j < i; ++j)
      if (outs[j] && overlaps(*outs[i], *outs[j]))
        throw InvalidArgument(std::string(op) + ": outputs " + outs[j]->describe() + " and " +
                              outs[i]->describe() + " overlap");
  }
}

}  // namespace

std::string backend_for(const Tensor& x) { return backend_for_tensor(x).name(); }

// rms_norm's weight offset: finite, and nonzero only on a backend that reads it.
static void check_offset(const char* op, const Tensor& x, double offset) {
  if (!std::isfinite(offset))
    throw InvalidArgument(std::string(op) + ": offset must be finite, got " + std::to_string(offset));
  if (offset == 0) return;
  const Backend& b = backend_for_tensor(x);
  if (!(b.table().flags & TO_BACKEND_NORM_OFFSET))
    throw Unsupported(std::string(op) + ": backend '" + b.name() + "' does not implement the weight offset (got " +
                      std::to_string(offset) + "); run it on another backend, or pass offset + weight as the weight");
}

void rms_norm(const Tensor& x, const Tensor& weight, const Tensor& out, double eps, double offset) {
  const char* op = "rms_norm";
  check_float(op, "x", x);
  if (x.ndim() < 1)
    throw InvalidArgument("rms_norm: x must have at least 1 dimension (it normalises the last); got a 0-d tensor");
  check_dtype_match(op, "weight", weight, x);
  check_same_device(op, "weight", weight, x);
  const int64_t cols = x.shape().back();
  if (weight.ndim() != 1 || weight.shape()[0] != cols)
    throw InvalidArgument("rms_norm: weight must have shape [" + std::to_string(cols) + "] to match x " +
                          x.describe() + ", got " + weight.describe());
  if (!std::isfinite(eps) || eps < 0)
    throw InvalidArgument("rms_norm: eps must be finite and >= 0, got " + std::to_string(eps));
  check_out(op, out, x, {&weight});
  check_offset(op, x, offset);
  if (x.numel() == 0) return;
  collapse(x, op, "x");
  collapse(weight, op, "weight");
  collapse(out, op, "out");
  to_op_call call{};
  call.scalars[0] = eps;
  call.scalars[1] = offset;
  launch(OpId::rms_norm, {&x, &weight}, {&out}, call);
}

static void unary(OpId op, const Tensor& x, const Tensor& out, int64_t mode) {
  const char* name = op_name(op);
  check_float(name, "x", x);
  check_out(name, out, x, {});
  if (x.numel() == 0) return;
  collapse(x, name, "x");
  collapse(out, name, "out");
  to_op_call call{};
  call.ints[0] = mode;
  launch(op, {&x}, {&out}, call);
}

void silu(const Tensor& x, const Tensor& out) { unary(OpId::silu, x, out, 0); }

void gelu(const Tensor& x, const Tensor& out, const std::string& approximate) {
  int64_t mode;
  if (approximate == "none")
    mode = 0;
  else if (approximate == "tanh")
    mode = 1;
  else
    throw InvalidArgument("gelu: approximate must be 'none' or 'tanh', got '" + approximate + "'");
  unary(OpId::gelu, x, out, mode);
}

}  // namespace tensor_ops

namespace tensor_ops {

Activation activation_from_name(const std::string& name, const std::string& approximate) {
  if (approximate != "none" && approximate != "tanh")
    throw InvalidArgument("approximate must be 'none' or 'tanh', got '" + approximate + "'");
  if (name == "silu" || name == "swish") return Activation::Silu;
  if (name == "gelu") return approximate == "tanh" ? Activation::GeluTanh : Activation::Gelu;
  if (name == "gelu_tanh") return Activation::GeluTanh;
  throw InvalidArgument("unknown activation '" + name + "'; valid: silu, gelu, gelu_tanh");
}

void layer_norm(const Tensor& x, const Tensor& weight, const Tensor* bias, const Tensor& out, double eps) {
  const char* op = "layer_norm";
  check_float(op, "x", x);
  check_rank(op, x, 1);
  check_vector(op, "weight", weight, x);
  if (bias) check_vector(op, "bias", *bias, x);
  check_eps(op, eps);
  check_out(op, out, x, {&weight});
  if (bias) check_outputs(op, {&out}, {bias});
  if (x.numel() == 0) return;
  to_op_call call{};
  call.scalars[0] = eps;
  call.ints[0] = bias != nullptr;
  launch(OpId::layer_norm, {&x, &weight, bias}, {&out}, call);
}

void rms_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor& dx,
                       const Tensor& dweight, double eps, double offset) {
  const char* op = "rms_norm_backward";
  check_float(op, "x", x);
  check_rank(op, x, 1);
  check_like(op, "dy", dy, x);
  check_vector(op, "weight", weight, x);
  check_like(op, "dx", dx, x);
  check_vector(op, "dweight", dweight, x);
  check_eps(op, eps);
  check_outputs(op, {&dx, &dweight}, {&dy, &x, &weight});
  check_offset(op, x, offset);
  if (x.shape().back() == 0) return;
  to_op_call call{};
  call.scalars[0] = eps;
  call.scalars[1] = offset;
  launch(OpId::rms_norm_backward, {&dy, &x, &weight}, {&dx, &dweight}, call);
}

void layer_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor& dx,
                         const Tensor& dweight, const Tensor* dbias, double eps) {
  const char* op = "layer_norm_backward";
  check_float(op, "x", x);
  check_rank(op, x, 1);
  check_like(op, "dy", dy, x);
  check_vector(op, "weight", weight, x);
  check_like(op, "dx", dx, x);
  check_vector(op, "dweight", dweight, x);
  if (dbias) check_vector(op, "dbias", *dbias, x);
  check_eps(op, eps);
  check_outputs(op, {&dx, &dweight, dbias}, {&dy, &x, &weight});
  if (x.shape().back() == 0) return;
  to_op_call call{};
  call.scalars[0] = eps;
  call.ints[0] = dbias != nullptr;
  launch(OpId::layer_norm_backward, {&dy, &x, &weight}, {&dx, &dweight, dbias}, call);
}

void add_rms_norm(const Tensor& x, const Tensor& residual, const Tensor& weight, const Tensor& out,
                  const Tensor& residual_out, double eps) {
  const char* op = "add_rms_norm";
  check_float(op, "x", x);
  check_rank(op, x, 1);
  check_like(op, "residual", residual, x);
  check_vector(op, "weight", weight, x);
  check_like(op, "out", out, x);
  check_like(op, "residual_out", residual_out, x);
  check_eps(op, eps);
  // In place is allowed: out may be x, residual_out may be residual.
  check_outputs(op, {&out}, {&x, &weight});
  check_outputs(op, {&residual_out}, {&residual, &weight});
  if (overlaps(out, residual) || overlaps(residual_out, x) || overlaps(out, residual_out))
    throw InvalidArgument("add_rms_norm: out may alias x and residual_out may alias residual, nothing else");
  if (x.numel() == 0) return;
  to_op_call call{};
  call.scalars[0] = eps;
  launch(OpId::add_rms_norm, {&x, &residual, &weight}, {&out, &residual_out}, call);
}

static void check_scale(const char* op, double scale) {
  if (!std::isfinite(scale)) throw InvalidArgument(std::string(op) + ": scale must be finite, got " + std::to_string(scale));
}

static void check_causal(const char* op, int causal) {
  if (causal != kCausalNone && causal != kCausalBottomRight && causal != kCausalTopLeft)
    throw InvalidArgument(std::string(op) + ": causal must be 0 (none), 1 (bottom-right) or 2 (top-left), got " +
                          std::to_string(causal));
}

void softmax(const Tensor& x, const Tensor& out, double scale, int causal, bool log) {
  const char* op = log ? "log_softmax" : "softmax";
  check_float(op, "x", x);
  check_scale(op, scale);
  check_causal(op, causal);
  if (causal) check_rank(op, x, 2);
  check_out(op, out, x, {});
  if (x.numel() == 0) return;
  to_op_call call{};
  call.scalars[0] = scale;
  call.ints[0] = causal;
  call.ints[1] = log;
  // causal needs the query length: the second-to-last dim.
  call.ints[2] = x.ndim() >= 2 ? x.shape()[size_t(x.ndim() - 2)] : 1;
  launch(OpId::softmax, {&x}, {&out}, call);
}

void softmax_backward(const Tensor& dy, const Tensor& y, const Tensor& dx, double scale, bool log) {
  const char* op = "softmax_backward";
  check_float(op, "y", y);
  check_scale(op, scale);
  check_like(op, "dy", dy, y);
  check_out(op, dx, y, {});
  check_outputs(op, {&dx}, {&dy});
  if (y.numel() == 0) return;
  to_op_call call{};
  call.scalars[0] = scale;
  call.ints[1] = log;
  launch(OpId::softmax_backward, {&dy, &y}, {&dx}, call);
}

void activation_backward(const Tensor& dy, const Tensor& x, const Tensor& dx, Activation act) {
  const char* op = "activation_backward";
  check_float(op, "x", x);
  check_activation(op, act);
  check_like(op, "dy", dy, x);
  check_like(op, "dx", dx, x);
  check_outputs(op, {&dx}, {&x});
  if (!same_view(dx, dy) && overlaps(dx, dy))
    throw InvalidArgument("activation_backward: dx " + dx.describe() + " partially overlaps dy " + dy.describe());
  if (x.numel() == 0) return;
  to_op_call call{};
  call.ints[0] = int64_t(act);
  launch(OpId::activation_backward, {&dy, &x}, {&dx}, call);
}

void glu(const Tensor& gate, const Tensor& up, const Tensor& out, Activation act) {
  const char* op = "glu";
  check_float(op, "gate", gate);
  check_activation(op, act);
  check_like(op, "up", up, gate);
  check_out(op, out, gate, {});
  if (!same_view(out, up) && overlaps(out, up))
    throw InvalidArgument("glu: out " + out.describe() + " partially overlaps up " + up.describe());
  if (gate.numel() == 0) return;
  to_op_call call{};
  call.ints[0] = int64_t(act);
  launch(OpId::glu, {&gate, &up}, {&out}, call);
}

void glu_backward(const Tensor& dy, const Tensor& gate, const Tensor& up, const Tensor& dgate, const Tensor& dup,
                  Activation act) {
  const char* op = "glu_backward";
  check_float(op, "gate", gate);
  check_activation(op, act);
  check_like(op, "up", up, gate);
  check_like(op, "dy", dy, gate);
  check_like(op, "dgate", dgate, gate);
  check_like(op, "dup", dup, gate);
  check_outputs(op, {&dgate, &dup}, {&dy, &gate, &up});
  if (gate.numel() == 0) return;
  to_op_call call{};
  call.ints[0] = int64_t(act);
  launch(OpId::glu_backward, {&dy, &gate, &up}, {&dgate, &dup}, call);
}

void rope(const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& positions, const Tensor& out,
          bool interleaved, bool inverse) {
  const char* op = "rope";
  check_float(op, "x", x);
  if (x.ndim() != 4)
    throw InvalidArgument("rope: x must be [batch, seq, heads, head_dim], got " + x.describe());
  const int64_t B = x.shape()[0], S = x.shape()[1], D = x.shape()[3];
  check_dtype_match(op, "cos", cos, x);
  check_dtype_match(op, "sin", sin, x);
  check_same_device(op, "cos", cos, x);
  check_same_device(op, "sin", sin, x);
  check_same_device(op, "positions", positions, x);
  if (cos.ndim() != 2 || sin.shape() != cos.shape())
    throw InvalidArgument("rope: cos and sin must both be [max_position, rotary_dim / 2], got cos " +
                          cos.describe() + ", sin " + sin.describe());
  const int64_t half = cos.shape()[1];
  if (half < 1 || 2 * half > D)
    throw InvalidArgument("rope: rotary_dim = 2 * " + std::to_string(half) + " must be in [2, head_dim = " +
                          std::to_string(D) + "]");
  if (positions.dtype() != DType::Int64 && positions.dtype() != DType::Int32)
    throw DTypeError("rope: positions must be int32 or int64, got " + positions.describe());
  if (positions.ndim() != 2 || (positions.shape()[0] != B && positions.shape()[0] != 1) ||
      positions.shape()[1] != S)
    throw InvalidArgument("rope: positions must be [batch or 1, seq] = [" + std::to_string(B) + " or 1, " +
                          std::to_string(S) + "], got " + positions.describe());
  check_out(op, out, x, {&cos, &sin, &positions});
  if (x.numel() == 0) return;
  to_op_call call{};
  call.ints[0] = interleaved;
  call.ints[1] = inverse;
  launch(OpId::rope, {&x, &cos, &sin, &positions}, {&out}, call, /*full=*/true);
}

static void check_attention_shapes(const char* op, const Tensor& q, const Tensor& k, const Tensor& v) {
  check_float(op, "q", q);
  check_dtype_match(op, "k", k, q);
  check_dtype_match(op, "v", v, q);
  check_same_device(op, "k", k, q);
  check_same_device(op, "v", v, q);
  if (q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4)
    throw InvalidArgument(std::string(op) + ": q, k, v must be [batch, heads, seq, head_dim], got q " +
                          q.describe() + ", k " + k.describe() + ", v " + v.describe());
  if (k.shape() != v.shape() || k.shape()[0] != q.shape()[0] || k.shape()[3] != q.shape()[3])
    throw InvalidArgument(std::string(op) + ": k and v must be [" + std::to_string(q.shape()[0]) +
                          ", kv_heads, kv_seq, " + std::to_string(q.shape()[3]) + "], got k " + k.describe() +
                          ", v " + v.describe());
  if (k.shape()[1] == 0 || q.shape()[1] % k.shape()[1] != 0)
    throw InvalidArgument(std::string(op) + ": kv heads (" + std::to_string(k.shape()[1]) +
                          ") must divide q heads (" + std::to_string(q.shape()[1]) + ")");
}

void attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse, int causal,
               double scale) {
  const char* op = "attention";
  check_attention_shapes(op, q, k, v);
  check_scale(op, scale);
  check_causal(op, causal);
  check_out(op, out, q, {&k, &v});
  check_float32_out(op, "lse", lse, std::vector<int64_t>(q.shape().begin(), q.shape().end() - 1));
  check_same_device(op, "lse", lse, q);
  check_outputs(op, {&out, &lse}, {&q, &k, &v});
  if (q.numel() == 0) return;
  to_op_call call{};
  call.scalars[0] = scale;
  call.ints[0] = causal;
  launch(OpId::attention, {&q, &k, &v}, {&out, &lse}, call, /*full=*/true);
}

void attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                        const Tensor& lse, const Tensor& dq, const Tensor& dk, const Tensor& dv, int causal,
                        double scale) {
  const char* op = "attention_backward";
  check_attention_shapes(op, q, k, v);
  check_scale(op, scale);
  check_causal(op, causal);
  check_like(op, "dout", dout, q);
  check_like(op, "out", out, q);
  check_like(op, "dq", dq, q);
  check_like(op, "dk", dk, k);
  check_like(op, "dv", dv, v);
  check_float32_out(op, "lse", lse, std::vector<int64_t>(q.shape().begin(), q.shape().end() - 1));
  check_same_device(op, "lse", lse, q);
  check_outputs(op, {&dq, &dk, &dv}, {&dout, &q, &k, &v, &out, &lse});
  if (q.numel() == 0 && k.numel() == 0) return;
  to_op_call call{};
  call.scalars[0] = scale;
  call.ints[0] = causal;
  launch(OpId::attention_backward, {&dout, &q, &k, &v, &out, &lse}, {&dq, &dk, &dv}, call, /*full=*/true);
}

void cross_entropy(const Tensor& logits, const Tensor& target, const Tensor& loss, const Tensor* dlogits,
                   int64_t ignore_index, double grad_scale, double label_smoothing, double z_loss, double softcap) {
  const char* op = "cross_entropy";
  check_float(op, "logits", logits);
  if (logits.ndim() != 2) throw InvalidArgument("cross_entropy: logits must be [N, C], got " + logits.describe());
  if (target.dtype() != DType::Int64 && target.dtype() != DType::Int32)
    throw DTypeError("cross_entropy: target must be int32 or int64 class indices, got " + target.describe());
  if (target.ndim() != 1 || target.shape()[0] != logits.shape()[0])
    throw InvalidArgument("cross_entropy: target must be [" + std::to_string(logits.shape()[0]) + "], got " +
                          target.describe());
  check_same_device(op, "target", target, logits);
  check_float32_out(op, "loss", loss, target.shape());
  check_same_device(op, "loss", loss, logits);
  if (dlogits) check_like(op, "dlogits", *dlogits, logits);
  check_scale(op, grad_scale);
  if (!(label_smoothing >= 0 && label_smoothing <= 1))
    throw InvalidArgument("cross_entropy: label_smoothing must be in [0, 1], got " + std::to_string(label_smoothing));
  if (!(std::isfinite(z_loss) && z_loss >= 0))
    throw InvalidArgument("cross_entropy: z_loss must be finite and >= 0, got " + std::to_string(z_loss));
  if (!(std::isfinite(softcap) && softcap >= 0))
    throw InvalidArgument("cross_entropy: softcap must be finite and > 0 (0: none), got " + std::to_string(softcap));
  check_outputs(op, {&loss, dlogits}, {&logits, &target});
  if (logits.shape()[0] == 0) return;
  if (logits.shape()[1] == 0) throw InvalidArgument("cross_entropy: logits have no classes: " + logits.describe());
  if (label_smoothing != 0 || z_loss != 0 || softcap != 0) {
    const Backend& b = backend_for_tensor(logits);
    if (!(b.table().flags & TO_BACKEND_CE_OPTIONS))
      throw Unsupported("cross_entropy: backend '" + b.name() +
                        "' does not implement label_smoothing, z_loss or softcap (got " +
                        std::to_string(label_smoothing) + ", " + std::to_string(z_loss) + ", " +
                        std::to_string(softcap) + "); run it on another backend or without them");
  }
  to_op_call call{};
  call.ints[0] = ignore_index;
  call.ints[1] = dlogits != nullptr;
  call.scalars[0] = grad_scale;
  call.scalars[1] = label_smoothing;
  call.scalars[2] = z_loss;
  call.scalars[3] = softcap;
  launch(OpId::cross_entropy, {&logits, &target}, {&loss, dlogits}, call, /*full=*/true);
}

void linear(const Tensor& x, const Tensor& weight, const Tensor* bias, const Tensor& out, WeightLayout layout) {
  const char* op = "linear";
  if (layout != WeightLayout::NK && layout != WeightLayout::KN)
    throw InvalidArgument("linear: weight_layout must be 0 (nk: weight [out_features, in_features]) or 1 (kn: "
                          "weight [in_features, out_features]), got " + std::to_string(int64_t(layout)));
  const bool kn = layout == WeightLayout::KN;
  check_float(op, "x", x);
  check_rank(op, x, 1);
  check_dtype_match(op, "weight", weight, x);
  check_same_device(op, "weight", weight, x);
  const int64_t K = x.shape().back();
  if (weight.ndim() != 2 || weight.shape()[kn ? 0 : 1] != K)
    throw InvalidArgument(kn ? "linear: weight must be [" + std::to_string(K) +
                                   ", out_features] (weight_layout kn: x @ weight) to match x " + x.describe() +
                                   ", got " + weight.describe()
                             : "linear: weight must be [out_features, " + std::to_string(K) + "] to match x " +
                                   x.describe() + ", got " + weight.describe());
  const int64_t N = weight.shape()[kn ? 1 : 0];
  if (bias) {
    check_dtype_match(op, "bias", *bias, x);
    check_same_device(op, "bias", *bias, x);
    if (bias->ndim() != 1 || bias->shape()[0] != N)
      throw InvalidArgument("linear: bias must have shape [" + std::to_string(N) + "] to match weight " +
                            weight.describe() + ", got " + bias->describe());
  }
  std::vector<int64_t> want(x.shape().begin(), x.shape().end() - 1);
  want.push_back(N);
  if (out.shape() != want)
    throw InvalidArgument("linear: out has shape " + shape_str(out.shape()) + " but x " + x.describe() +
                          " and weight " + weight.describe() + " give " + shape_str(want));
  check_dtype_match(op, "out", out, x);
  check_same_device(op, "out", out, x);
  // Not even in place: x's rows are read while out's are written.
  for (const Tensor* t : {&x, &weight, bias})
    if (t && overlaps(out, *t))
      throw InvalidArgument("linear: out " + out.describe() + " overlaps an input " + t->describe());
  collapse(x, op, "x");
  collapse(weight, op, "weight");
  collapse(out, op, "out");
  if (out.numel() == 0) return;  // K = 0 still writes out: bias or zeros
  to_op_call call{};
  call.ints[0] = bias != nullptr;
  call.ints[1] = int64_t(layout);
  launch(OpId::linear, {&x, &weight, bias}, {&out}, call);
}

}  // namespace tensor_ops

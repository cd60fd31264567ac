// Argument checks for every op (once, here) and dispatch to a backend.
#include "tensor_ops/ops.h"

#include <cmath>

#include "tensor_ops/device_memory.h"
#include "tensor_ops/errors.h"
#include "tensor_ops/registry.h"
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

bool overlaps(const Tensor& a, const Tensor& b) {
  // Distinct handles (cl_mem) never alias; within one handle offsets compare.
  if (handle_memory(a) && a.data() != b.data()) return false;
  auto sa = a.byte_span(), sb = b.byte_span();
  return sa.first < sb.second && sb.first < sa.second;
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
  if (x.device().is_host()) return reg.active();
  Backend& b = reg.require(x.device().backend);
  if (x.device().id < 0 || x.device().id >= b.device_count())
    throw InvalidArgument("device " + x.device().str() + " does not exist (" + b.name() + " has " +
                          std::to_string(b.device_count()) + " devices)");
  return b;
}

// Runs op on the backend that owns the data. Host data with a device backend
// selected is staged: inputs copied to device 0 through its pool, outputs
// computed there and copied back. Staging takes contiguous tensors only (the
// Python layer retries a LayoutError with contiguous copies).
void launch(OpId op, std::initializer_list<const Tensor*> ins, std::initializer_list<const Tensor*> outs,
            to_op_call& call) {
  const Tensor& x = **ins.begin();
  Backend& b = backend_for_tensor(x);
  to_kernel_fn fn = b.table().kernels[int(op)];
  if (!fn)
    throw Unsupported(std::string("op ") + op_name(op) + " is not implemented by backend '" + b.name() + "'");
  call.op = int32_t(op);
  call.n_inputs = int32_t(ins.size());
  call.n_outputs = int32_t(outs.size());
  const bool stage = x.device().is_host() && b.name() != "cpu";
  if (!stage) {
    int i = 0;
    for (const Tensor* t : ins) call.inputs[i++] = rows_view(*t, collapse(*t, op_name(op), "input"));
    i = 0;
    for (const Tensor* t : outs) call.outputs[i++] = rows_view(*t, collapse(*t, op_name(op), "out"));
    b.check(fn(&call), op_name(op));
    return;
  }
  const Device dev{b.name(), 0};
  for (const Tensor* t : ins)
    if (!t->is_contiguous())
      throw LayoutError(std::string(op_name(op)) + ": staging to " + dev.str() + " needs contiguous inputs, got " +
                        t->describe());
  for (const Tensor* t : outs)
    if (!t->is_contiguous())
      throw LayoutError(std::string(op_name(op)) + ": staging to " + dev.str() + " needs a contiguous out, got " +
                        t->describe());
  std::vector<Tensor> dev_in, dev_out;
  for (const Tensor* t : ins) dev_in.push_back(to_device(*t, dev));
  for (const Tensor* t : outs) dev_out.push_back(DeviceMemory::of(dev).empty(t->shape(), t->dtype()));
  for (size_t i = 0; i < dev_in.size(); ++i) call.inputs[i] = rows_view(dev_in[i], collapse(dev_in[i], "", ""));
  for (size_t i = 0; i < dev_out.size(); ++i)
    call.outputs[i] = rows_view(dev_out[i], collapse(dev_out[i], "", ""));
  b.check(fn(&call), op_name(op));
  size_t i = 0;
  for (const Tensor* t : outs) copy_bytes(*t, dev_out[i++]);
}

}  // namespace

std::string backend_for(const Tensor& x) { return backend_for_tensor(x).name(); }

void rms_norm(const Tensor& x, const Tensor& weight, const Tensor& out, double eps) {
  const char* op = "rms_norm";
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
  if (x.numel() == 0) return;
  collapse(x, op, "x");
  collapse(weight, op, "weight");
  collapse(out, op, "out");
  to_op_call call{};
  call.scalars[0] = eps;
  launch(OpId::rms_norm, {&x, &weight}, {&out}, call);
}

static void unary(OpId op, const Tensor& x, const Tensor& out, int64_t mode) {
  const char* name = op_name(op);
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

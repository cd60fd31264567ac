// The bad-input matrix (tests/cpp/BAD_INPUT.md): every op x every kind of bad
// input, each row a valid call with one thing broken. Each row runs through
// the C++ API (the exception class) and through the C ABI (the status, and the
// same message), and must never crash.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "tensor_ops/errors.h"
#include "tensor_ops/ops.h"
#include "tensor_ops/registry.h"
#include "tensor_ops/tensor_ops.h"

#ifndef TENSOR_OPS_TEST_PLUGIN_DIR
#error "TENSOR_OPS_TEST_PLUGIN_DIR must name the directory of the mock plugins"
#endif

namespace tensor_ops {
namespace {

// Data: float data; Index: int64 indices in [0, index_bound); Float32: always
// float32 whatever the data dtype (attention's lse, cross-entropy's loss).
enum class Role { Data, Index, Float32 };

struct TensorSpec {
  std::string name;
  Role role = Role::Data;
  DType dtype = DType::Float32;
  std::vector<int64_t> shape, strides;  // strides empty: contiguous
  Device device;
  int storage = -1;     // slot whose memory this view uses; -1: its own
  int64_t offset = 0;   // elements into that memory
  int64_t byte_shift = 0;  // bytes on top (misaligned data)
  bool null = false;    // C++: a null data pointer; C: a NULL handle
  int64_t index_bound = 0;
  int64_t index_value = -1;  // >= 0: every index is this value
};

struct CallSpec {
  OpId op = OpId::silu;
  std::vector<TensorSpec> in, out;
  std::vector<double> scalars;
  std::vector<int64_t> ints;

  int n_slots() const { return int(in.size() + out.size()); }
  TensorSpec& slot(int i) { return i < int(in.size()) ? in[size_t(i)] : out[size_t(i) - in.size()]; }
  const TensorSpec& slot(int i) const { return const_cast<CallSpec*>(this)->slot(i); }
};

TensorSpec spec(const char* name, Role role, DType dtype, std::vector<int64_t> shape, int64_t bound = 0) {
  TensorSpec t;
  t.name = name;
  t.role = role;
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.index_bound = bound;
  return t;
}
TensorSpec data(const char* name, std::vector<int64_t> shape) { return spec(name, Role::Data, DType::Float32, shape); }
TensorSpec f32(const char* name, std::vector<int64_t> shape) { return spec(name, Role::Float32, DType::Float32, shape); }
TensorSpec indices(const char* name, std::vector<int64_t> shape, int64_t bound) {
  return spec(name, Role::Index, DType::Int64, shape, bound);
}

// A valid call of `op` whose row-like dimension is `rows` and last dimension `cols`.
CallSpec valid_call(OpId op, int64_t rows, int64_t cols) {
  const int64_t R = rows, C = cols;
  CallSpec c;
  c.op = op;
  switch (op) {
    case OpId::rms_norm:
      c.in = {data("x", {R, C}), data("weight", {C})};
      c.out = {data("out", {R, C})};
      c.scalars = {1e-6};
      break;
    case OpId::silu:
      c.in = {data("x", {R, C})};
      c.out = {data("out", {R, C})};
      break;
    case OpId::gelu:
      c.in = {data("x", {R, C})};
      c.out = {data("out", {R, C})};
      c.ints = {0};
      break;
    case OpId::layer_norm:
      c.in = {data("x", {R, C}), data("weight", {C}), data("bias", {C})};
      c.out = {data("out", {R, C})};
      c.scalars = {1e-5};
      break;
    case OpId::rms_norm_backward:
      c.in = {data("dy", {R, C}), data("x", {R, C}), data("weight", {C})};
      c.out = {data("dx", {R, C}), data("dweight", {C})};
      c.scalars = {1e-6};
      break;
    case OpId::layer_norm_backward:
      c.in = {data("dy", {R, C}), data("x", {R, C}), data("weight", {C})};
      c.out = {data("dx", {R, C}), data("dweight", {C}), data("dbias", {C})};
      c.scalars = {1e-5};
      break;
    case OpId::add_rms_norm:
      c.in = {data("x", {R, C}), data("residual", {R, C}), data("weight", {C})};
      c.out = {data("out", {R, C}), data("residual_out", {R, C})};
      c.scalars = {1e-6};
      break;
    case OpId::softmax:
      c.in = {data("x", {R, C})};
      c.out = {data("out", {R, C})};
      c.scalars = {1.0};
      c.ints = {0, 0};
      break;
    case OpId::softmax_backward:
      c.in = {data("dy", {R, C}), data("y", {R, C})};
      c.out = {data("dx", {R, C})};
      c.scalars = {1.0};
      c.ints = {0};
      break;
    case OpId::activation_backward:
      c.in = {data("dy", {R, C}), data("x", {R, C})};
      c.out = {data("dx", {R, C})};
      c.ints = {0};
      break;
    case OpId::glu:
      c.in = {data("gate", {R, C}), data("up", {R, C})};
      c.out = {data("out", {R, C})};
      c.ints = {0};
      break;
    case OpId::glu_backward:
      c.in = {data("dy", {R, C}), data("gate", {R, C}), data("up", {R, C})};
      c.out = {data("dgate", {R, C}), data("dup", {R, C})};
      c.ints = {0};
      break;
    case OpId::rope: {
      const int64_t P = R + 2;
      c.in = {data("x", {2, R, 2, C}), data("cos", {P, C / 2}), data("sin", {P, C / 2}),
              indices("positions", {2, R}, P)};
      c.out = {data("out", {2, R, 2, C})};
      c.ints = {0, 0};
      break;
    }
    case OpId::attention:
      c.in = {data("q", {1, 2, R, C}), data("k", {1, 1, R + 1, C}), data("v", {1, 1, R + 1, C})};
      c.out = {data("out", {1, 2, R, C}), f32("lse", {1, 2, R})};
      c.scalars = {0.5};
      c.ints = {0};
      break;
    case OpId::attention_backward:
      c.in = {data("dout", {1, 2, R, C}), data("q", {1, 2, R, C}), data("k", {1, 1, R + 1, C}),
              data("v", {1, 1, R + 1, C}), data("out", {1, 2, R, C}), f32("lse", {1, 2, R})};
      c.out = {data("dq", {1, 2, R, C}), data("dk", {1, 1, R + 1, C}), data("dv", {1, 1, R + 1, C})};
      c.scalars = {0.5};
      c.ints = {0};
      break;
    case OpId::cross_entropy:
      c.in = {data("logits", {R, C}), indices("target", {R}, C)};
      c.out = {f32("loss", {R}), data("dlogits", {R, C})};
      c.scalars = {1.0};
      c.ints = {-100};
      break;
    case OpId::linear:
      c.in = {data("x", {R, C}), data("weight", {5, C}), data("bias", {5})};
      c.out = {data("out", {R, 5})};
      break;
  }
  return c;
}

enum class Outcome { Ok, DTypeError, LayoutError, InvalidArgument, Unsupported, BackendUnavailable, OtherError };

const char* outcome_name(Outcome o) {
  switch (o) {
    case Outcome::Ok: return "ok";
    case Outcome::DTypeError: return "DTypeError";
    case Outcome::LayoutError: return "LayoutError";
    case Outcome::InvalidArgument: return "InvalidArgument";
    case Outcome::Unsupported: return "Unsupported";
    case Outcome::BackendUnavailable: return "BackendUnavailable";
    case Outcome::OtherError: return "another Error";
  }
  return "?";
}

to_status c_status_of(Outcome o) {
  switch (o) {
    case Outcome::Ok: return TO_OK;
    case Outcome::DTypeError:
    case Outcome::LayoutError:
    case Outcome::InvalidArgument: return TO_ERR_INVALID_ARGUMENT;
    case Outcome::Unsupported: return TO_ERR_UNSUPPORTED;
    case Outcome::BackendUnavailable: return TO_ERR_BACKEND_UNAVAILABLE;
    case Outcome::OtherError: return TO_ERR_INTERNAL;
  }
  return TO_ERR_INTERNAL;
}

// What each op accepts beyond the shared rules.
struct OpTraits {
  OpId op;
  bool contiguous_only;  // rope, attention, cross_entropy take whole contiguous tensors
  bool has_eps;          // scalars[0] is an eps (must be >= 0); otherwise a scale (any finite)
  Outcome zero_cols;     // a last dimension of 0
  std::function<void(CallSpec&)> bad_rank;  // a rank the op refuses; empty: every rank is fine
};

std::vector<int64_t> rank0() { return {}; }

const std::vector<OpTraits>& all_ops() {
  static const std::vector<OpTraits> ops = {
      {OpId::rms_norm, false, true, Outcome::Ok, [](CallSpec& c) { c.in[0].shape = c.out[0].shape = rank0(); }},
      {OpId::silu, false, false, Outcome::Ok, nullptr},
      {OpId::gelu, false, false, Outcome::Ok, nullptr},
      {OpId::layer_norm, false, true, Outcome::Ok, [](CallSpec& c) { c.in[0].shape = c.out[0].shape = rank0(); }},
      {OpId::rms_norm_backward, false, true, Outcome::Ok, [](CallSpec& c) { c.in[1].shape = rank0(); }},
      {OpId::layer_norm_backward, false, true, Outcome::Ok, [](CallSpec& c) { c.in[1].shape = rank0(); }},
      {OpId::add_rms_norm, false, true, Outcome::Ok, [](CallSpec& c) { c.in[0].shape = rank0(); }},
      {OpId::softmax, false, false, Outcome::Ok,
       [](CallSpec& c) {  // causal needs [.., rows, cols]
         c.ints[0] = 1;
         c.in[0].shape = c.out[0].shape = {c.in[0].shape.back()};
       }},
      {OpId::softmax_backward, false, false, Outcome::Ok, nullptr},
      {OpId::activation_backward, false, false, Outcome::Ok, nullptr},
      {OpId::glu, false, false, Outcome::Ok, nullptr},
      {OpId::glu_backward, false, false, Outcome::Ok, nullptr},
      {OpId::rope, true, false, Outcome::InvalidArgument,
       [](CallSpec& c) {
         const auto& s = c.in[0].shape;
         c.in[0].shape = c.out[0].shape = {s[0], s[1], s[2] * s[3]};
       }},
      {OpId::attention, true, false, Outcome::Ok,
       [](CallSpec& c) { c.in[0].shape.erase(c.in[0].shape.begin()); }},
      {OpId::attention_backward, true, false, Outcome::Ok,
       [](CallSpec& c) { c.in[1].shape.erase(c.in[1].shape.begin()); }},
      {OpId::cross_entropy, true, false, Outcome::InvalidArgument,
       [](CallSpec& c) {
         c.in[0].shape.insert(c.in[0].shape.begin(), 1);
         c.out[1].shape.insert(c.out[1].shape.begin(), 1);
       }},
      {OpId::linear, false, false, Outcome::Ok, [](CallSpec& c) { c.in[1].shape = {5 * c.in[1].shape[1]}; }},
  };
  return ops;
}

struct Row {
  std::string name;
  CallSpec call;
  Outcome want;
  bool same_message = true;  // the C ABI's message equals the C++ what()
};

void PrintTo(const Row& r, std::ostream* os) { *os << r.name; }

int64_t first_dim_of_size_2(const TensorSpec& t) {
  for (size_t i = 0; i < t.shape.size(); ++i)
    if (t.shape[i] >= 2) return int64_t(i);
  return -1;
}

std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& shape, int64_t scale = 1) {
  std::vector<int64_t> st(shape.size());
  int64_t s = scale;
  for (size_t i = shape.size(); i-- > 0;) {
    st[i] = s;
    s *= std::max<int64_t>(shape[i], 1);
  }
  return st;
}

std::vector<Row> all_rows() {
  std::vector<Row> rows;
  for (const OpTraits& t : all_ops()) {
    const std::string op = op_name(t.op);
    const CallSpec base = valid_call(t.op, 3, 8);
    auto add = [&](const std::string& what, Outcome want, const std::function<void(CallSpec&)>& edit,
                   bool same_message = true) {
      CallSpec c = base;
      edit(c);
      rows.push_back({op + "_" + what, c, want, same_message});
    };
    add("valid", Outcome::Ok, [](CallSpec&) {});

    // dtypes
    add("wrong_dtype", Outcome::DTypeError, [](CallSpec& c) { c.in[0].dtype = DType::Int32; });
    for (int i = 1; i < base.n_slots(); ++i)
      if (base.slot(i).role == Role::Data) {
        add("mixed_dtypes", Outcome::DTypeError, [i](CallSpec& c) { c.slot(i).dtype = DType::Float16; });
        break;
      }
    for (int i = 0; i < base.n_slots(); ++i) {
      const TensorSpec& s = base.slot(i);
      if (s.role == Role::Index)
        add(s.name + "_float_indices", Outcome::DTypeError, [i](CallSpec& c) { c.slot(i).dtype = DType::Float32; });
      if (s.role == Role::Float32)
        add(s.name + "_not_float32", Outcome::DTypeError, [i](CallSpec& c) { c.slot(i).dtype = DType::Float16; });
    }

    // ranks and shapes
    if (t.bad_rank) add("wrong_rank", Outcome::InvalidArgument, t.bad_rank);
    add("too_many_dims", Outcome::InvalidArgument,
        [](CallSpec& c) { c.in[0].shape.insert(c.in[0].shape.begin(), 8, 1); }, false);
    add("mismatched_out_shape", Outcome::InvalidArgument, [](CallSpec& c) { c.out[0].shape.back() += 1; });
    if (base.in.size() > 1)
      add("mismatched_input_shape", Outcome::InvalidArgument, [](CallSpec& c) { c.in[1].shape.back() += 1; });
    rows.push_back({op + "_zero_rows", valid_call(t.op, 0, 8), Outcome::Ok});
    rows.push_back({op + "_zero_cols", valid_call(t.op, 3, 0), t.zero_cols});
    add("absurd_size", Outcome::InvalidArgument,
        [](CallSpec& c) { c.in[0].shape = {int64_t(1) << 40, int64_t(1) << 30}; });
    add("absurd_strides", Outcome::InvalidArgument, [](CallSpec& c) {
      c.in[0].strides = contiguous_strides(c.in[0].shape);
      c.in[0].strides[size_t(first_dim_of_size_2(c.in[0]))] = int64_t(1) << 61;
    });

    // scalars and modes
    if (!base.scalars.empty()) {
      const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
      add("nan_scalar", Outcome::InvalidArgument, [nan](CallSpec& c) { c.scalars[0] = nan; });
      add("inf_scalar", Outcome::InvalidArgument, [inf](CallSpec& c) { c.scalars[0] = inf; });
      if (t.has_eps) add("negative_eps", Outcome::InvalidArgument, [](CallSpec& c) { c.scalars[0] = -1e-6; });
    }
    if (t.op == OpId::glu || t.op == OpId::glu_backward || t.op == OpId::activation_backward)
      add("bad_activation", Outcome::InvalidArgument, [](CallSpec& c) { c.ints[0] = 7; });
    if (t.op == OpId::linear) {  // its one optional int: the weight layout (0 nk [N, K], 1 kn [K, N])
      add("bad_weight_layout", Outcome::InvalidArgument, [](CallSpec& c) { c.ints = {2}; });
      add("weight_layout_kn", Outcome::Ok, [](CallSpec& c) {
        c.ints = {1};
        std::swap(c.in[1].shape[0], c.in[1].shape[1]);
      });
      add("weight_layout_kn_given_nk_weight", Outcome::InvalidArgument, [](CallSpec& c) { c.ints = {1}; });
    }
    for (int i = 0; i < base.n_slots(); ++i)
      if (base.slot(i).role == Role::Index)
        add(base.slot(i).name + "_out_of_range", Outcome::InvalidArgument,
            [i](CallSpec& c) { c.slot(i).index_value = c.slot(i).index_bound; }, false);

    // layouts and overlaps
    add("misaligned_" + base.in[0].name, Outcome::LayoutError, [](CallSpec& c) { c.in[0].byte_shift = 1; });
    add("misaligned_" + base.out[0].name, Outcome::LayoutError, [](CallSpec& c) { c.out[0].byte_shift = 2; });
    add("strided_out", Outcome::LayoutError,
        [](CallSpec& c) { c.out[0].strides = contiguous_strides(c.out[0].shape, 2); });
    add("self_overlapping_out", Outcome::LayoutError, [](CallSpec& c) {
      c.out[0].strides = contiguous_strides(c.out[0].shape);
      c.out[0].strides[size_t(first_dim_of_size_2(c.out[0]))] = 0;
    });
    if (base.out[0].shape.size() >= 2)
      add("padded_rows_out", t.contiguous_only ? Outcome::LayoutError : Outcome::Ok, [](CallSpec& c) {
        auto& o = c.out[0];
        o.strides = contiguous_strides(o.shape);
        o.strides[o.shape.size() - 2] = o.shape.back() + 3;
        for (size_t i = o.shape.size() - 2; i-- > 0;) o.strides[i] = o.strides[i + 1] * o.shape[i + 1];
      });
    add("out_overlaps_" + base.in[0].name, Outcome::InvalidArgument, [](CallSpec& c) {
      c.out[0].storage = 0;
      c.out[0].offset = 1;
    });
    if (base.in.size() > 1) {
      const int last = int(base.in.size()) - 1;
      add("out_overlaps_" + base.in.back().name, Outcome::InvalidArgument, [last](CallSpec& c) {
        c.out[0].storage = last;
        c.out[0].offset = 1;
      });
    }
    if (base.out.size() > 1)
      add("outputs_overlap", Outcome::InvalidArgument, [](CallSpec& c) {
        c.out[1].storage = int(c.in.size());
        c.out[1].offset = 1;
      });

    // devices
    for (int i = 0; i < base.n_slots(); ++i)
      add(base.slot(i).name + "_on_another_device", Outcome::InvalidArgument,
          [i](CallSpec& c) { c.slot(i).device = Device{"mock", 0}; });
    auto all_on = [](Device d) {
      return [d](CallSpec& c) {
        for (int i = 0; i < c.n_slots(); ++i) c.slot(i).device = d;
      };
    };
    // the C ABI refuses the name when the tensor is made (its own message)
    add("unknown_backend", Outcome::InvalidArgument, all_on({"nosuch", 0}), false);
    add("unusable_backend", Outcome::BackendUnavailable, all_on({"mockbroken", 0}));
    add("missing_device", Outcome::InvalidArgument, all_on({"mock", 5}));
    // The mock backend implements silu only.
    add("on_a_backend_without_the_op", t.op == OpId::silu ? Outcome::Ok : Outcome::Unsupported,
        all_on({"mock", 0}));

    // null pointers (C++: null data; C: a NULL handle), for required tensors
    for (int i = 0; i < base.n_slots(); ++i) {
      const bool optional = ((t.op == OpId::layer_norm || t.op == OpId::linear) && i == 2) ||
                            (t.op == OpId::layer_norm_backward && i == base.n_slots() - 1) ||
                            (t.op == OpId::cross_entropy && i == base.n_slots() - 1);
      if (!optional)
        add("null_" + base.slot(i).name, Outcome::InvalidArgument, [i](CallSpec& c) { c.slot(i).null = true; },
            false);
    }
  }
  return rows;
}

// ---- running one row -------------------------------------------------------

// Number of elements a view reaches (max offset + 1); 0 when too large to
// back (counted in double: absurd shapes must not overflow here).
int64_t extent(const TensorSpec& t) {
  double e = 1, contiguous = 1;
  for (size_t i = t.shape.size(); i-- > 0;) {
    if (t.shape[i] <= 0) return 1;
    const double st = t.strides.size() == t.shape.size() ? double(t.strides[i]) : contiguous;
    e += std::fabs(st) * double(t.shape[i] - 1);
    contiguous *= double(t.shape[i]);
  }
  return e > double(int64_t(1) << 26) ? 0 : int64_t(e);
}

// Memory for every slot of a call, large enough for any view of the call at
// any offset used here, filled with valid values for its role.
class CallMemory {
 public:
  explicit CallMemory(const CallSpec& c) {
    int64_t elems = 0;
    for (int i = 0; i < c.n_slots(); ++i) elems = std::max(elems, extent(c.slot(i)));
    const size_t bytes = size_t(elems + 16) * 8;
    std::mt19937 rng(1234);
    std::uniform_real_distribution<float> uni(-2.0f, 2.0f);
    for (int i = 0; i < c.n_slots(); ++i) {
      const TensorSpec& s = c.slot(i);
      std::vector<unsigned char> m(bytes);
      const size_t item = dtype_size(s.dtype);
      for (size_t k = 0; k + item <= bytes; k += item) {
        if (s.role == Role::Index && !is_float(s.dtype)) {
          const int64_t v =
              s.index_value >= 0 ? s.index_value : (s.index_bound > 0 ? int64_t(k / item) % s.index_bound : 0);
          if (s.dtype == DType::Int64) std::memcpy(&m[k], &v, 8);
          if (s.dtype == DType::Int32) {
            const int32_t v32 = int32_t(v);
            std::memcpy(&m[k], &v32, 4);
          }
          continue;
        }
        const float f = uni(rng);
        uint16_t h = 0;
        switch (s.dtype) {
          case DType::Float32: std::memcpy(&m[k], &f, 4); break;
          case DType::Float16: h = float_to_half(f); std::memcpy(&m[k], &h, 2); break;
          case DType::BFloat16: h = float_to_bf16(f); std::memcpy(&m[k], &h, 2); break;
          default: break;  // integer data where floats belong: zeros
        }
      }
      memory_.push_back(std::move(m));
    }
  }

  void* data(const CallSpec& c, int i) {
    const TensorSpec& s = c.slot(i);
    if (s.null) return nullptr;
    unsigned char* base = memory_[size_t(s.storage >= 0 ? s.storage : i)].data();
    return base + s.offset * int64_t(dtype_size(s.dtype)) + s.byte_shift;
  }

 private:
  std::vector<std::vector<unsigned char>> memory_;
};

void run_cpp_op(const CallSpec& c, const std::vector<Tensor>& t) {
  const size_t n = c.in.size();
  const auto& in = t;
  auto out = [&](size_t i) -> const Tensor& { return t[n + i]; };
  const double s0 = c.scalars.empty() ? 0 : c.scalars[0];
  const int64_t i0 = c.ints.empty() ? 0 : c.ints[0], i1 = c.ints.size() > 1 ? c.ints[1] : 0;
  switch (c.op) {
    case OpId::rms_norm: rms_norm(in[0], in[1], out(0), s0); break;
    case OpId::silu: silu(in[0], out(0)); break;
    case OpId::gelu: gelu(in[0], out(0), i0 ? "tanh" : "none"); break;
    case OpId::layer_norm: layer_norm(in[0], in[1], &in[2], out(0), s0); break;
    case OpId::rms_norm_backward: rms_norm_backward(in[0], in[1], in[2], out(0), out(1), s0); break;
    case OpId::layer_norm_backward: layer_norm_backward(in[0], in[1], in[2], out(0), out(1), &out(2), s0); break;
    case OpId::add_rms_norm: add_rms_norm(in[0], in[1], in[2], out(0), out(1), s0); break;
    case OpId::softmax: softmax(in[0], out(0), s0, i0 != 0, i1 != 0); break;
    case OpId::softmax_backward: softmax_backward(in[0], in[1], out(0), s0, i0 != 0); break;
    case OpId::activation_backward: activation_backward(in[0], in[1], out(0), Activation(i0)); break;
    case OpId::glu: glu(in[0], in[1], out(0), Activation(i0)); break;
    case OpId::glu_backward: glu_backward(in[0], in[1], in[2], out(0), out(1), Activation(i0)); break;
    case OpId::rope: rope(in[0], in[1], in[2], in[3], out(0), i0 != 0, i1 != 0); break;
    case OpId::attention: attention(in[0], in[1], in[2], out(0), out(1), i0 != 0, s0); break;
    case OpId::attention_backward:
      attention_backward(in[0], in[1], in[2], in[3], in[4], in[5], out(0), out(1), out(2), i0 != 0, s0);
      break;
    case OpId::cross_entropy: cross_entropy(in[0], in[1], out(0), &out(1), i0, s0); break;
    case OpId::linear: linear(in[0], in[1], &in[2], out(0), WeightLayout(i0)); break;
  }
}

std::pair<Outcome, std::string> run_cpp(const CallSpec& c) {
  CallMemory mem(c);
  try {
    std::vector<Tensor> t;
    for (int i = 0; i < c.n_slots(); ++i) {
      const TensorSpec& s = c.slot(i);
      t.emplace_back(mem.data(c, i), s.dtype, s.shape, s.strides, s.device);
    }
    run_cpp_op(c, t);
    return {Outcome::Ok, ""};
  } catch (const LayoutError& e) {
    return {Outcome::LayoutError, e.what()};
  } catch (const DTypeError& e) {
    return {Outcome::DTypeError, e.what()};
  } catch (const InvalidArgument& e) {
    return {Outcome::InvalidArgument, e.what()};
  } catch (const Unsupported& e) {
    return {Outcome::Unsupported, e.what()};
  } catch (const BackendUnavailable& e) {
    return {Outcome::BackendUnavailable, e.what()};
  } catch (const Error& e) {
    return {Outcome::OtherError, e.what()};
  }
}

std::pair<to_status, std::string> run_c(const CallSpec& c) {
  CallMemory mem(c);
  std::vector<to_tensor_h> h(size_t(c.n_slots()), nullptr);
  auto result = [&](to_status s) {
    std::pair<to_status, std::string> r{s, to_last_error()};
    for (to_tensor_h t : h) EXPECT_EQ(to_tensor_destroy(t), TO_OK);
    return r;
  };
  for (int i = 0; i < c.n_slots(); ++i) {
    const TensorSpec& s = c.slot(i);
    if (s.null) continue;
    const std::string device = s.device.str();
    const to_status st = to_tensor_create(mem.data(c, i), int32_t(s.dtype), int32_t(s.shape.size()), s.shape.data(),
                                          s.strides.empty() ? nullptr : s.strides.data(), device.c_str(), &h[size_t(i)]);
    if (st != TO_OK) return result(st);
  }
  const size_t n = c.in.size();
  return result(to_op_run(int32_t(c.op), h.data(), int32_t(n), h.data() + n, int32_t(c.out.size()),
                          c.scalars.data(), int32_t(c.scalars.size()), c.ints.data(), int32_t(c.ints.size())));
}

class BadInput : public ::testing::TestWithParam<Row> {
 protected:
  static void SetUpTestSuite() { Registry::instance().load_plugins_from(TENSOR_OPS_TEST_PLUGIN_DIR); }
};

TEST_P(BadInput, RightErrorClassAndStatus) {
  const Row& row = GetParam();
  const auto [got, message] = run_cpp(row.call);
  EXPECT_EQ(outcome_name(got), std::string(outcome_name(row.want))) << "C++ API message: " << message;
  const auto [status, c_message] = run_c(row.call);
  EXPECT_STREQ(to_status_name(status), to_status_name(c_status_of(row.want))) << "C ABI message: " << c_message;
  if (row.want == Outcome::Ok) {
    EXPECT_EQ(c_message, "");
  } else {
    EXPECT_NE(c_message, "");
    if (row.same_message) {
      EXPECT_EQ(c_message, message);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Matrix, BadInput, ::testing::ValuesIn(all_rows()),
                         [](const ::testing::TestParamInfo<Row>& info) { return info.param.name; });

// The C ABI's causal flag is an int64: 2^32 + 1 ran as mode 1 (int() kept the low bits).
TEST(BadInputCausal, WholeInt64IsChecked) {
  for (OpId op : {OpId::softmax, OpId::attention, OpId::attention_backward}) {
    CallSpec c = valid_call(op, 4, 8);
    ASSERT_FALSE(c.ints.empty());
    c.ints[0] = (int64_t(1) << 32) + 1;
    const auto [status, message] = run_c(c);
    EXPECT_STREQ(to_status_name(status), "TO_ERR_INVALID_ARGUMENT") << message;
    EXPECT_NE(message.find("got 4294967297"), std::string::npos) << message;
  }
}

TEST(BadInputMatrix, CoversEveryOp) {
  ASSERT_EQ(all_ops().size(), size_t(TO_OP_COUNT));
  for (size_t i = 0; i < all_ops().size(); ++i) EXPECT_EQ(int(all_ops()[i].op), int(i));
}

}  // namespace
}  // namespace tensor_ops

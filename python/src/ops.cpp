// Op bindings: outputs are allocated by the Python layer with the caller's
// framework, or (None for an output, plain torch tensors in) made here
// (Note [outputs made in C++]); the GIL is released around the kernels (the row and elementwise
// ops: around those big enough to pay for it).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "convert.h"
#include "tensor_ops/ops.h"

namespace nb = nanobind;
using Array = nb::handle;

namespace tensor_ops::python {
namespace {

// An optional tensor argument: None -> absent.
struct Opt {
  bool present = false;
  Tensor t;
  Opt(nb::handle h, const char* arg, bool bf16) {
    if (!h.is_none()) {
      t = to_tensor(h, arg, bf16);
      present = true;
    }
  }
  const Tensor* get() const { return present ? &t : nullptr; }
};

// Releases the GIL around a kernel big enough to pay for it: a release and
// re-acquire costs ~0.2 us, as much as a 1x64 row op's kernel, and another
// Python thread gains nothing from a microsecond. Device data: always (the
// call may wait on a device queue).
class ReleaseIfBig {
 public:
  explicit ReleaseIfBig(const Tensor& t) {
    if (t.device().backend != "host" || t.nbytes() >= (int64_t(64) << 10)) state_ = PyEval_SaveThread();
  }
  ~ReleaseIfBig() {
    if (state_) PyEval_RestoreThread(state_);
  }
  ReleaseIfBig(const ReleaseIfBig&) = delete;
  ReleaseIfBig& operator=(const ReleaseIfBig&) = delete;

 private:
  PyThreadState* state_ = nullptr;
};

// What a binding returns: the output it made (Note [outputs made in C++]), or None.
nb::object made_or_none(nb::object made) { return made.is_valid() ? made : nb::none(); }
nb::object made_pair(nb::object a, nb::object b) {
  return a.is_valid() ? nb::object(nb::make_tuple(a, b)) : nb::object(nb::none());
}

}  // namespace

void init_ops(nb::module_& m) {
  m.def(
      "rms_norm",
      [](const Array& x, const Array& weight, const Array& out, double eps, double offset, bool bf16) {
        Tensor tx = to_tensor(x, "x", bf16), tw = to_tensor(weight, "weight", bf16);
        nb::object made;
        Tensor to = output(out, x, tx, "out", bf16, made);
        {
          ReleaseIfBig release(tx);
          rms_norm(tx, tw, to, eps, offset);
        }
        return made_or_none(made);
      },
      nb::arg("x"), nb::arg("weight"), nb::arg("out").none(), nb::arg("eps"), nb::arg("offset") = 0.0,
      nb::arg("bf16") = false,
      "rms_norm over the last dimension into out, times (offset + weight) (validated by the core).");
  m.def(
      "silu",
      [](const Array& x, const Array& out, bool bf16) {
        Tensor tx = to_tensor(x, "x", bf16);
        nb::object made;
        Tensor to = output(out, x, tx, "out", bf16, made);
        {
          ReleaseIfBig release(tx);
          silu(tx, to);
        }
        return made_or_none(made);
      },
      nb::arg("x"), nb::arg("out").none(), nb::arg("bf16") = false);
  m.def(
      "gelu",
      [](const Array& x, const Array& out, const std::string& approximate, bool bf16) {
        Tensor tx = to_tensor(x, "x", bf16);
        nb::object made;
        Tensor to = output(out, x, tx, "out", bf16, made);
        {
          ReleaseIfBig release(tx);
          gelu(tx, to, approximate);
        }
        return made_or_none(made);
      },
      nb::arg("x"), nb::arg("out").none(), nb::arg("approximate"), nb::arg("bf16") = false);
  m.def(
      "layer_norm",
      [](Array x, Array w, Array b, Array out, double eps, bool bf16) {
        Tensor tx = to_tensor(x, "x", bf16), tw = to_tensor(w, "weight", bf16);
        Opt tb(b, "bias", bf16);
        nb::object made;
        Tensor to = output(out, x, tx, "out", bf16, made);
        {
          ReleaseIfBig release(tx);
          layer_norm(tx, tw, tb.get(), to, eps);
        }
        return made_or_none(made);
      },
      nb::arg("x"), nb::arg("weight"), nb::arg("bias").none(), nb::arg("out").none(), nb::arg("eps"),
      nb::arg("bf16") = false);
  m.def(
      "rms_norm_backward",
      [](Array dy, Array x, Array w, Array dx, Array dw, double eps, double offset, bool bf16) {
        Tensor a = to_tensor(dy, "dy", bf16), b = to_tensor(x, "x", bf16), c = to_tensor(w, "weight", bf16);
        nb::object made, made_w;
        Tensor d = output(dx, x, b, "dx", bf16, made), e = output(dw, w, c, "dweight", bf16, made_w);
        {
          nb::gil_scoped_release release;
          rms_norm_backward(a, b, c, d, e, eps, offset);
        }
        return made_pair(made, made_w);
      },
      nb::arg("dy"), nb::arg("x"), nb::arg("weight"), nb::arg("dx").none(), nb::arg("dweight").none(),
      nb::arg("eps"), nb::arg("offset") = 0.0, nb::arg("bf16") = false);
  m.def(
      "layer_norm_backward",
      [](Array dy, Array x, Array w, Array dx, Array dw, Array db, double eps, bool bf16) {
        Tensor a = to_tensor(dy, "dy", bf16), b = to_tensor(x, "x", bf16), c = to_tensor(w, "weight", bf16),
               d = to_tensor(dx, "dx", bf16), e = to_tensor(dw, "dweight", bf16);
        Opt f(db, "dbias", bf16);
        nb::gil_scoped_release release;
        layer_norm_backward(a, b, c, d, e, f.get(), eps);
      },
      nb::arg("dy"), nb::arg("x"), nb::arg("weight"), nb::arg("dx"), nb::arg("dweight"), nb::arg("dbias").none(),
      nb::arg("eps"), nb::arg("bf16") = false);
  m.def(
      "add_rms_norm",
      [](Array x, Array r, Array w, Array out, Array rout, double eps, bool bf16) {
        Tensor a = to_tensor(x, "x", bf16), b = to_tensor(r, "residual", bf16), c = to_tensor(w, "weight", bf16);
        nb::object made, made_r;
        Tensor d = output(out, x, a, "out", bf16, made), e = output(rout, x, a, "residual_out", bf16, made_r);
        {
          ReleaseIfBig release(a);
          add_rms_norm(a, b, c, d, e, eps);
        }
        return made_pair(made, made_r);
      },
      nb::arg("x"), nb::arg("residual"), nb::arg("weight"), nb::arg("out").none(), nb::arg("residual_out").none(),
      nb::arg("eps"),
      nb::arg("bf16") = false);
  m.def(
      "softmax",
      [](Array x, Array out, double scale, int causal, bool log, bool bf16) {
        Tensor a = to_tensor(x, "x", bf16);
        nb::object made;
        Tensor b = output(out, x, a, "out", bf16, made);
        {
          ReleaseIfBig release(a);
          softmax(a, b, scale, causal, log);
        }
        return made_or_none(made);
      },
      nb::arg("x"), nb::arg("out").none(), nb::arg("scale"), nb::arg("causal"), nb::arg("log"), nb::arg("bf16") = false);
  m.def(
      "softmax_backward",
      [](Array dy, Array y, Array dx, double scale, bool log, bool bf16) {
        Tensor a = to_tensor(dy, "dy", bf16), b = to_tensor(y, "y", bf16);
        nb::object made;
        Tensor c = output(dx, y, b, "dx", bf16, made);
        {
          ReleaseIfBig release(b);
          softmax_backward(a, b, c, scale, log);
        }
        return made_or_none(made);
      },
      nb::arg("dy"), nb::arg("y"), nb::arg("dx").none(), nb::arg("scale"), nb::arg("log"), nb::arg("bf16") = false);
  m.def(
      "activation_backward",
      [](Array dy, Array x, Array dx, const std::string& act, const std::string& approx, bool bf16) {
        Tensor a = to_tensor(dy, "dy", bf16), b = to_tensor(x, "x", bf16);
        Activation ac = activation_from_name(act, approx);
        nb::object made;
        Tensor c = output(dx, x, b, "dx", bf16, made);
        {
          ReleaseIfBig release(b);
          activation_backward(a, b, c, ac);
        }
        return made_or_none(made);
      },
      nb::arg("dy"), nb::arg("x"), nb::arg("dx").none(), nb::arg("activation"), nb::arg("approximate"),
      nb::arg("bf16") = false);
  m.def(
      "glu",
      [](Array g, Array u, Array out, const std::string& act, const std::string& approx, bool bf16) {
        Tensor a = to_tensor(g, "gate", bf16), b = to_tensor(u, "up", bf16);
        Activation ac = activation_from_name(act, approx);
        nb::object made;
        Tensor c = output(out, g, a, "out", bf16, made);
        {
          ReleaseIfBig release(a);
          glu(a, b, c, ac);
        }
        return made_or_none(made);
      },
      nb::arg("gate"), nb::arg("up"), nb::arg("out").none(), nb::arg("activation"), nb::arg("approximate"),
      nb::arg("bf16") = false);
  m.def(
      "glu_backward",
      [](Array dy, Array g, Array u, Array dg, Array du, const std::string& act, const std::string& approx,
         bool bf16) {
        Tensor a = to_tensor(dy, "dy", bf16), b = to_tensor(g, "gate", bf16), c = to_tensor(u, "up", bf16);
        Activation ac = activation_from_name(act, approx);
        nb::object made, made_u;
        Tensor d = output(dg, g, b, "dgate", bf16, made), e = output(du, g, b, "dup", bf16, made_u);
        {
          ReleaseIfBig release(b);
          glu_backward(a, b, c, d, e, ac);
        }
        return made_pair(made, made_u);
      },
      nb::arg("dy"), nb::arg("gate"), nb::arg("up"), nb::arg("dgate").none(), nb::arg("dup").none(),
      nb::arg("activation"), nb::arg("approximate"), nb::arg("bf16") = false);
  m.def(
      "rope",
      [](Array x, Array cos, Array sin, Array pos, Array out, bool interleaved, bool inverse, bool bf16) {
        Tensor a = to_tensor(x, "x", bf16), b = to_tensor(cos, "cos", bf16), c = to_tensor(sin, "sin", bf16),
               d = to_tensor(pos, "positions");
        nb::object made;
        Tensor e = output(out, x, a, "out", bf16, made);
        {
          ReleaseIfBig release(a);
          rope(a, b, c, d, e, interleaved, inverse);
        }
        return made_or_none(made);
      },
      nb::arg("x"), nb::arg("cos"), nb::arg("sin"), nb::arg("positions"), nb::arg("out").none(),
      nb::arg("interleaved"), nb::arg("inverse"), nb::arg("bf16") = false);
  m.def(
      "attention",
      [](Array q, Array k, Array v, Array out, Array lse, int causal, double scale, bool bf16) {
        Tensor a = to_tensor(q, "q", bf16), b = to_tensor(k, "k", bf16), c = to_tensor(v, "v", bf16);
        nb::object made, made_lse;
        Tensor d = output(out, q, a, "out", bf16, made);
        std::vector<int64_t> lse_shape = a.shape();
        if (!lse_shape.empty()) lse_shape.pop_back();  // [batch, heads, seq]
        Tensor e = output(lse, q, a, std::move(lse_shape), DType::Float32, "lse", false, made_lse);
        {
          nb::gil_scoped_release release;
          attention(a, b, c, d, e, causal, scale);
        }
        return made_pair(made, made_lse);
      },
      nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out").none(), nb::arg("lse").none(), nb::arg("causal"),
      nb::arg("scale"), nb::arg("bf16") = false);
  m.def(
      "attention_backward",
      [](Array dout, Array q, Array k, Array v, Array out, Array lse, Array dq, Array dk, Array dv, int causal,
         double scale, bool bf16) {
        Tensor t0 = to_tensor(dout, "dout", bf16), t1 = to_tensor(q, "q", bf16), t2 = to_tensor(k, "k", bf16),
               t3 = to_tensor(v, "v", bf16), t4 = to_tensor(out, "out", bf16), t5 = to_tensor(lse, "lse"),
               t6 = to_tensor(dq, "dq", bf16), t7 = to_tensor(dk, "dk", bf16), t8 = to_tensor(dv, "dv", bf16);
        nb::gil_scoped_release release;
        attention_backward(t0, t1, t2, t3, t4, t5, t6, t7, t8, causal, scale);
      },
      nb::arg("dout"), nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"), nb::arg("lse"), nb::arg("dq"),
      nb::arg("dk"), nb::arg("dv"), nb::arg("causal"), nb::arg("scale"), nb::arg("bf16") = false);
  m.def(
      "cross_entropy",
      [](Array logits, Array target, Array loss, Array dlogits, int64_t ignore_index, double grad_scale,
         double label_smoothing, double z_loss, double softcap, bool bf16) {
        Tensor a = to_tensor(logits, "logits", bf16), b = to_tensor(target, "target"), c = to_tensor(loss, "loss");
        Opt d(dlogits, "dlogits", bf16);
        nb::gil_scoped_release release;
        cross_entropy(a, b, c, d.get(), ignore_index, grad_scale, label_smoothing, z_loss, softcap);
      },
      nb::arg("logits"), nb::arg("target"), nb::arg("loss"), nb::arg("dlogits").none(), nb::arg("ignore_index"),
      nb::arg("grad_scale"), nb::arg("label_smoothing") = 0.0, nb::arg("z_loss") = 0.0, nb::arg("softcap") = 0.0,
      nb::arg("bf16") = false);
  m.def(
      "linear",
      [](Array x, Array w, Array b, Array out, int64_t weight_layout, bool bf16) {
        Tensor tx = to_tensor(x, "x", bf16), tw = to_tensor(w, "weight", bf16);
        Opt tb(b, "bias", bf16);
        nb::object made;
        // x's shape with the last dim out_features: weight's rows (nk) or columns (kn)
        std::vector<int64_t> shape = tx.shape();
        if (!shape.empty()) shape.back() = tw.ndim() == 2 ? tw.shape()[weight_layout == 1 ? 1 : 0] : 0;
        Tensor to = output(out, x, tx, std::move(shape), tx.dtype(), "out", bf16, made);
        {
          ReleaseIfBig release(tw);
          linear(tx, tw, tb.get(), to, WeightLayout(weight_layout));
        }
        return made_or_none(made);
      },
      nb::arg("x"), nb::arg("weight"), nb::arg("bias").none(), nb::arg("out").none(), nb::arg("weight_layout") = 0,
      nb::arg("bf16") = false,
      "out = x weight^T (weight_layout 0: weight [N, K]) or x weight (1: weight [K, N]) (+ bias) for a few "
      "rows of x (validated by the core).");
  m.def(
      "data_ptr",
      [](const Array& x) {
        Tensor t = to_tensor(x, "x", true);
        return reinterpret_cast<uintptr_t>(t.data()) + t.byte_offset();
      },
      nb::arg("x"),
      "The data pointer the core sees for x (tests use it to prove zero-copy).");
  m.def(
      "backend_for", [](const Array& x) { return backend_for(to_tensor(x, "x")); }, nb::arg("x"),
      "Name of the backend an op on x would run on.");
}

}  // namespace tensor_ops::python

// The LLM op kernels (norms with backward, softmax, gated units, RoPE,
// attention, cross-entropy, linear), included by kernels_impl.h inside each ISA
// namespace. Every kernel has one signature: it processes work items
// [i0, i1) of a validated call (rows, positions or heads, as cpu_backend.cpp
// splits them) with a per-chunk fp32 scratch area, and returns 0 or a
// nonzero code for a bad index found in the data (positions, targets).
// Math is fp32 throughout; 16-bit inputs are converted row by row.

// n elements of a D row at element off to / from fp32 (a register at a time).
template <DType D>
inline void ld(const void* base, int64_t off, int64_t n, float* dst) {
  load_f32<D>(static_cast<const char*>(base) + off * int64_t(dtype_size(D)), dst, n);
}

template <DType D>
inline void st(const float* src, void* base, int64_t off, int64_t n) {
  store_f32<D>(src, static_cast<char*>(base) + off * int64_t(dtype_size(D)), n);
}

// Short dot product (attention head dims): fp32 lanes, no double.
inline float dot_short(const float* a, const float* b, int64_t n) {
  float acc[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) acc[j] += a[i + j] * b[i + j];
  for (; i < n; ++i) acc[i & 15] += a[i] * b[i];
  float s = 0;
  for (int j = 0; j < 16; ++j) s += acc[j];
  return s;
}

// ---- norms ----------------------------------------------------------------

// scratch: weight | bias (fp32)
// Note [layer_norm's mean]
// The mean summed as the row stands in fp32 lanes is an ulp or a few off.
// That matters only for a row whose spread is a few ulps or less: a row of
// one value normalised to that ulp over sqrt(eps), not 0 (up to 0.68 for a
// row of 12345.678). So a row whose variance about that mean is under
// (64 ulps)^2 takes its mean again as x0 + the mean of x - x0, x0 its first
// element (the shifted-data sum: such a row sums exact zeros), and its
// variance about that: two more passes for those rows only (a shifted sum
// for every row cost bf16 layer_norm 7-10%). Forward and backward decide
// alike, from the same sums (layer_mean_and).
template <DType D, bool Shifted>
TENSOR_OPS_VEC_INLINE float layer_mean(const void* xr, int64_t cols) {
  if constexpr (!Shifted) return float(vsum(cols, [&](int64_t i, auto a) { return ldx<D>(xr, i, a); }) / double(cols));
  const vf x0 = splat<vf>(ldx<D>(xr, 0, Part{1})[0]);
  return x0[0] + float(vsum(cols, [&](int64_t i, auto a) { return ldx<D>(xr, i, a) - x0; }) / double(cols));
}

// Note [layer_norm's corrected mean]
// The mean summed in fp32 lanes is off by a few ulps of |mean|, which for a
// row far from 0 (x = 1e5 + N(0, 1): an ulp is 0.008) is a few 1e-3 of its
// spread, and every output carried it: 8e-3 relative error where torch's
// Welford is 2.4e-3. The variance pass sums the deviations d = x - m too;
// their mean is m's error (d is exact or nearly: x and m are close), so the
// mean is m + sum(d) / n and the variance sum(d^2) / n - (sum(d) / n)^2 (the
// corrected two-pass algorithm): one more pass, from cache, for rows whose
// |mean| passes 16 deviations only (layer_corrected; a sum in the variance
// pass for every row cost fp32 layer_norm 3-10%). And
// x - mean is taken as (x - mean_hi) - mean_lo, the mean split into two
// floats: one float mean is itself half an ulp of |mean| off (4e-3 of the
// spread in that example, torch's error); x - mean_hi is exact for x near it.
// Whether a row's variance about its plain mean m is too small to trust m.
TENSOR_OPS_VEC_INLINE bool layer_mean_again(float m, double var) {
  const double ulp = double(__builtin_fabsf(m)) * 1.1920928955078125e-7;  // 2^-23 |m|
  return var <= (64 * ulp) * (64 * ulp);
}

// A row's mean (Note [layer_norm's mean]) and sums(mean), whose first
// element is the sum of (x - mean)^2: the one decision forward and backward
// share (their sums differ: the backward's add the gradient's).
template <DType D, class Sums>
TENSOR_OPS_VEC_INLINE auto layer_mean_and(const void* xr, int64_t cols, Sums sums) {
  float mean = layer_mean<D, false>(xr, cols);
  auto s = sums(mean);
  if (layer_mean_again(mean, s[0] / double(cols))) {
    mean = layer_mean<D, true>(xr, cols);
    s = sums(mean);
  }
  return std::make_pair(mean, s);
}

// Note [layer_norm's corrected mean]: (mean, variance) of a row from its
// float mean m and its variance about m; a row far from 0 (|m| above 16
// deviations) takes its deviations' sum about m in one more pass (from
// cache) and corrects both. Forward and backward decide alike (both from m
// and the sum of squares about it).
template <DType D>
TENSOR_OPS_VEC_INLINE std::pair<double, double> layer_corrected(const void* xr, int64_t cols, float m, double var) {
  if (double(m) * double(m) <= 256.0 * var) return {double(m), var};
  const double shift = vsum(cols, [&](int64_t i, auto a) { return ldx<D>(xr, i, a) - m; }) / double(cols);
  return {double(m) + shift, __builtin_fmax(var - shift * shift, 0.0)};
}

template <DType D>
int layer_norm_k(const to_op_call& c, int64_t r0, int64_t r1, float* scratch) {
  const to_tensor &x = c.inputs[0], &w = c.inputs[1], &b = c.inputs[2], &y = c.outputs[0];
  const int64_t cols = x.shape[1];
  // fp32 weight and bias are read in place; 16-bit ones converted once per
  // chunk (a chunk is a few rows: the copy was as large as the rows' data).
  const float *wf = static_cast<const float*>(w.data), *bf = static_cast<const float*>(b.data);
  if (D != DType::Float32) {
    ld<D>(w.data, 0, cols, scratch);
    wf = scratch;
    if (c.ints[0]) ld<D>(b.data, 0, cols, scratch + cols);
    bf = scratch + cols;
  }
  if (!c.ints[0]) {
    for (int64_t i = 0; i < cols; ++i) scratch[cols + i] = 0.0f;
    bf = scratch + cols;
  }
  const float eps = float(c.scalars[0]);
  for (int64_t r = r0; r < r1; ++r) {
    // Three passes over the row (the last two from cache); y from registers.
    const void* xr = row_of<D>(x, r);
    const auto ms = layer_mean_and<D>(xr, cols, [&](float m) {
      return vsums<1>(cols, [&](int64_t i, auto a) {
        const vf d = ldx<D>(xr, i, a) - m;
        return std::array<vf, 1>{d * d};
      });
    });
    // Note [layer_norm's corrected mean]: a row far from 0 corrects its mean
    // and variance by the deviations' own sum (one more pass, from cache).
    const auto [mean, var] = layer_corrected<D>(xr, cols, ms.first, ms.second[0] / double(cols));
    const float mean_hi = float(mean), mean_lo = float(mean - double(mean_hi));
    const float rstd = float(1.0 / __builtin_sqrt(var + double(eps)));
    const char* nx = next_row<D>(x, r, r1);
    if (mean_lo == 0.0f) {  // one float holds the mean (every row near 0)
      vmapx<D>(row_of<D>(y, r), cols, c.ints[7], [&](int64_t i, auto a) {
        prefetch_next<D>(nx, i);
        return (ldx<D>(xr, i, a) - mean_hi) * rstd * a.ld(wf + i) + a.ld(bf + i);
      });
      continue;
    }
    vmapx<D>(row_of<D>(y, r), cols, c.ints[7], [&](int64_t i, auto a) {
      prefetch_next<D>(nx, i);
      return (ldx<D>(xr, i, a) - mean_hi - mean_lo) * rstd * a.ld(wf + i) + a.ld(bf + i);
    });
  }
  return 0;
}

// scratch: weight | dweight partial | dbias partial (the partials zeroed
// here: chunk scratch comes unzeroed, cpu_backend.cpp). Two passes over a
// row for rms_norm, three for layer_norm (its variance about the mean, as
// the forward's), each after the first from cache: the sums, then dx (and
// the partials) from registers.
template <DType D, bool Layer>
int norm_backward_k(const to_op_call& c, int64_t r0, int64_t r1, float* scratch) {
  const to_tensor &dy = c.inputs[0], &x = c.inputs[1], &w = c.inputs[2], &dx = c.outputs[0];
  const int64_t cols = x.shape[1];
  float *wf = scratch, *dw = scratch + cols, *db = scratch + 2 * cols;
  ld<D>(w.data, 0, cols, wf);
  if (const float offset = Layer ? 0.0f : float(c.scalars[1]); offset != 0)  // rms_norm's offset + w
    for (int64_t i = 0; i < cols; ++i) wf[i] = offset + wf[i];
  for (int64_t i = 0; i < cols; ++i) dw[i] = 0.0f, db[i] = 0.0f;  // this chunk's partials
  const double eps = c.scalars[0], n = double(cols);
  const bool nt = c.ints[7];
  for (int64_t r = r0; r < r1; ++r) {
    const void *xr = row_of<D>(x, r), *gr = row_of<D>(dy, r);
    // x_hat = (x - mean) rstd, g = dy w (rounded: the same g in the sums and
    // in dx); c1 = mean(g x_hat), c2 = mean(g).
    float mean = 0, mean_lo = 0, rstd, c1, c2 = 0;
    if constexpr (Layer) {
      // the forward's mean and variance (layer_mean_and), the gradient's sums in the same pass
      const auto [m, s] = layer_mean_and<D>(xr, cols, [&](float mu) {
        return vsums<3>(cols, [&](int64_t i, auto a) {
          const vf d = ldx<D>(xr, i, a) - mu, g = rounded(ldx<D>(gr, i, a) * a.ld(wf + i));
          return std::array<vf, 3>{d * d, g * d, g};
        });
      });
      // Note [layer_norm's corrected mean]: the forward's mean and variance;
      // g's sum about the corrected mean is sum(g d) - (mean - m) sum(g).
      const auto [mean_d, var] = layer_corrected<D>(xr, cols, m, s[0] / n);
      mean = float(mean_d), mean_lo = float(mean_d - double(mean));
      rstd = float(1.0 / __builtin_sqrt(var + eps));
      c1 = float((s[1] - (mean_d - double(m)) * s[2]) * double(rstd) / n);
      c2 = float(s[2] / n);
    } else {
      const auto s = vsums<2>(cols, [&](int64_t i, auto a) {
        const vf xv = ldx<D>(xr, i, a);
        return std::array<vf, 2>{xv * xv, rounded(ldx<D>(gr, i, a) * a.ld(wf + i)) * xv};
      });
      rstd = float(1.0 / __builtin_sqrt(s[0] / n + eps));
      c1 = float(s[1] * double(rstd) / n);
    }
    const char *nx = next_row<D>(x, r, r1), *ng = next_row<D>(dy, r, r1);
    vmapx<D>(row_of<D>(dx, r), cols, nt, [&](int64_t i, auto a) {
      prefetch_next<D>(nx, i);
      prefetch_next<D>(ng, i);
      const vf gy = ldx<D>(gr, i, a);
      vf xh = ldx<D>(xr, i, a);
      if constexpr (Layer) xh = xh - mean - mean_lo;
      xh = xh * rstd;
      a.st(dw + i, a.ld(dw + i) + gy * xh);
      if constexpr (Layer) a.st(db + i, a.ld(db + i) + gy);
      return rstd * (rounded(gy * a.ld(wf + i)) - c2 - xh * c1);
    });
  }
  return 0;
}

// scratch: row sum (as D) | weight
template <DType D>
int add_rms_norm_k(const to_op_call& c, int64_t r0, int64_t r1, float* scratch) {
  const to_tensor &x = c.inputs[0], &res = c.inputs[1], &w = c.inputs[2], &y = c.outputs[0],
                  &ro = c.outputs[1];
  const int64_t cols = x.shape[1];
  float* a = scratch;
  const float* wf = static_cast<const float*>(w.data);  // fp32: read in place
  if (D != DType::Float32) {
    ld<D>(w.data, 0, cols, scratch + cols);
    wf = scratch + cols;
  }
  const double eps = c.scalars[0];
  const bool nt = c.ints[7];
  for (int64_t r = r0; r < r1; ++r) {
    // One pass over x and residual: their sum rounded to D once and kept in
    // a as D (the residual is normalised as stored); squares summed. The
    // new residual is a copied as it is, y is read from it.
    const void *xr = row_of<D>(x, r), *rr = row_of<D>(res, r);
    const double ss = vsum(cols, [&](int64_t i, auto p) {
      stx<D>(a, i, ldx<D>(xr, i, p) + ldx<D>(rr, i, p), p);
      const vf s = ldx<D>(a, i, p);
      return s * s;
    });
    vmapx<D>(row_of<D>(ro, r), cols, nt, [&](int64_t i, auto p) { return ldraw<D>(a, i, p); });
    const float scale = float(1.0 / __builtin_sqrt(ss / double(cols) + eps));
    const char *nx = next_row<D>(x, r, r1), *nr = next_row<D>(res, r, r1);
    vmapx<D>(row_of<D>(y, r), cols, nt, [&](int64_t i, auto p) {
      prefetch_next<D>(nx, i);
      prefetch_next<D>(nr, i);
      return ldx<D>(a, i, p) * scale * p.ld(wf + i);
    });
  }
  return 0;
}

// ---- softmax --------------------------------------------------------------

// Keys query i (of Lq) sees under causal mode 1 (bottom-right: j <= i + Lk - Lq)
// or 2 (top-left: j <= i); see kCausal* in ops.h.
inline int64_t causal_visible(int64_t mode, int64_t i, int64_t Lq, int64_t Lk) {
  const int64_t n = i + 1 + (mode == 2 ? 0 : Lk - Lq);
  return n < 0 ? 0 : (n > Lk ? Lk : n);
}

template <DType D>
int softmax_k(const to_op_call& c, int64_t r0, int64_t r1, float* scratch) {
  const to_tensor &x = c.inputs[0], &y = c.outputs[0];
  const int64_t cols = x.shape[1];
  const float scale = float(c.scalars[0]);
  const int64_t causal = c.ints[0];
  const bool log = c.ints[1], nt = c.ints[7];
  const int64_t lq = c.ints[2] > 0 ? c.ints[2] : 1;
  const float masked = log ? -__builtin_inff() : 0.0f;
  constexpr int64_t item = dtype_size(D);
  float* v = scratch;
  for (int64_t r = r0; r < r1; ++r) {
    int64_t valid = cols;
    if (causal) valid = causal_visible(causal, r % lq, lq, cols);
    // Pass 1 reads x; the others find the row in cache. A row holding a NaN,
    // or whose max is infinite, is all NaN (as the sum would make it: inf -
    // inf); the others have x - m <= 0 and take exp_nonpos_t.
    // A 16-bit row is widened once (RowF32, into v; the exp pass then
    // overwrites v[i] with e^x after reading it).
    const RowF32<D> xr{row_of<D>(x, r), v};
    char* yr = row_of<D>(y, r);
    bool nan = false;
    const float m = vmax(valid, [&](int64_t i, auto a) { return xr.first(i, a) * scale; }, &nan);
    if (valid > 0 && (nan || !__builtin_isfinite(m))) {
      vmapx<D>(yr, valid, nt, [&](int64_t, auto) { return splat<vf>(__builtin_nanf("")); });
    } else if (valid > 0 && log) {
      // scale x rounded before m is subtracted (rounded(): no FMA), as the
      // max was taken: fused, x * scale - m is the exact product's excess
      // over the rounded max, up to half an ulp of m above 0, which e^
      // overflows once |scale x| passes ~2^31 (a row of 1e10 at scale 0.7
      // gave NaN).
      const double sum =
          vsum(valid, [&](int64_t i, auto a) { return exp_nonpos_t(rounded(xr.again(i, a) * scale) - m); });
      // (v - m) - log(sum), not v - (m + log(sum)): near the float limit
      // m + log(sum) rounds log(sum) away.
      const float ls = float(__builtin_log(sum));
      vmapx<D>(yr, valid, nt, [&](int64_t i, auto a) { return (rounded(xr.again(i, a) * scale) - m) - ls; });
    } else if (valid > 0) {
      // v = exp(scale x - m) and its sum in one pass (compute-bound: the
      // next row is prefetched meanwhile); y = v / sum from registers.
      // scale x rounded as in the log branch.
      const char* next = next_row<D>(x, r, r1);
      const double sum = vsum(valid, [&](int64_t i, auto a) {
        prefetch_next<D>(next, i);
        const vf e = exp_nonpos_t(rounded(xr.again(i, a) * scale) - m);
        a.st(v + i, e);
        return e;
      });
      const float inv = float(1.0 / sum);
      vmapx<D>(yr, valid, nt, [&](int64_t i, auto a) { return a.ld(v + i) * inv; });
    }
    if (valid < cols)
      vmapx<D>(yr + valid * item, cols - valid, nt, [&](int64_t, auto) { return splat<vf>(masked); });
  }
  return 0;
}

// Two passes over dy and y (the second from cache), dx from registers.
template <DType D>
int softmax_backward_k(const to_op_call& c, int64_t r0, int64_t r1, float*) {
  const to_tensor &dy = c.inputs[0], &y = c.inputs[1], &dx = c.outputs[0];
  const int64_t cols = y.shape[1];
  const float scale = float(c.scalars[0]);
  const bool nt = c.ints[7];
  for (int64_t r = r0; r < r1; ++r) {
    const void *gr = row_of<D>(dy, r), *pr = row_of<D>(y, r);
    const char *ng = next_row<D>(dy, r, r1), *np = next_row<D>(y, r, r1);
    if (c.ints[1]) {  // log_softmax: y is log p
      const float s = float(vsum(cols, [&](int64_t i, auto a) { return ldx<D>(gr, i, a); }));
      vmapx<D>(row_of<D>(dx, r), cols, nt, [&](int64_t i, auto a) {
        prefetch_next<D>(ng, i);
        prefetch_next<D>(np, i);
        return scale * (ldx<D>(gr, i, a) - exp_t(ldx<D>(pr, i, a)) * s);
      });
    } else {
      const float s = float(vsum(cols, [&](int64_t i, auto a) { return ldx<D>(gr, i, a) * ldx<D>(pr, i, a); }));
      vmapx<D>(row_of<D>(dx, r), cols, nt, [&](int64_t i, auto a) {
        prefetch_next<D>(ng, i);
        prefetch_next<D>(np, i);
        return scale * ldx<D>(pr, i, a) * (ldx<D>(gr, i, a) - s);
      });
    }
  }
  return 0;
}

// ---- activations and gated units (flat element ranges) -------------------

// The activation is a template argument so the per-element loops carry no
// branch and vectorise; T is float or vf.
template <int A, class T>
TENSOR_OPS_VEC_INLINE T act_t(T x) {
  if constexpr (A == 0) return silu_t(x);
  else if constexpr (A == 1) return gelu_erf_t(x);
  else return gelu_tanh_t(x);
}

// sigmoid(v) with a true divide: the gradients' 1 - s must be exactly 0
// where s saturates (torch's NaN at +inf, 0 at huge x), which the lanes'
// reciprocal estimate (1 - 2^-24 at 1) would break.
template <class T>
TENSOR_OPS_VEC_INLINE T sigmoid_div_t(T v) {
  return v < splat<T>(-87.3f) ? splat<T>(0.0f) : 1.0f / (1.0f + exp_t(-v));
}

// d silu / dx given s = sigmoid(x).
template <class T>
TENSOR_OPS_VEC_INLINE T silu_grad_t(T x, T s) {
  return s * (1.0f + x * (1.0f - s));
}

// d act / dx on float or vf lanes. At the special values these give torch's
// answers: NaN at +-inf (an infinite x times a zero factor), and for the
// tanh form also NaN where x * x overflows (torch's 0 * inf), hence x * x
// computed first.
template <int A, class T>
TENSOR_OPS_VEC_INLINE T act_grad_t(T x) {
  if constexpr (A == 0) {
    return silu_grad_t(x, sigmoid_div_t(x));
  } else if constexpr (A == 1) {
    return gelu_cdf_t(x) + x * 0.39894228040143268f * exp_flush_t(-0.5f * x * x);
  } else {
    const float k = 0.79788456080286536f;
    const T u = k * (x + 0.044715f * x * x * x);
    const T s = sigmoid_div_t(2.0f * u);
    return s + x * s * (1.0f - s) * 2.0f * k * (1.0f + 3.0f * 0.044715f * (x * x));
  }
}

// f<A>() for the activation id a (0 silu, 1 gelu, 2 gelu tanh).
template <class F>
inline void with_activation(int64_t a, F f) {
  if (a == 0)
    f(std::integral_constant<int, 0>{});
  else if (a == 1)
    f(std::integral_constant<int, 1>{});
  else
    f(std::integral_constant<int, 2>{});
}

// Elementwise kernels see the views as one flat span of rows * cols
// elements when cpu_backend.cpp sets ints[3] (all contiguous); otherwise
// [i0, i1) are rows. f(input offsets (three: the third 0 where there are
// two), output offsets (as many as outputs, up to two), n) per block of at
// most kBlock elements; the inputs prefetched a block ahead (Note
// [elementwise prefetch]).
template <DType D, class F>
inline void for_spans(const to_op_call& c, int64_t i0, int64_t i1, F f) {
  const int64_t cols = c.inputs[0].shape[1];
  auto block = [&](int64_t r, int64_t s, int64_t n, int64_t rest) {
    std::array<int64_t, 5> o{};
    for (int k = 0; k < c.n_inputs && k < 3; ++k) {
      o[size_t(k)] = r * c.inputs[k].strides[0] + s;
      prefetch_ahead<D>(static_cast<const char*>(c.inputs[k].data) + o[size_t(k)] * int64_t(dtype_size(D)), n, rest);
    }
    for (int k = 0; k < c.n_outputs && k < 2; ++k) o[size_t(3 + k)] = r * c.outputs[k].strides[0] + s;
    f(o[0], o[1], o[2], o[3], o[4], n);
  };
  if (c.ints[3]) {  // flat: every view's stride is cols (or one row), so r * stride + s is s
    for (int64_t s = i0; s < i1; s += kBlock) block(0, s, min64(kBlock, i1 - s), i1 - s);
    return;
  }
  for (int64_t r = i0; r < i1; ++r)
    for (int64_t s = 0; s < cols; s += kBlock) block(r, s, min64(kBlock, cols - s), cols - s);
}

// The backward units read and write in registers (16-bit widened and
// narrowed there, no fp32 row buffer); outputs may alias inputs at the same
// index (each register is read before it is written).
template <DType D>
int activation_backward_k(const to_op_call& c, int64_t i0, int64_t i1, float*) {
  constexpr int64_t item = dtype_size(D);
  for_spans<D>(c, i0, i1, [&](int64_t o0, int64_t o1, int64_t, int64_t oy, int64_t, int64_t n) {
    const void* gp = static_cast<const char*>(c.inputs[0].data) + o0 * item;
    const void* xp = static_cast<const char*>(c.inputs[1].data) + o1 * item;
    void* yp = static_cast<char*>(c.outputs[0].data) + oy * item;
    with_activation(c.ints[0], [&](auto A) {
      vmapx<D>(yp, n, c.ints[7], [&](int64_t i, auto p) {
        return ldx<D>(gp, i, p) * act_grad_t<decltype(A)::value>(ldx<D>(xp, i, p));
      });
    });
  });
  return 0;
}

template <DType D>
int glu_k(const to_op_call& c, int64_t i0, int64_t i1, float*) {
  const int64_t a = c.ints[0];
  for_spans<D>(c, i0, i1, [&](int64_t o0, int64_t o1, int64_t, int64_t oy, int64_t, int64_t n) {
    constexpr int64_t item = dtype_size(D);
    const void* gp = static_cast<const char*>(c.inputs[0].data) + o0 * item;
    const void* up = static_cast<const char*>(c.inputs[1].data) + o1 * item;
    void* yp = static_cast<char*>(c.outputs[0].data) + oy * item;
    with_activation(a, [&](auto A) {
      vmapx<D>(yp, n, c.ints[7],
               [&](int64_t i, auto p) { return act_t<decltype(A)::value>(ldx<D>(gp, i, p)) * ldx<D>(up, i, p); });
    });
  });
  return 0;
}

template <DType D>
int glu_backward_k(const to_op_call& c, int64_t i0, int64_t i1, float*) {
  const int64_t a = c.ints[0];
  // inputs: dy, gate, up; outputs: dgate, dup (same layout as dy when flat).
  constexpr int64_t item = dtype_size(D);
  auto at = [](const to_tensor& t, int64_t off) { return static_cast<char*>(t.data) + off * item; };
  auto run = [&](int64_t ody, int64_t og, int64_t ou, int64_t odg, int64_t odu, int64_t n) {
    const void *dyp = at(c.inputs[0], ody), *gp = at(c.inputs[1], og), *up = at(c.inputs[2], ou);
    void *dgp = at(c.outputs[0], odg), *dup = at(c.outputs[1], odu);
    with_activation(a, [&](auto A) {
      constexpr int K = decltype(A)::value;
      auto step = [&](int64_t i, auto p) {
        const vf g = ldx<D>(dyp, i, p), gv = ldx<D>(gp, i, p), uv = ldx<D>(up, i, p);
        if constexpr (K == 0) {  // silu and its gradient from one sigmoid
          const vf s = sigmoid_div_t(gv);
          stx<D>(dgp, i, g * uv * silu_grad_t(gv, s), p);
          stx<D>(dup, i, g * (gv * s), p);
        } else {
          stx<D>(dgp, i, g * uv * act_grad_t<K>(gv), p);
          stx<D>(dup, i, g * act_t<K>(gv), p);
        }
      };
      int64_t i = 0;
      for (; i + kVW <= n; i += kVW) step(i, Full{});
      if (i < n) step(i, Part{int(n - i)});
    });
  };
  for_spans<D>(c, i0, i1, run);
  return 0;
}

// ---- RoPE: items are (batch, seq) positions --------------------------------

inline int64_t index_at(const to_tensor& t, int64_t i) {
  return t.dtype == int32_t(DType::Int64) ? static_cast<const int64_t*>(t.data)[i]
                                           : int64_t(static_cast<const int32_t*>(t.data)[i]);
}

// scratch: x head row | cos | sin
template <DType D>
int rope_k(const to_op_call& c, int64_t i0, int64_t i1, float* scratch) {
  const to_tensor &x = c.inputs[0], &cs = c.inputs[1], &sn = c.inputs[2], &pos = c.inputs[3], &y = c.outputs[0];
  const int64_t S = x.shape[1], H = x.shape[2], Dm = x.shape[3];
  const int64_t P = cs.shape[0], half = cs.shape[1];
  const bool inter = c.ints[0];
  const float sign = c.ints[1] ? -1.0f : 1.0f;
  float *v = scratch, *cv = scratch + Dm, *sv = scratch + Dm + half;
  for (int64_t it = i0; it < i1; ++it) {
    const int64_t b = it / S, s = it % S;
    const int64_t p = index_at(pos, (pos.shape[0] == 1 ? 0 : b) * pos.strides[0] + s);
    if (p < 0 || p >= P) return 1;
    ld<D>(cs.data, p * cs.strides[0], half, cv);
    ld<D>(sn.data, p * sn.strides[0], half, sv);
    if (!inter) {
      // rotate_half pairs (i, i + half): both halves in registers, x read
      // before y is written (y may be x), the next position prefetched.
      const char* nx = it + 1 < i1 ? row_of<D>(x, 0) + ((it + 1) * H * Dm) * int64_t(dtype_size(D)) : nullptr;
      for (int64_t h = 0; h < H; ++h) {
        const int64_t off = ((b * S + s) * H + h) * Dm;
        const char* xr = row_of<D>(x, 0) + off * int64_t(dtype_size(D));
        char* yr = row_of<D>(y, 0) + off * int64_t(dtype_size(D));
        auto step = [&](int64_t i, auto a) {
          prefetch_next<D>(nx, h * Dm + i);
          prefetch_next<D>(nx, h * Dm + half + i);
          const vf x1 = ldx<D>(xr, i, a), x2 = ldx<D>(xr, i + half, a), co = a.ld(cv + i),
                   si = a.ld(sv + i) * sign;
          stx<D>(yr, i, x1 * co - x2 * si, a);
          stx<D>(yr, i + half, x2 * co + x1 * si, a);
        };
        int64_t i = 0;
        for (; i + kVW <= half; i += kVW) step(i, Full{});
        if (i < half) step(i, Part{int(half - i)});
        if (const int64_t r = 2 * half; r < Dm)  // partial rotary: the rest as it is
          vmapx<D>(yr + r * int64_t(dtype_size(D)), Dm - r, false,
                   [&](int64_t j, auto a) { return ldraw<D>(xr + r * int64_t(dtype_size(D)), j, a); });
      }
      continue;
    }
    for (int64_t h = 0; h < H; ++h) {
      const int64_t off = ((b * S + s) * H + h) * Dm;
      ld<D>(x.data, off, Dm, v);
      for (int64_t i = 0; i < half; ++i) {
        const int64_t a = inter ? 2 * i : i, bb = inter ? 2 * i + 1 : i + half;
        const float x1 = v[a], x2 = v[bb], co = cv[i], si = sign * sv[i];
        v[a] = x1 * co - x2 * si;
        v[bb] = x2 * co + x1 * si;
      }
      st<D>(v, y.data, off, Dm);
    }
  }
  return 0;
}

// ---- attention ---------------------------------------------------------------

// Causal attention shows key j to query position i when j <= i + offset:
// offset Lk - Lq bottom-right aligned (ints[0] == 1), 0 top-left (2); see
// causal_visible and kCausal* in ops.h.
inline int64_t attention_causal_offset(const to_op_call& c, int64_t Lq, int64_t Lk) {
  return c.ints[0] == 2 ? 0 : Lk - Lq;
}

#include "attention_flash.h"

// ---- cross-entropy: items are rows ----------------------------------------

// tanh(u): Cephes tanhf's odd polynomial below |u| = 0.625 (no cancellation
// near 0), 1 - 2 / (e^2|u| + 1) with the sign above; branch-free selects.
template <class T>
TENSOR_OPS_VEC_INLINE T tanh_t(T u) {
  const T a = abs_t(u), s = u * u;
  const T small =
      ((((-5.70498872745e-3f * s + 2.06390887954e-2f) * s - 5.37397155531e-2f) * s + 1.33314422036e-1f) * s -
       3.33332819422e-1f) * s * u + u;
  const T e = exp_nonpos_t(-2.0f * a);  // e^-2|u| <= 1
  const T big = (1.0f - e) * recip_t(1.0f + e);
  const T sbig = from_bits(as_bits(big) | (as_bits(u) & 0x80000000u));
  return a < splat<T>(0.625f) ? small : sbig;
}

// One element of D at p (a target logit) and back.
template <DType D>
TENSOR_OPS_VEC_INLINE float get1(const void* row, int64_t i) {
  if constexpr (D == DType::Float32) return static_cast<const float*>(row)[i];
  else if constexpr (D == DType::BFloat16) return bf16_bits_to_f32(static_cast<const uint16_t*>(row)[i]);
  else return half_bits_to_f32(static_cast<const uint16_t*>(row)[i]);
}
template <DType D>
TENSOR_OPS_VEC_INLINE void set1(void* row, int64_t i, float v) {
  if constexpr (D == DType::Float32) static_cast<float*>(row)[i] = v;
  else if constexpr (D == DType::BFloat16) static_cast<uint16_t*>(row)[i] = f32_to_bf16_bits(v);
  else static_cast<uint16_t*>(row)[i] = f32_to_half_bits(v);
}

// ints[0] ignore_index, ints[1] has_grad; scalars[0] grad_scale, [1]
// label_smoothing, [2] z_loss, [3] softcap (0: none). dlogits may be the
// logits themselves (in place): each row is read whole before it is written.
// Passes per row: max (the only read from memory; softcapped logits kept in
// scratch), sum of exp (from L2; e kept in scratch when the gradient needs
// it), the gradient from registers. scratch: one row.
template <DType D>
int cross_entropy_k(const to_op_call& c, int64_t r0, int64_t r1, float* scratch) {
  const to_tensor &lg = c.inputs[0], &tg = c.inputs[1], &loss = c.outputs[0], &dl = c.outputs[1];
  const int64_t C = lg.shape[1];
  const int64_t ignore = c.ints[0];
  const bool grad = c.ints[1], nt = c.ints[7];
  const float gscale = float(c.scalars[0]);
  const double eps = c.scalars[1], zl = c.scalars[2];
  const float cap = float(c.scalars[3]), inv_cap = cap > 0 ? 1.0f / cap : 0.0f;
  const bool softcap = cap > 0;
  float* v = scratch;
  // The rest of a row given its max: the loss, then the gradient.
  auto row_loss = [&](int64_t r, int64_t t, float m, const void* xr, char* grow, auto z) {
    float* lrow = static_cast<float*>(loss.data) + r;
    const float zt = softcap ? v[t] : get1<D>(xr, t);
    const char* next = next_row<D>(lg, r, r1);
    const bool keep_e = grad && !softcap;
    const double sum = vsum(C, [&](int64_t i, auto a) {
      prefetch_next<D>(next, i);
      if (!keep_e) return exp_nonpos_sum_t(z(i, a) - m);  // no stored e^x: 0 or 2.7e-38 alike
      const vf e = exp_nonpos_t(z(i, a) - m);
      a.st(v + i, e);
      return e;
    });
    // The loss as (m - zt) + log(sum), not (m + log(sum)) - zt: at |m| past
    // ~1e15 the sum m + log(sum) rounds log(sum) away even in double (a row of
    // four equal 1e19 logits lost log 4 = 1.386 entirely).
    const double lsum = __builtin_log(sum), lse = double(m) + lsum;
    double l = (double(m) - double(zt)) + lsum;
    if (eps != 0) {
      const double mean = vsum(C, [&](int64_t i, auto a) { return z(i, a); }) / double(C);
      l = (1.0 - eps) * l + eps * ((double(m) - mean) + lsum);
    }
    l += zl * lse * lse;
    *lrow = float(l);
    if (!grad) return;
    // d/dz = p (1 + 2 z_loss lse) - eps / C - (1 - eps) onehot; through the
    // softcap times 1 - tanh^2. The target's element is written after the row.
    const float k1 = float((1.0 + 2.0 * zl * lse) / sum) * gscale, c0 = float(eps / double(C)) * gscale;
    if (softcap) {
      vmapx<D>(grow, C, nt, [&](int64_t i, auto a) {
        const vf y = a.ld(v + i), th = y * inv_cap;
        return (exp_nonpos_t(y - m) * k1 - c0) * (1.0f - th * th);
      });
    } else {
      vmapx<D>(grow, C, nt, [&](int64_t i, auto a) { return a.ld(v + i) * k1 - c0; });
    }
    // The target's p - 1 as (e - sum) / sum in double: no cancellation when
    // the row is confident (p near 1).
    const double et = double(exp_nonpos_t(zt - m)), pt = et / sum;
    const double gt = ((et - sum) / sum * (1.0 - eps) + pt * (eps + 2.0 * zl * lse) - eps / double(C)) * gscale;
    const float th = zt * inv_cap;
    set1<D>(grow, t, float(gt) * (softcap ? 1.0f - th * th : 1.0f));
  };
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t t = index_at(tg, r * tg.strides[0]);
    float* lrow = static_cast<float*>(loss.data) + r;
    char* grow = grad ? row_of<D>(dl, r) : nullptr;
    if (t == ignore) {
      *lrow = 0;
      if (grad) vmapx<D>(grow, C, nt, [](int64_t, auto) { return splat<vf>(0.0f); });
      continue;
    }
    if (t < 0 || t >= C) return 2;
    const void* xr = row_of<D>(lg, r);
    bool nan = false;
    float m;
    if (softcap) {
      m = vmax(C, [&](int64_t i, auto a) {
        const vf x = ldx<D>(xr, i, a);
        const vf y = cap * tanh_t(x * inv_cap);
        a.st(v + i, y);
        return x == x ? y : x;  // NaN stays NaN
      }, &nan);
    } else {
      m = vmax(C, [&](int64_t i, auto a) { return ldx<D>(xr, i, a); }, &nan);
    }
    if (nan || !__builtin_isfinite(m)) {
      // A NaN, an infinite max or an all -inf row: NaN, as the sum would make it.
      *lrow = __builtin_nanf("");
      if (grad) vmapx<D>(grow, C, nt, [](int64_t, auto) { return splat<vf>(__builtin_nanf("")); });
      continue;
    }
    // The logit as the softmax sees it: softcapped (in scratch) or the row's.
    if (softcap) row_loss(r, t, m, xr, grow, [&](int64_t i, auto a) { return a.ld(v + i); });
    else row_loss(r, t, m, xr, grow, [&](int64_t i, auto a) { return ldx<D>(xr, i, a); });
  }
  return 0;
}

// ---- linear: items are blocks of rows of w (of columns of a [K, N] w) -----

// x's rows as fp32: in place for fp32, else widened into scratch ([M][K]);
// *xs: their row stride.
template <DType D>
inline const float* linear_x_f32(const to_tensor& x, float* scratch, int64_t* xs) {
  const int64_t M = x.shape[0], K = x.shape[1];
  *xs = x.strides[0];
  if constexpr (D == DType::Float32) {
    return static_cast<const float*>(x.data);
  } else {
    for (int64_t r = 0; r < M; ++r) ld<D>(x.data, r * x.strides[0], K, scratch + r * K);
    *xs = K;
    return scratch;
  }
}

// f(r, NR) for x's rows in groups of four (the last one to four rows), NR
// an integral_constant: each group reads the item's block of w once.
template <class F>
inline void linear_row_groups(int64_t M, F f) {
  for (int64_t r = 0; r < M; r += 4) {
    switch (min64(4, M - r)) {
      case 4: f(r, std::integral_constant<int, 4>{}); break;
      case 3: f(r, std::integral_constant<int, 3>{}); break;
      case 2: f(r, std::integral_constant<int, 2>{}); break;
      default: f(r, std::integral_constant<int, 1>{}); break;
    }
  }
}

#include "linear_kn.h"
#include "linear_rows.h"

#define TENSOR_OPS_DTYPE_DISPATCH(fn)                                                \
  int fn(const to_op_call& c, int64_t i0, int64_t i1, float* s) {                  \
    switch (DType(c.inputs[0].dtype)) {                                             \
      case DType::Float16: return fn##_k<DType::Float16>(c, i0, i1, s);            \
      case DType::BFloat16: return fn##_k<DType::BFloat16>(c, i0, i1, s);          \
      default: return fn##_k<DType::Float32>(c, i0, i1, s);                        \
    }                                                                               \
  }

TENSOR_OPS_DTYPE_DISPATCH(layer_norm)
TENSOR_OPS_DTYPE_DISPATCH(add_rms_norm)
TENSOR_OPS_DTYPE_DISPATCH(softmax)
TENSOR_OPS_DTYPE_DISPATCH(softmax_backward)
TENSOR_OPS_DTYPE_DISPATCH(activation_backward)
TENSOR_OPS_DTYPE_DISPATCH(glu)
TENSOR_OPS_DTYPE_DISPATCH(glu_backward)
TENSOR_OPS_DTYPE_DISPATCH(rope)
TENSOR_OPS_DTYPE_DISPATCH(attention)
TENSOR_OPS_DTYPE_DISPATCH(attention_backward)
TENSOR_OPS_DTYPE_DISPATCH(cross_entropy)
TENSOR_OPS_DTYPE_DISPATCH(linear)

template <DType D>
int rms_norm_backward_k(const to_op_call& c, int64_t i0, int64_t i1, float* s) {
  return norm_backward_k<D, false>(c, i0, i1, s);
}
template <DType D>
int layer_norm_backward_k(const to_op_call& c, int64_t i0, int64_t i1, float* s) {
  return norm_backward_k<D, true>(c, i0, i1, s);
}
TENSOR_OPS_DTYPE_DISPATCH(rms_norm_backward)
TENSOR_OPS_DTYPE_DISPATCH(layer_norm_backward)

// Partial sums (dweight) back to the weight's dtype.
void from_float(DType dt, const float* src, void* dst, int64_t n) {
  switch (dt) {
    case DType::Float16: st<DType::Float16>(src, dst, 0, n); break;
    case DType::BFloat16: st<DType::BFloat16>(src, dst, 0, n); break;
    default: st<DType::Float32>(src, dst, 0, n); break;
  }
}

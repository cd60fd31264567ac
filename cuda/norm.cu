// The norms over the last dimension: rms_norm, layer_norm, add_rms_norm and
// the rms / layer norm backward. One block per row, fp32 accumulation (the
// CPU reference's math), 16-byte chunks where the layout allows (V > 1).
#include <algorithm>

#include "common.cuh"

namespace tensor_ops::gpu {
namespace {

// Every pass over a row visits chunk i from the same thread, so an output may
// be its input (in place): each element is read before the same thread writes
// it, and other threads never touch it. Blocks stride over rows past the grid.
template <class T, int V>
__global__ void __launch_bounds__(kMaxBlockThreads)
    rms_norm_kernel(const T* x, int64_t x_stride, const T* __restrict__ w, T* y, int64_t y_stride,
                    int64_t rows, int64_t cols, float eps) {
  const int64_t chunks = cols / V;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * x_stride;
    T* yr = y + r * y_stride;
    float squares = 0.0f;
    for (int64_t i = threadIdx.x; i < chunks; i += blockDim.x) {
      float a[V];
      load_chunk(xr, i, a);
#pragma unroll
      for (int k = 0; k < V; ++k) squares += a[k] * a[k];
    }
    const float sum = block_sum(squares);
    // One double op per row: the same rounding as the CPU backend's scale.
    const float scale = float(1.0 / sqrt(double(sum) / double(cols) + double(eps)));
    for (int64_t i = threadIdx.x; i < chunks; i += blockDim.x) {
      float a[V], b[V];
      load_chunk(xr, i, a);
      load_chunk(w, i, b);
#pragma unroll
      for (int k = 0; k < V; ++k) a[k] = a[k] * scale * b[k];
      store_chunk(yr, i, a);
    }
  }
}

// Two passes for the statistics (mean, then the centred variance: no
// cancellation), one for the output. b is NULL without a bias.
template <class T, int V>
__global__ void __launch_bounds__(kMaxBlockThreads)
    layer_norm_kernel(const T* x, int64_t x_stride, const T* __restrict__ w, const T* __restrict__ b, T* y,
                      int64_t y_stride, int64_t rows, int64_t cols, float eps) {
  const int64_t chunks = cols / V;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * x_stride;
    T* yr = y + r * y_stride;
    float part = 0.0f;
    for (int64_t i = threadIdx.x; i < chunks; i += blockDim.x) {
      float a[V];
      load_chunk(xr, i, a);
#pragma unroll
      for (int k = 0; k < V; ++k) part += a[k];
    }
    const float mean = float(double(block_sum(part)) / double(cols));
    part = 0.0f;
    for (int64_t i = threadIdx.x; i < chunks; i += blockDim.x) {
      float a[V];
      load_chunk(xr, i, a);
#pragma unroll
      for (int k = 0; k < V; ++k) part += (a[k] - mean) * (a[k] - mean);
    }
    const float rstd = float(1.0 / sqrt(double(block_sum(part)) / double(cols) + double(eps)));
    for (int64_t i = threadIdx.x; i < chunks; i += blockDim.x) {
      float a[V], wv[V], bv[V] = {};
      load_chunk(xr, i, a);
      load_chunk(w, i, wv);
      if (b) load_chunk(b, i, bv);
#pragma unroll
      for (int k = 0; k < V; ++k) a[k] = (a[k] - mean) * rstd * wv[k] + bv[k];
      store_chunk(yr, i, a);
    }
  }
}

// s = x + residual, rounded to T and stored as residual_out; y normalises
// the stored s (read back by the thread that wrote it). out may be x and
// residual_out may be residual (the core allows nothing else).
template <class T, int V>
__global__ void __launch_bounds__(kMaxBlockThreads)
    add_rms_norm_kernel(const T* x, int64_t x_stride, const T* res, int64_t res_stride, const T* __restrict__ w,
                        T* y, int64_t y_stride, T* res_out, int64_t res_out_stride, int64_t rows, int64_t cols,
                        float eps) {
  const int64_t chunks = cols / V;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * x_stride;
    const T* rr = res + r * res_stride;
    T* yr = y + r * y_stride;
    T* ro = res_out + r * res_out_stride;
    float squares = 0.0f;
    for (int64_t i = threadIdx.x; i < chunks; i += blockDim.x) {
      float a[V], c[V];
      load_chunk(xr, i, a);
      load_chunk(rr, i, c);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        a[k] = to_f32(from_f32<T>(a[k] + c[k]));
        squares += a[k] * a[k];
      }
      store_chunk(ro, i, a);
    }
    const float scale = float(1.0 / sqrt(double(block_sum(squares)) / double(cols) + double(eps)));
    for (int64_t i = threadIdx.x; i < chunks; i += blockDim.x) {
      float a[V], wv[V];
      load_chunk(ro, i, a);
      load_chunk(w, i, wv);
#pragma unroll
      for (int k = 0; k < V; ++k) a[k] = a[k] * scale * wv[k];
      store_chunk(yr, i, a);
    }
  }
}

// Norm backward, first stage: dx per row, and per block the fp32 partial
// sums over its rows of dy * x_hat (dweight) and dy (dbias, Layer only) in
// partial[blockIdx.x] / partial[gridDim.x + blockIdx.x] (cols floats each;
// every thread owns the columns of its chunks). The grid size depends on
// rows only, so the sums come out the same on every run and every device.
// dx may be dy or x (the core allows the same view): chunks stay with one
// thread, as in the forward kernels.
template <class T, int V, bool Layer>
__global__ void __launch_bounds__(kMaxBlockThreads)
    norm_backward_kernel(const T* dy, int64_t dy_stride, const T* x, int64_t x_stride, const T* __restrict__ w,
                         T* dx, int64_t dx_stride,
                         float* __restrict__ partial, int64_t rows, int64_t cols, float eps) {
  const int64_t chunks = cols / V;
  float* dw = partial + int64_t(blockIdx.x) * cols;
  float* db = partial + int64_t(gridDim.x + blockIdx.x) * cols;
  for (int64_t i = threadIdx.x; i < chunks; i += blockDim.x)
#pragma unroll
    for (int k = 0; k < V; ++k) {
      dw[i * V + k] = 0.0f;
      if (Layer) db[i * V + k] = 0.0f;
    }
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * x_stride;
    const T* gr = dy + r * dy_stride;
    float mean = 0.0f, part = 0.0f;
    if (Layer) {
      for (int64_t i = threadIdx.x; i < chunks; i += blockDim.x) {
        float a[V];
        load_chunk(xr, i, a);
#pragma unroll
        for (int k = 0; k < V; ++k) part += a[k];
      }
      mean = float(double(block_sum(part)) / double(cols));
      part = 0.0f;
    }
    for (int64_t i = threadIdx.x; i < chunks; i += blockDim.x) {
      float a[V];
      load_chunk(xr, i, a);
#pragma unroll
      for (int k = 0; k < V; ++k) part += (a[k] - mean) * (a[k] - mean);
    }
    const float rstd = float(1.0 / sqrt(double(block_sum(part)) / double(cols) + double(eps)));
    // c1 = mean(g * x_hat), c2 = mean(g) with g = dy * w. g is rounded to
    // fp32 the same way here and below (mul_rn: never fused into an FMA), so
    // g - c2 is exactly 0 where it should be (cols == 1) and not the product's
    // rounding error times rstd.
    float p1 = 0.0f, p2 = 0.0f;
    for (int64_t i = threadIdx.x; i < chunks; i += blockDim.x) {
      float a[V], g[V], wv[V];
      load_chunk(xr, i, a);
      load_chunk(gr, i, g);
      load_chunk(w, i, wv);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const float xh = (a[k] - mean) * rstd, gw = mul_rn(g[k], wv[k]);
        dw[i * V + k] += g[k] * xh;
        if (Layer) db[i * V + k] += g[k];
        p1 += gw * xh;
        p2 += gw;
      }
    }
    const float c1 = float(double(block_sum(p1)) / double(cols));
    const float c2 = Layer ? float(double(block_sum(p2)) / double(cols)) : 0.0f;
    T* dr = dx + r * dx_stride;
    for (int64_t i = threadIdx.x; i < chunks; i += blockDim.x) {
      float a[V], g[V], wv[V];
      load_chunk(xr, i, a);
      load_chunk(gr, i, g);
      load_chunk(w, i, wv);
#pragma unroll
      for (int k = 0; k < V; ++k) a[k] = rstd * (mul_rn(g[k], wv[k]) - c2 - (a[k] - mean) * rstd * c1);
      store_chunk(dr, i, a);
    }
  }
}

// Second stage: out[c] = sum of partial[p][c] over p, in p order.
template <class T>
__global__ void column_sum_kernel(const float* __restrict__ partial, int64_t parts, int64_t cols,
                                  T* __restrict__ out) {
  for (int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; c < cols; c += int64_t(gridDim.x) * blockDim.x) {
    float s = 0.0f;
    for (int64_t p = 0; p < parts; ++p) s += partial[p * cols + c];
    out[c] = from_f32<T>(s);
  }
}

// Blocks of the backward's first stage: the partial sums cost
// 2 * kBackwardBlocks * cols floats of scratch.
constexpr int64_t kBackwardBlocks = 256;
constexpr int kColumnThreads = 256;

template <class T>
to_status rms_norm_typed(const to_op_call* c, cudaStream_t stream) {
  const to_tensor &xt = c->inputs[0], &wt = c->inputs[1], &yt = c->outputs[0];
  const int64_t rows = xt.shape[0], cols = xt.shape[1];
  const float eps = float(c->scalars[0]);
  return with_chunk<T>(rows_aligned16({&xt, &wt, &yt}, sizeof(T)), [&](auto v) {
    constexpr int V = decltype(v)::value;
    rms_norm_kernel<T, V><<<row_blocks(rows), row_block_threads(cols / V), 0, stream>>>(
        element0<const T>(xt), xt.strides[0], element0<const T>(wt), element0<T>(yt), yt.strides[0], rows, cols,
        eps);
    TENSOR_OPS_CUDA_CHECK(cudaGetLastError());
    return TO_OK;
  });
}

template <class T>
to_status layer_norm_typed(const to_op_call* c, cudaStream_t stream) {
  const to_tensor &xt = c->inputs[0], &wt = c->inputs[1], &bt = c->inputs[2], &yt = c->outputs[0];
  const int64_t rows = xt.shape[0], cols = xt.shape[1];
  const T* b = c->ints[0] && bt.data ? element0<const T>(bt) : nullptr;
  const float eps = float(c->scalars[0]);
  return with_chunk<T>(rows_aligned16({&xt, &wt, &bt, &yt}, sizeof(T)), [&](auto v) {
    constexpr int V = decltype(v)::value;
    layer_norm_kernel<T, V><<<row_blocks(rows), row_block_threads(cols / V), 0, stream>>>(
        element0<const T>(xt), xt.strides[0], element0<const T>(wt), b, element0<T>(yt), yt.strides[0], rows,
        cols, eps);
    TENSOR_OPS_CUDA_CHECK(cudaGetLastError());
    return TO_OK;
  });
}

template <class T>
to_status add_rms_norm_typed(const to_op_call* c, cudaStream_t stream) {
  const to_tensor &xt = c->inputs[0], &rt = c->inputs[1], &wt = c->inputs[2], &yt = c->outputs[0],
                  &ot = c->outputs[1];
  const int64_t rows = xt.shape[0], cols = xt.shape[1];
  const float eps = float(c->scalars[0]);
  return with_chunk<T>(rows_aligned16({&xt, &rt, &wt, &yt, &ot}, sizeof(T)), [&](auto v) {
    constexpr int V = decltype(v)::value;
    add_rms_norm_kernel<T, V><<<row_blocks(rows), row_block_threads(cols / V), 0, stream>>>(
        element0<const T>(xt), xt.strides[0], element0<const T>(rt), rt.strides[0], element0<const T>(wt),
        element0<T>(yt), yt.strides[0], element0<T>(ot), ot.strides[0], rows, cols, eps);
    TENSOR_OPS_CUDA_CHECK(cudaGetLastError());
    return TO_OK;
  });
}

// inputs dy, x, w; outputs dx, dweight, dbias (Layer with a bias).
template <class T, bool Layer>
to_status norm_backward_typed(const to_op_call* c, cudaStream_t stream) {
  const to_tensor &gt = c->inputs[0], &xt = c->inputs[1], &wt = c->inputs[2], &dxt = c->outputs[0],
                  &dwt = c->outputs[1], &dbt = c->outputs[2];
  const int64_t rows = xt.shape[0], cols = xt.shape[1];
  const int64_t parts = std::min(rows, kBackwardBlocks);
  DeviceScratch scratch(stream);
  if (parts > 0) {
    if (to_status s = scratch.allocate(size_t(2 * parts * cols) * sizeof(float)); s != TO_OK) return s;
    const to_status s = with_chunk<T>(rows_aligned16({&gt, &xt, &wt, &dxt}, sizeof(T)), [&](auto v) {
      constexpr int V = decltype(v)::value;
      norm_backward_kernel<T, V, Layer><<<unsigned(parts), row_block_threads(cols / V), 0, stream>>>(
          element0<const T>(gt), gt.strides[0], element0<const T>(xt), xt.strides[0], element0<const T>(wt),
          element0<T>(dxt), dxt.strides[0], scratch.get<float>(), rows, cols, float(c->scalars[0]));
      TENSOR_OPS_CUDA_CHECK(cudaGetLastError());
      return TO_OK;
    });
    if (s != TO_OK) return s;
  }
  // With no rows the sums are zeros: parts == 0 reads no partials.
  const unsigned blocks = unsigned(std::min(ceil_div(cols, kColumnThreads), kMaxGridBlocks));
  const float* partial = scratch.get<float>();
  column_sum_kernel<T><<<blocks, kColumnThreads, 0, stream>>>(partial, parts, cols, element0<T>(dwt));
  TENSOR_OPS_CUDA_CHECK(cudaGetLastError());
  if (Layer && c->ints[0] && dbt.data) {
    column_sum_kernel<T><<<blocks, kColumnThreads, 0, stream>>>(partial ? partial + parts * cols : nullptr, parts,
                                                                cols, element0<T>(dbt));
    TENSOR_OPS_CUDA_CHECK(cudaGetLastError());
  }
  return TO_OK;
}

}  // namespace

to_status launch_rms_norm(const to_op_call* call, cudaStream_t stream) {
  return with_dtype(call->inputs[0].dtype, [&](auto tag) { return rms_norm_typed<decltype(tag)>(call, stream); });
}

to_status launch_layer_norm(const to_op_call* call, cudaStream_t stream) {
  return with_dtype(call->inputs[0].dtype, [&](auto tag) { return layer_norm_typed<decltype(tag)>(call, stream); });
}

to_status launch_add_rms_norm(const to_op_call* call, cudaStream_t stream) {
  return with_dtype(call->inputs[0].dtype,
                    [&](auto tag) { return add_rms_norm_typed<decltype(tag)>(call, stream); });
}

to_status launch_rms_norm_backward(const to_op_call* call, cudaStream_t stream) {
  return with_dtype(call->inputs[0].dtype,
                    [&](auto tag) { return norm_backward_typed<decltype(tag), false>(call, stream); });
}

to_status launch_layer_norm_backward(const to_op_call* call, cudaStream_t stream) {
  return with_dtype(call->inputs[0].dtype,
                    [&](auto tag) { return norm_backward_typed<decltype(tag), true>(call, stream); });
}

}  // namespace tensor_ops::gpu

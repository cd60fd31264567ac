// The CUDA names that cuda/ uses, mapped to HIP, so the HIP plugin builds
// from the same sources (ggml's vendors/hip.h idea). Included by
// cuda/common.cuh when TENSOR_OPS_HIP is defined; add a name here when cuda/
// starts using a new one (the HIP compile in CI fails until it is mapped).
#ifndef TENSOR_OPS_HIP_VENDOR_H
#define TENSOR_OPS_HIP_VENDOR_H

#include <hip/hip_bfloat16.h>
#include <hip/hip_fp16.h>
#include <hip/hip_runtime.h>

#define TENSOR_OPS_GPU_NAME "HIP"
#define TENSOR_OPS_GPU_API "hip"
#define TENSOR_OPS_GPU_PRIORITY 90  // after CUDA, before SYCL / OpenCL

// Wave64 on CDNA (gfx9xx), wave32 by default on RDNA (gfx10xx+): the device
// pass for each target defines its own size. Host code never sizes anything
// by it (block sizes are multiples of 64).
#ifdef __AMDGCN_WAVEFRONT_SIZE
#define TENSOR_OPS_WARP_SIZE __AMDGCN_WAVEFRONT_SIZE
#else
#define TENSOR_OPS_WARP_SIZE 64
#endif

// Runtime API
#define cudaDeviceProp hipDeviceProp_t
#define cudaDeviceSynchronize hipDeviceSynchronize
#define cudaDriverGetVersion hipDriverGetVersion
#define cudaError_t hipError_t
#define cudaEventCreateWithFlags hipEventCreateWithFlags
#define cudaEventDestroy hipEventDestroy
#define cudaEventDisableTiming hipEventDisableTiming
#define cudaEventRecord hipEventRecord
#define cudaEvent_t hipEvent_t
#define cudaErrorInsufficientDriver hipErrorInsufficientDriver
#define cudaErrorInvalidDeviceFunction hipErrorInvalidDeviceFunction
#define cudaErrorMemoryAllocation hipErrorOutOfMemory
#define cudaErrorNoDevice hipErrorNoDevice
#define cudaErrorNoKernelImageForDevice hipErrorNoBinaryForGpu
#define cudaErrorNotSupported hipErrorNotSupported
#define cudaFree hipFree
#define cudaFreeAsync hipFreeAsync
#define cudaGetDevice hipGetDevice
#define cudaGetDeviceCount hipGetDeviceCount
#define cudaGetDeviceProperties hipGetDeviceProperties
#define cudaGetErrorName hipGetErrorName
#define cudaGetErrorString hipGetErrorString
#define cudaGetLastError hipGetLastError
#define cudaMalloc hipMalloc
#define cudaMallocAsync hipMallocAsync
#define cudaMallocFromPoolAsync hipMallocFromPoolAsync
#define cudaMemAllocationTypePinned hipMemAllocationTypePinned
#define cudaMemGetInfo hipMemGetInfo
#define cudaMemLocationTypeDevice hipMemLocationTypeDevice
#define cudaMemPoolAttrReleaseThreshold hipMemPoolAttrReleaseThreshold
#define cudaMemPoolCreate hipMemPoolCreate
#define cudaMemPoolProps hipMemPoolProps
#define cudaMemPoolSetAttribute hipMemPoolSetAttribute
#define cudaMemPool_t hipMemPool_t
#define cudaMemcpy hipMemcpy
#define cudaMemcpyAsync hipMemcpyAsync
#define cudaMemcpyDeviceToDevice hipMemcpyDeviceToDevice
#define cudaMemcpyDeviceToHost hipMemcpyDeviceToHost
#define cudaMemcpyHostToDevice hipMemcpyHostToDevice
#define cudaMemcpyKind hipMemcpyKind
#define cudaMemset hipMemset
#define cudaMemsetAsync hipMemsetAsync
#define cudaRuntimeGetVersion hipRuntimeGetVersion
#define cudaSetDevice hipSetDevice
#define cudaStreamSynchronize hipStreamSynchronize
#define cudaStreamWaitEvent hipStreamWaitEvent
#define cudaStream_t hipStream_t
#define cudaSuccess hipSuccess

// bf16: ROCm 5.x has only hip_bfloat16 (a struct with float conversions,
// round-to-nearest-even); __hip_bfloat16 came later, so use the one every
// ROCm has.
#define __nv_bfloat16 hip_bfloat16
#define __bfloat162float(v) static_cast<float>(v)
#define __float2bfloat16_rn(f) hip_bfloat16(f)

// Warp intrinsics: HIP's take no mask (the whole wavefront takes part).
#define __shfl_xor_sync(mask, ...) __shfl_xor(__VA_ARGS__)

#endif

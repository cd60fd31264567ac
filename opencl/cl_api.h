#pragma once
// The slice of the OpenCL 1.2 API this plugin uses, declared here from the
// OpenCL specification (types, enum values, function signatures), so the
// build needs no OpenCL headers and no ICD loader. The functions are pointers
// filled by load_opencl() from libOpenCL.so.1, opened with dlopen at run time.
// Everything lives in tensor_ops::opencl, so the plugin's code calls
// clGetPlatformIDs(...) as it would the real API, and nothing here can clash
// with another library's OpenCL symbols.
#include <cstddef>
#include <cstdint>
#include <string>

namespace tensor_ops::opencl {

// Scalar types (fixed sizes in the specification).
using cl_char = int8_t;
using cl_uchar = uint8_t;
using cl_int = int32_t;
using cl_uint = uint32_t;
using cl_long = int64_t;
using cl_ulong = uint64_t;
using cl_float = float;
using cl_bool = cl_uint;
using cl_bitfield = cl_ulong;

// Opaque handles.
using cl_platform_id = struct _cl_platform_id*;
using cl_device_id = struct _cl_device_id*;
using cl_context = struct _cl_context*;
using cl_command_queue = struct _cl_command_queue*;
using cl_mem = struct _cl_mem*;
using cl_program = struct _cl_program*;
using cl_kernel = struct _cl_kernel*;
using cl_event = struct _cl_event*;

// Enumerations and bitfields.
using cl_device_type = cl_bitfield;
using cl_device_fp_config = cl_bitfield;
using cl_command_queue_properties = cl_bitfield;
using cl_mem_flags = cl_bitfield;
using cl_platform_info = cl_uint;
using cl_device_info = cl_uint;
using cl_program_info = cl_uint;
using cl_program_build_info = cl_uint;
using cl_kernel_work_group_info = cl_uint;
using cl_context_properties = intptr_t;

constexpr cl_bool CL_FALSE = 0;
constexpr cl_bool CL_TRUE = 1;

// Error codes.
constexpr cl_int CL_SUCCESS = 0;
constexpr cl_int CL_DEVICE_NOT_FOUND = -1;
constexpr cl_int CL_DEVICE_NOT_AVAILABLE = -2;
constexpr cl_int CL_COMPILER_NOT_AVAILABLE = -3;
constexpr cl_int CL_MEM_OBJECT_ALLOCATION_FAILURE = -4;
constexpr cl_int CL_OUT_OF_RESOURCES = -5;
constexpr cl_int CL_OUT_OF_HOST_MEMORY = -6;
constexpr cl_int CL_PROFILING_INFO_NOT_AVAILABLE = -7;
constexpr cl_int CL_MEM_COPY_OVERLAP = -8;
constexpr cl_int CL_IMAGE_FORMAT_MISMATCH = -9;
constexpr cl_int CL_IMAGE_FORMAT_NOT_SUPPORTED = -10;
constexpr cl_int CL_BUILD_PROGRAM_FAILURE = -11;
constexpr cl_int CL_MAP_FAILURE = -12;
constexpr cl_int CL_MISALIGNED_SUB_BUFFER_OFFSET = -13;
constexpr cl_int CL_EXEC_STATUS_ERROR_FOR_EVENTS_IN_WAIT_LIST = -14;
constexpr cl_int CL_COMPILE_PROGRAM_FAILURE = -15;
constexpr cl_int CL_LINKER_NOT_AVAILABLE = -16;
constexpr cl_int CL_LINK_PROGRAM_FAILURE = -17;
constexpr cl_int CL_DEVICE_PARTITION_FAILED = -18;
constexpr cl_int CL_KERNEL_ARG_INFO_NOT_AVAILABLE = -19;
constexpr cl_int CL_INVALID_VALUE = -30;
constexpr cl_int CL_INVALID_DEVICE_TYPE = -31;
constexpr cl_int CL_INVALID_PLATFORM = -32;
constexpr cl_int CL_INVALID_DEVICE = -33;
constexpr cl_int CL_INVALID_CONTEXT = -34;
constexpr cl_int CL_INVALID_QUEUE_PROPERTIES = -35;
constexpr cl_int CL_INVALID_COMMAND_QUEUE = -36;
constexpr cl_int CL_INVALID_HOST_PTR = -37;
constexpr cl_int CL_INVALID_MEM_OBJECT = -38;
constexpr cl_int CL_INVALID_IMAGE_FORMAT_DESCRIPTOR = -39;
constexpr cl_int CL_INVALID_IMAGE_SIZE = -40;
constexpr cl_int CL_INVALID_SAMPLER = -41;
constexpr cl_int CL_INVALID_BINARY = -42;
constexpr cl_int CL_INVALID_BUILD_OPTIONS = -43;
constexpr cl_int CL_INVALID_PROGRAM = -44;
constexpr cl_int CL_INVALID_PROGRAM_EXECUTABLE = -45;
constexpr cl_int CL_INVALID_KERNEL_NAME = -46;
constexpr cl_int CL_INVALID_KERNEL_DEFINITION = -47;
constexpr cl_int CL_INVALID_KERNEL = -48;
constexpr cl_int CL_INVALID_ARG_INDEX = -49;
constexpr cl_int CL_INVALID_ARG_VALUE = -50;
constexpr cl_int CL_INVALID_ARG_SIZE = -51;
constexpr cl_int CL_INVALID_KERNEL_ARGS = -52;
constexpr cl_int CL_INVALID_WORK_DIMENSION = -53;
constexpr cl_int CL_INVALID_WORK_GROUP_SIZE = -54;
constexpr cl_int CL_INVALID_WORK_ITEM_SIZE = -55;
constexpr cl_int CL_INVALID_GLOBAL_OFFSET = -56;
constexpr cl_int CL_INVALID_EVENT_WAIT_LIST = -57;
constexpr cl_int CL_INVALID_EVENT = -58;
constexpr cl_int CL_INVALID_OPERATION = -59;
constexpr cl_int CL_INVALID_GL_OBJECT = -60;
constexpr cl_int CL_INVALID_BUFFER_SIZE = -61;
constexpr cl_int CL_INVALID_MIP_LEVEL = -62;
constexpr cl_int CL_INVALID_GLOBAL_WORK_SIZE = -63;
constexpr cl_int CL_INVALID_PROPERTY = -64;
constexpr cl_int CL_INVALID_IMAGE_DESCRIPTOR = -65;
constexpr cl_int CL_INVALID_COMPILER_OPTIONS = -66;
constexpr cl_int CL_INVALID_LINKER_OPTIONS = -67;
constexpr cl_int CL_INVALID_DEVICE_PARTITION_COUNT = -68;
constexpr cl_int CL_INVALID_PIPE_SIZE = -69;                // OpenCL 2.0
constexpr cl_int CL_INVALID_DEVICE_QUEUE = -70;             // OpenCL 2.0
constexpr cl_int CL_INVALID_SPEC_ID = -71;                  // OpenCL 2.2
constexpr cl_int CL_MAX_SIZE_RESTRICTION_EXCEEDED = -72;    // OpenCL 2.2
constexpr cl_int CL_PLATFORM_NOT_FOUND_KHR = -1001;         // cl_khr_icd

// clGetPlatformInfo
constexpr cl_platform_info CL_PLATFORM_VERSION = 0x0901;
constexpr cl_platform_info CL_PLATFORM_NAME = 0x0902;

// cl_device_type
constexpr cl_device_type CL_DEVICE_TYPE_CPU = 1 << 1;
constexpr cl_device_type CL_DEVICE_TYPE_GPU = 1 << 2;
constexpr cl_device_type CL_DEVICE_TYPE_ACCELERATOR = 1 << 3;
constexpr cl_device_type CL_DEVICE_TYPE_ALL = 0xFFFFFFFF;

// clGetDeviceInfo
constexpr cl_device_info CL_DEVICE_TYPE = 0x1000;
constexpr cl_device_info CL_DEVICE_MAX_COMPUTE_UNITS = 0x1002;
constexpr cl_device_info CL_DEVICE_MAX_WORK_GROUP_SIZE = 0x1004;
constexpr cl_device_info CL_DEVICE_MAX_CLOCK_FREQUENCY = 0x100C;
constexpr cl_device_info CL_DEVICE_MAX_MEM_ALLOC_SIZE = 0x1010;
constexpr cl_device_info CL_DEVICE_GLOBAL_MEM_SIZE = 0x101F;
constexpr cl_device_info CL_DEVICE_LOCAL_MEM_SIZE = 0x1023;
constexpr cl_device_info CL_DEVICE_AVAILABLE = 0x1027;
constexpr cl_device_info CL_DEVICE_COMPILER_AVAILABLE = 0x1028;
constexpr cl_device_info CL_DEVICE_NAME = 0x102B;
constexpr cl_device_info CL_DEVICE_VENDOR = 0x102C;
constexpr cl_device_info CL_DRIVER_VERSION = 0x102D;
constexpr cl_device_info CL_DEVICE_VERSION = 0x102F;
constexpr cl_device_info CL_DEVICE_EXTENSIONS = 0x1030;
constexpr cl_device_info CL_DEVICE_DOUBLE_FP_CONFIG = 0x1032;
constexpr cl_device_info CL_DEVICE_OPENCL_C_VERSION = 0x103D;

// cl_context_properties
constexpr cl_context_properties CL_CONTEXT_PLATFORM = 0x1084;

// cl_mem_flags
constexpr cl_mem_flags CL_MEM_READ_WRITE = 1 << 0;

// clGetProgramInfo / clGetProgramBuildInfo
constexpr cl_program_info CL_PROGRAM_BINARY_SIZES = 0x1165;
constexpr cl_program_info CL_PROGRAM_BINARIES = 0x1166;
constexpr cl_program_build_info CL_PROGRAM_BUILD_LOG = 0x1183;

// clGetKernelWorkGroupInfo
constexpr cl_kernel_work_group_info CL_KERNEL_WORK_GROUP_SIZE = 0x11B0;

// The functions: X(name, return type, parameters).
#define TENSOR_OPS_CL_FUNCTIONS(X)                                                                                    \
  X(clGetPlatformIDs, cl_int, (cl_uint num_entries, cl_platform_id * platforms, cl_uint * num_platforms))            \
  X(clGetPlatformInfo, cl_int,                                                                                        \
    (cl_platform_id platform, cl_platform_info name, size_t size, void* value, size_t* size_ret))                     \
  X(clGetDeviceIDs, cl_int,                                                                                           \
    (cl_platform_id platform, cl_device_type type, cl_uint num_entries, cl_device_id* devices, cl_uint* num_devices)) \
  X(clGetDeviceInfo, cl_int, (cl_device_id device, cl_device_info name, size_t size, void* value, size_t* size_ret))  \
  X(clCreateContext, cl_context,                                                                                      \
    (const cl_context_properties* properties, cl_uint num_devices, const cl_device_id* devices,                       \
     void (*notify)(const char*, const void*, size_t, void*), void* user_data, cl_int* errcode_ret))                  \
  X(clCreateCommandQueue, cl_command_queue,                                                                           \
    (cl_context context, cl_device_id device, cl_command_queue_properties properties, cl_int* errcode_ret))           \
  X(clCreateBuffer, cl_mem, (cl_context context, cl_mem_flags flags, size_t size, void* host_ptr, cl_int* errcode_ret)) \
  X(clReleaseMemObject, cl_int, (cl_mem mem))                                                                         \
  X(clCreateProgramWithSource, cl_program,                                                                            \
    (cl_context context, cl_uint count, const char** strings, const size_t* lengths, cl_int* errcode_ret))            \
  X(clCreateProgramWithBinary, cl_program,                                                                            \
    (cl_context context, cl_uint num_devices, const cl_device_id* devices, const size_t* lengths,                     \
     const unsigned char** binaries, cl_int* binary_status, cl_int* errcode_ret))                                     \
  X(clBuildProgram, cl_int,                                                                                           \
    (cl_program program, cl_uint num_devices, const cl_device_id* devices, const char* options,                       \
     void (*notify)(cl_program, void*), void* user_data))                                                             \
  X(clGetProgramInfo, cl_int, (cl_program program, cl_program_info name, size_t size, void* value, size_t* size_ret)) \
  X(clGetProgramBuildInfo, cl_int,                                                                                    \
    (cl_program program, cl_device_id device, cl_program_build_info name, size_t size, void* value,                   \
     size_t* size_ret))                                                                                               \
  X(clReleaseProgram, cl_int, (cl_program program))                                                                   \
  X(clCreateKernel, cl_kernel, (cl_program program, const char* kernel_name, cl_int* errcode_ret))                    \
  X(clReleaseKernel, cl_int, (cl_kernel kernel))                                                                      \
  X(clSetKernelArg, cl_int, (cl_kernel kernel, cl_uint index, size_t size, const void* value))                        \
  X(clGetKernelWorkGroupInfo, cl_int,                                                                                 \
    (cl_kernel kernel, cl_device_id device, cl_kernel_work_group_info name, size_t size, void* value,                 \
     size_t* size_ret))                                                                                               \
  X(clEnqueueReadBuffer, cl_int,                                                                                      \
    (cl_command_queue queue, cl_mem buffer, cl_bool blocking, size_t offset, size_t size, void* ptr,                  \
     cl_uint num_events, const cl_event* wait_list, cl_event* event))                                                 \
  X(clEnqueueWriteBuffer, cl_int,                                                                                     \
    (cl_command_queue queue, cl_mem buffer, cl_bool blocking, size_t offset, size_t size, const void* ptr,            \
     cl_uint num_events, const cl_event* wait_list, cl_event* event))                                                 \
  X(clEnqueueCopyBuffer, cl_int,                                                                                      \
    (cl_command_queue queue, cl_mem src, cl_mem dst, size_t src_offset, size_t dst_offset, size_t size,               \
     cl_uint num_events, const cl_event* wait_list, cl_event* event))                                                 \
  X(clEnqueueFillBuffer, cl_int,                                                                                      \
    (cl_command_queue queue, cl_mem buffer, const void* pattern, size_t pattern_size, size_t offset, size_t size,     \
     cl_uint num_events, const cl_event* wait_list, cl_event* event))                                                 \
  X(clEnqueueNDRangeKernel, cl_int,                                                                                   \
    (cl_command_queue queue, cl_kernel kernel, cl_uint work_dim, const size_t* global_offset,                         \
     const size_t* global_size, const size_t* local_size, cl_uint num_events, const cl_event* wait_list,              \
     cl_event* event))                                                                                                \
  X(clFlush, cl_int, (cl_command_queue queue))                                                                        \
  X(clFinish, cl_int, (cl_command_queue queue))

#define TENSOR_OPS_CL_DECLARE(name, ret, params) \
  using name##_fn = ret(*) params;               \
  extern name##_fn name;
TENSOR_OPS_CL_FUNCTIONS(TENSOR_OPS_CL_DECLARE)
#undef TENSOR_OPS_CL_DECLARE

// Opens the ICD loader ($TENSOR_OPS_OPENCL_LIBRARY, default libOpenCL.so.1)
// once and fills the pointers above. False, with why in *reason, when the
// library or one of the functions is missing.
bool load_opencl(std::string* reason);

}  // namespace tensor_ops::opencl

// The emulated plugin's entry point. cuda/backend.cpp is compiled unmodified
// with its entry point renamed (tensor_ops_emu_inner_backend_v1); this file
// exports the real one, tensor_ops_backend_v1, returning the same table with
// every kernel entry wrapped so that, when TENSOR_OPS_EMU_OPLOG names a file,
// each (op, dtype) the core runs on this backend is appended to it once per
// process: .ci/gpu_emulation checks that every op of ops.def ran, in every
// dtype, on every emulated backend.
// The build renames backend.cpp's entry point with -D for every unit; not here.
#undef tensor_ops_backend_v1

#include <atomic>
#include <utility>
#include <cstdio>
#include <cstdlib>

#include "tensor_ops/plugin.h"

extern "C" const to_backend_v1* tensor_ops_emu_inner_backend_v1(void);

namespace {

const char* const kOpNames[TENSOR_OPS_MAX_OPS] = {
#define TENSOR_OPS_OP(name, id, n_in, n_out) [id] = #name,
#include "tensor_ops/ops.def"
#undef TENSOR_OPS_OP
};

const to_backend_v1* inner = nullptr;
std::atomic<bool> seen[TENSOR_OPS_MAX_OPS][8];

void record(int op, int32_t dtype) {
  const char* path = std::getenv("TENSOR_OPS_EMU_OPLOG");
  if (!path || !*path || dtype < 0 || dtype >= 8 || seen[op][dtype].exchange(true)) return;
  static const char* const kDtypes[] = {"float32", "float16", "bfloat16", "int32", "int64", "?", "?", "?"};
  if (FILE* f = std::fopen(path, "a")) {
    std::fprintf(f, "%s %s %s\n", inner->name, kOpNames[op] ? kOpNames[op] : "?", kDtypes[dtype]);
    std::fclose(f);
  }
}

template <int Id>
to_status counted(const to_op_call* call) {
  record(Id, call->n_inputs > 0 ? call->inputs[0].dtype : -1);
  return inner->kernels[Id](call);
}

template <int... Id>
void wrap_all(to_backend_v1& t, std::integer_sequence<int, Id...>) {
  ((t.kernels[Id] = inner->kernels[Id] ? counted<Id> : nullptr), ...);
}

to_backend_v1 make_table() {
  inner = tensor_ops_emu_inner_backend_v1();
  to_backend_v1 t = *inner;
  wrap_all(t, std::make_integer_sequence<int, TENSOR_OPS_MAX_OPS>{});
  return t;
}

}  // namespace

extern "C" __attribute__((visibility("default"))) const to_backend_v1* tensor_ops_backend_v1(void) {
  static const to_backend_v1 table = make_table();
  return &table;
}

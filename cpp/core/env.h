#pragma once
// Environment variables read by the core (TENSOR_OPS_*).
#include <cstdlib>
#include <string>
#include <vector>

namespace tensor_ops {

inline std::string env_str(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : std::string();
}

// TENSOR_OPS_BACKEND and TENSOR_OPS_PRIORITY (null when unset), read in one
// pass over the environment: every op call reads both, and each getenv is a
// scan of its own.
struct SelectionEnv {
  const char* backend = nullptr;
  const char* priority = nullptr;
};
SelectionEnv selection_env();

// Parses a whole decimal integer ("12", "-3"; no spaces, no suffix). False
// for anything else, a value outside long's range included.
bool parse_long(const char* s, long* out);

// Records that environment variable `name` had the unusable value `value`
// (`problem` says why) and that `used` is used instead. The Python package
// logs these through the "tensor_ops" logger at import.
void add_env_warning(const char* name, const char* value, const std::string& problem, const std::string& used);

// Reads every environment variable the core parses strictly (the CPU
// backend's TENSOR_OPS_NUM_THREADS and TENSOR_OPS_CPU_ISA) and returns the
// warnings recorded so far, one sentence each.
std::vector<std::string> environment_warnings();

// Splits "a,b, c" into {"a", "b", "c"} (empty items dropped).
std::vector<std::string> split_list(const std::string& s, char sep = ',');

}  // namespace tensor_ops

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

// Splits "a,b, c" into {"a", "b", "c"} (empty items dropped).
std::vector<std::string> split_list(const std::string& s, char sep = ',');

}  // namespace tensor_ops

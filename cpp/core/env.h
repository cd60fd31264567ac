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

// Splits "a,b, c" into {"a", "b", "c"} (empty items dropped).
std::vector<std::string> split_list(const std::string& s, char sep = ',');

}  // namespace tensor_ops

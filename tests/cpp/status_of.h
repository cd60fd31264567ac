#pragma once
// One backend's entry in Registry::status().
#include <optional>
#include <string>

#include "tensor_ops/registry.h"

namespace tensor_ops::testing {

inline std::optional<BackendStatus> status_of(const std::string& name) {
  for (const BackendStatus& s : Registry::instance().status())
    if (s.name == name) return s;
  return std::nullopt;
}

}  // namespace tensor_ops::testing

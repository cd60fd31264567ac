#pragma once
// Registry::push_scope for one C++ scope (what Python's `with use(name):` does).
#include <string>

#include "tensor_ops/registry.h"

namespace tensor_ops::testing {

class BackendScope {
 public:
  explicit BackendScope(const std::string& name) { Registry::instance().push_scope(name); }
  ~BackendScope() { Registry::instance().pop_scope(); }
  BackendScope(const BackendScope&) = delete;
  BackendScope& operator=(const BackendScope&) = delete;
};

}  // namespace tensor_ops::testing

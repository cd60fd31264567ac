#pragma once
// One error hierarchy; Python maps each class to a builtin exception type.
#include <stdexcept>
#include <string>

#include "tensor_ops/plugin.h"

namespace tensor_ops {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what, to_status status = TO_ERR_INTERNAL)
      : std::runtime_error(what), status_(status) {}
  to_status status() const noexcept { return status_; }

 private:
  to_status status_;
};

// Bad shapes, ranks, values (Python: ValueError).
class InvalidArgument : public Error {
 public:
  explicit InvalidArgument(const std::string& w) : Error(w, TO_ERR_INVALID_ARGUMENT) {}
};

// Wrong or mixed dtypes (Python: TypeError).
class DTypeError : public InvalidArgument {
 public:
  using InvalidArgument::InvalidArgument;
};

// A strided layout the kernels cannot take as is; the caller may retry with a
// contiguous copy (the Python layer does).
class LayoutError : public InvalidArgument {
 public:
  using InvalidArgument::InvalidArgument;
};

// Op, dtype or feature not implemented by a backend (Python: NotImplementedError).
class Unsupported : public Error {
 public:
  explicit Unsupported(const std::string& w) : Error(w, TO_ERR_UNSUPPORTED) {}
};

// Backend not compiled or its runtime missing (Python: RuntimeError).
class BackendUnavailable : public Error {
 public:
  explicit BackendUnavailable(const std::string& w) : Error(w, TO_ERR_BACKEND_UNAVAILABLE) {}
};

class OutOfMemory : public Error {
 public:
  explicit OutOfMemory(const std::string& w) : Error(w, TO_ERR_OUT_OF_MEMORY) {}
};

// A vendor call failed: the message has the call, its code and the code's name.
class DeviceError : public Error {
 public:
  explicit DeviceError(const std::string& w) : Error(w, TO_ERR_DEVICE) {}
};

// The selection (use / set_backend / TENSOR_OPS_BACKEND) names a backend
// served outside the core (Registry::set_external_backends): the layer that
// registered it catches this and runs the op itself.
class ExternalBackendSelected : public Unsupported {
 public:
  explicit ExternalBackendSelected(const std::string& backend)
      : Unsupported("backend '" + backend + "' is selected; it is served by the layer that registered it, not the core"),
        backend_(backend) {}
  const std::string& backend() const { return backend_; }

 private:
  std::string backend_;
};

// Throws the exception class that matches a plugin status.
[[noreturn]] void throw_status(to_status status, const std::string& message);

}  // namespace tensor_ops

#include "tensor_ops/errors.h"

namespace tensor_ops {

void throw_status(to_status status, const std::string& message) {
  switch (status) {
    case TO_ERR_INVALID_ARGUMENT: throw InvalidArgument(message);
    case TO_ERR_UNSUPPORTED: throw Unsupported(message);
    case TO_ERR_BACKEND_UNAVAILABLE: throw BackendUnavailable(message);
    case TO_ERR_OUT_OF_MEMORY: throw OutOfMemory(message);
    case TO_ERR_DEVICE: throw DeviceError(message);
    default: throw Error(message, status);
  }
}

}  // namespace tensor_ops

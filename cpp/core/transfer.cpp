#include "tensor_ops/transfer.h"

#include <cstring>

#include "tensor_ops/device_memory.h"
#include "tensor_ops/errors.h"
#include "tensor_ops/registry.h"

namespace tensor_ops {

Device parse_device(const std::string& name) {
  Registry& reg = Registry::instance();
  if (name.empty()) {
    Backend& b = reg.active();
    return b.name() == "cpu" ? Device{"host", 0} : Device{b.name(), 0};
  }
  std::string backend = name;
  int32_t id = 0;
  const size_t colon = name.find(':');
  if (colon != std::string::npos) {
    backend = name.substr(0, colon);
    const std::string num = name.substr(colon + 1);
    if (num.empty() || num.find_first_not_of("0123456789") != std::string::npos || num.size() > 6)
      throw InvalidArgument("bad device '" + name + "': expected 'backend' or 'backend:index'");
    id = std::stoi(num);
  }
  if (backend == "cpu" || backend == "host") {
    if (id != 0) throw InvalidArgument("device '" + name + "' does not exist (the host is cpu:0)");
    return Device{"host", 0};
  }
  Backend& b = reg.require(backend);
  if (id >= b.device_count())
    throw InvalidArgument("device '" + name + "' does not exist (" + backend + " has " +
                          std::to_string(b.device_count()) + " devices)");
  return Device{backend, id};
}

std::string device_name(const Device& d) { return d.is_host() ? "cpu" : d.str(); }

void copy_bytes(const Tensor& dst, const Tensor& src) {
  if (!dst.is_contiguous() || !src.is_contiguous())
    throw LayoutError("copy needs contiguous tensors (dst " + dst.describe() + ", src " + src.describe() + ")");
  if (dst.nbytes() != src.nbytes())
    throw InvalidArgument("copy between tensors of different sizes: " + dst.describe() + " <- " + src.describe());
  const size_t n = size_t(src.nbytes());
  if (n == 0) return;
  const Device &dd = dst.device(), &sd = src.device();
  if (dd.is_host() && sd.is_host()) {
    std::memmove(static_cast<char*>(dst.data()) + dst.byte_offset(),
                 static_cast<const char*>(src.data()) + src.byte_offset(), n);
    return;
  }
  if (!dd.is_host() && !sd.is_host() && dd.backend != sd.backend) {
    // Across backends: through a host buffer from the host pool.
    auto block = DeviceMemory::of(Device{}).allocate(n, 1.0);
    Backend& sb = Registry::instance().require(sd.backend);
    sb.check(sb.table().copy(sd.id, block.get(), 0, src.data(), src.byte_offset(), n, 1), "copy device->host");
    Backend& db = Registry::instance().require(dd.backend);
    db.check(db.table().copy(dd.id, dst.data(), dst.byte_offset(), block.get(), 0, n, 0), "copy host->device");
    return;
  }
  if (!dd.is_host() && !sd.is_host() && dd.id != sd.id)
    throw Unsupported("copy between two devices of " + dd.backend + " (" + dd.str() + " <- " + sd.str() + ")");
  const Device& dev = dd.is_host() ? sd : dd;
  Backend& b = Registry::instance().require(dev.backend);
  const int32_t kind = sd.is_host() ? 0 : (dd.is_host() ? 1 : 2);
  b.check(b.table().copy(dev.id, dst.data(), dst.byte_offset(), src.data(), src.byte_offset(), n, kind), "copy");
}

Tensor to_device(const Tensor& src, const Device& device) {
  Tensor dst = DeviceMemory::of(device).empty(src.shape(), src.dtype());
  copy_bytes(dst, src);
  return dst;
}

void zero_fill(const Tensor& t) {
  if (!t.is_contiguous()) throw LayoutError("zero_fill needs a contiguous tensor, got " + t.describe());
  const size_t n = size_t(t.nbytes());
  if (n == 0) return;
  if (t.device().is_host()) {
    std::memset(static_cast<char*>(t.data()) + t.byte_offset(), 0, n);
    return;
  }
  Backend& b = Registry::instance().require(t.device().backend);
  b.check(b.table().memset(t.device().id, t.data(), t.byte_offset(), 0, n), "memset");
}

}  // namespace tensor_ops

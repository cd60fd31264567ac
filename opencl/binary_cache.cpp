#include "binary_cache.h"

#include <fcntl.h>
#include <pwd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace tensor_ops::opencl {
namespace {

constexpr char kMagic[8] = {'T', 'O', 'C', 'L', 'B', 'I', 'N', '1'};

std::string env_or_empty(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

std::string default_dir() {
  std::string base = env_or_empty("TENSOR_OPS_CACHE_DIR");
  if (!base.empty()) return base + "/opencl";
  base = env_or_empty("XDG_CACHE_HOME");
  if (!base.empty()) return base + "/tensor_ops/opencl";
  std::string home = env_or_empty("HOME");
  if (home.empty()) {
    if (const passwd* pw = getpwuid(geteuid())) home = pw->pw_dir;
  }
  return home.empty() ? "" : home + "/.cache/tensor_ops/opencl";
}

std::string errno_text(const std::string& what, const std::string& path) {
  return what + " " + path + ": " + std::strerror(errno);
}

// mkdir -p with mode 0700 for every directory it creates. "" on success.
std::string make_dirs(const std::string& dir) {
  for (size_t slash = dir.find('/', 1);; slash = dir.find('/', slash + 1)) {
    const std::string part = dir.substr(0, slash);
    if (mkdir(part.c_str(), 0700) != 0 && errno != EEXIST) return errno_text("cannot create", part);
    if (slash == std::string::npos) return "";
  }
}

void put_u64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(char((v >> (8 * i)) & 0xff));
}

uint64_t get_u64(const unsigned char* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= uint64_t(p[i]) << (8 * i);
  return v;
}

bool read_file(const std::string& path, std::string* out) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  char buf[1 << 16];
  ssize_t n;
  while ((n = read(fd, buf, sizeof(buf))) > 0) out->append(buf, size_t(n));
  close(fd);
  return n == 0;
}

}  // namespace

uint64_t fnv1a64(const void* data, size_t n, uint64_t seed) {
  uint64_t h = seed;
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}

const BinaryCache& BinaryCache::instance() {
  static BinaryCache* c = new BinaryCache();  // never freed, like the devices
  return *c;
}

BinaryCache::BinaryCache() : dir_(default_dir()) {}

std::string BinaryCache::check_dir(bool create) const {
  if (dir_.empty()) return "no cache directory (neither TENSOR_OPS_CACHE_DIR, XDG_CACHE_HOME nor HOME is set)";
  if (create) {
    if (std::string error = make_dirs(dir_); !error.empty()) return error;
  }
  struct stat st {};
  if (stat(dir_.c_str(), &st) != 0) return errno_text("cannot use", dir_);
  if (!S_ISDIR(st.st_mode)) return dir_ + " is not a directory";
  if (st.st_uid != geteuid() || (st.st_mode & (S_IWGRP | S_IWOTH)))
    return dir_ + " is owned by another user or writable by others: not trusted";
  return "";
}

std::string BinaryCache::problem() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return problem_;
}

void BinaryCache::set_problem(const std::string& problem) const {
  std::lock_guard<std::mutex> lock(mutex_);
  problem_ = problem;
}

std::string BinaryCache::path_for(const std::string& key) const {
  char name[32];
  std::snprintf(name, sizeof(name), "%016llx.bin", static_cast<unsigned long long>(fnv1a64(key.data(), key.size())));
  return dir_ + "/" + name;
}

// Layout: magic, key size, key, binary size, FNV-1a of the binary, binary
// (integers little-endian, 8 bytes).
BinaryCache::Lookup BinaryCache::load(const std::string& key, std::vector<unsigned char>* binary) const {
  std::string file;
  if (dir_.empty() || access(dir_.c_str(), F_OK) != 0) return Lookup::Absent;  // nothing stored yet
  if (const std::string problem = check_dir(false); !problem.empty()) {
    set_problem(problem);
    return Lookup::Absent;
  }
  if (!read_file(path_for(key), &file)) return Lookup::Absent;
  const auto* p = reinterpret_cast<const unsigned char*>(file.data());
  const size_t n = file.size();
  if (n < sizeof(kMagic) + 8 || std::memcmp(p, kMagic, sizeof(kMagic)) != 0) return Lookup::Rejected;
  size_t at = sizeof(kMagic);
  const uint64_t key_size = get_u64(p + at);
  at += 8;
  if (key_size != key.size() || n - at < key_size + 16 || std::memcmp(p + at, key.data(), key.size()) != 0)
    return Lookup::Rejected;
  at += key_size;
  const uint64_t size = get_u64(p + at), hash = get_u64(p + at + 8);
  at += 16;
  if (size == 0 || size != n - at || fnv1a64(p + at, size) != hash) return Lookup::Rejected;
  binary->assign(p + at, p + n);
  return Lookup::Hit;
}

void BinaryCache::store(const std::string& key, const std::vector<unsigned char>& binary) const {
  if (binary.empty()) return;
  if (const std::string problem = check_dir(true); !problem.empty()) {
    set_problem(problem);
    return;
  }
  std::string data(kMagic, sizeof(kMagic));
  put_u64(data, key.size());
  data += key;
  put_u64(data, binary.size());
  put_u64(data, fnv1a64(binary.data(), binary.size()));
  data.append(reinterpret_cast<const char*>(binary.data()), binary.size());

  const std::string path = path_for(key);
  static std::atomic<uint64_t> serial{0};
  const std::string tmp = path + ".tmp." + std::to_string(getpid()) + "." + std::to_string(serial++);
  std::string error;
  const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    error = errno_text("cannot create", tmp);
  } else {
    size_t done = 0;
    while (done < data.size()) {
      const ssize_t w = write(fd, data.data() + done, data.size() - done);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) break;
      done += size_t(w);
    }
    if (done != data.size()) error = errno_text("cannot write", tmp);
    if (close(fd) != 0 && error.empty()) error = errno_text("cannot write", tmp);
    if (error.empty() && rename(tmp.c_str(), path.c_str()) != 0) error = errno_text("cannot rename to", path);
    if (!error.empty()) unlink(tmp.c_str());
  }
  set_problem(error);
}

}  // namespace tensor_ops::opencl

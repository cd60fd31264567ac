#pragma once
// The on-disk cache of compiled OpenCL programs, so a process does not pay
// the OpenCL C compiler again for a (device, driver, source, options) it has
// seen. Directory: $TENSOR_OPS_CACHE_DIR/opencl, else
// $XDG_CACHE_HOME/tensor_ops/opencl, else ~/.cache/tensor_ops/opencl;
// created 0700, entries 0600, written to a temporary file and renamed into
// place (readers see a whole entry or none).
//
// Note [trusting cache entries]: an entry holds its full key, the binary's
// size and an FNV-1a hash of the binary. Any mismatch (a truncated or
// corrupted file, a key collision) makes it a miss; the caller rebuilds from
// source and overwrites it. A binary that passes these checks but that the
// driver refuses is rebuilt the same way. A directory that another user owns
// or may write to is not used: its binaries would run in this process.
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace tensor_ops::opencl {

class BinaryCache {
 public:
  static const BinaryCache& instance();

  const std::string& dir() const { return dir_; }
  // Why the last lookup or store could not use the directory ("" if it could).
  std::string problem() const;

  enum class Lookup { Hit, Absent, Rejected };
  Lookup load(const std::string& key, std::vector<unsigned char>* binary) const;
  // Best effort: a failure only leaves the entry absent (see problem()).
  void store(const std::string& key, const std::vector<unsigned char>& binary) const;

 private:
  BinaryCache();
  // "" when the directory is usable; creates it first if asked.
  std::string check_dir(bool create) const;
  void set_problem(const std::string& problem) const;
  std::string path_for(const std::string& key) const;

  std::string dir_;
  mutable std::mutex mutex_;
  mutable std::string problem_;
};

uint64_t fnv1a64(const void* data, size_t n, uint64_t seed = 0xcbf29ce484222325ull);

}  // namespace tensor_ops::opencl

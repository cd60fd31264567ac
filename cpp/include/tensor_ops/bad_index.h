#pragma once
// The wording of the data-dependent index errors (TO_ERR_INVALID_ARGUMENT)
// that every backend finds in its kernels: one text, whichever backend ran.
#include <cstdint>
#include <string>

namespace tensor_ops {

// rope: a position outside [0, table_rows) of the cos/sin tables.
inline std::string bad_position_message(int64_t table_rows) {
  return "a position is outside the cos/sin tables [0, " + std::to_string(table_rows) + ")";
}

// cross_entropy: a target outside [0, classes) that is not ignore_index.
inline std::string bad_target_message(int64_t classes, int64_t ignore_index) {
  return "a target is outside [0, " + std::to_string(classes) + ") and is not the ignore_index " +
         std::to_string(ignore_index);
}

}  // namespace tensor_ops

#pragma once
// The message of the exception a call throws, for checks on its content.
#include <string>

#include <gtest/gtest.h>

namespace tensor_ops::testing {

// what() of the E that f() throws; a test failure when f() returns normally.
// Any other exception escapes and fails the test with its own message.
template <class E, class F>
std::string thrown_message(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an exception, but the call returned normally";
  return {};
}

}  // namespace tensor_ops::testing

// Error handling for setup paths: KESTREL_CHECK throws kestrel::Error with file:line and a message
// that names what was found and what was expected. Hot loops (decode) never throw.
#pragma once
#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace kestrel {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {
[[noreturn]] inline void fail(const char* file, int line, const std::string& msg) {
  (void)file;
  (void)line;
  throw Error(msg);
}
}  // namespace detail

}  // namespace kestrel

// KESTREL_CHECK(cond, "fmt {} {}", args...): throws kestrel::Error(message) when cond is false.
#define KESTREL_CHECK(cond, ...)                                                   \
  do {                                                                             \
    if (!(cond)) ::kestrel::detail::fail(__FILE__, __LINE__, fmt::format(__VA_ARGS__)); \
  } while (0)

#define KESTREL_FAIL(...) ::kestrel::detail::fail(__FILE__, __LINE__, fmt::format(__VA_ARGS__))

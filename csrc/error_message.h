// Error messages for TORCH_CHECK built without std::ostream.
//
// c10::str formats several arguments through a std::ostringstream instantiated in the caller's
// library. In this library, against torch 2.11 built with gcc-toolset-13 (the H200 machine),
// inserting an integer into that stream segfaulted inside std::ostream::_M_insert<long> (native
// backtrace): every failed argument check crashed the process instead of raising.
// TQ_CHECK builds the message here (std::to_string, string appends) and hands TORCH_CHECK one
// std::string, which c10::str passes through without a stream.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstdio>
#include <string>
#include <type_traits>

namespace turboquant {
namespace message_detail {

inline void append(std::string& s, const char* v) { s += v; }
inline void append(std::string& s, const std::string& v) { s += v; }
template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
void append(std::string& s, T v) {
  s += std::to_string(v);
}
inline void append(std::string& s, double v) {  // a double would otherwise take the IntArrayRef overload
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", v);
  s += buf;
}
inline void append(std::string& s, c10::IntArrayRef v) {
  s += '[';
  for (size_t i = 0; i < v.size(); ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(v[i]);
  }
  s += ']';
}
inline void append(std::string& s, at::ScalarType t) { s += c10::toString(t); }
inline void append(std::string& s, const c10::Device& d) { s += d.str(); }

}  // namespace message_detail

template <typename... Args>
std::string message(const Args&... args) {
  std::string s;
  (message_detail::append(s, args), ...);
  return s;
}

}  // namespace turboquant

// TORCH_CHECK with a message assembled by turboquant::message (evaluated only on failure).
#define TQ_CHECK(cond, ...) TORCH_CHECK(cond, ::turboquant::message(__VA_ARGS__))

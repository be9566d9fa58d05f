// moet-store: shared types, errors and small helpers of the C++ core.
#pragma once

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

namespace moet {

constexpr uint64_t kPage = 4096;  // O_DIRECT alignment used everywhere (offsets, lengths, buffers)

inline uint64_t round_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

// An I/O or store error carrying an errno; the bindings raise moet_store.StoreError(errno, msg).
struct IoError : std::runtime_error {
  int err;
  IoError(int e, const std::string& msg) : std::runtime_error(msg), err(e) {}
};

inline std::string errstr(int e) { return std::string(std::strerror(e < 0 ? -e : e)); }

}  // namespace moet

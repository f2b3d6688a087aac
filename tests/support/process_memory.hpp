// The process's memory as /proc/self/status reports it, for tests that bound what an operation costs.
#pragma once

#include <cstdint>
#include <fstream>
#include <string>

namespace fsdpx::test {

/// A field of /proc/self/status in bytes (VmRSS: resident now, VmHWM: the peak); -1 without one.
inline int64_t status_bytes(const std::string& field) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::stoll(line.substr(field.size() + 1)) * 1024;
  }
  return -1;
}

/// Resets VmHWM to the resident size now (Linux's clear_refs), so that a peak measured after is the
/// operation's own; false where the kernel refuses.
inline bool reset_peak() {
  std::ofstream clear("/proc/self/clear_refs");
  clear << "5";
  return static_cast<bool>(clear.flush());
}

}  // namespace fsdpx::test

// The examples' training text: a file that needs no download (a Debian license text, else this
// repository's README.md, else --corpus FILE), as a tensor of byte values (a byte-level vocabulary of 256).
#pragma once

#include <cstdint>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include <fsdpx/error.hpp>

namespace fsdpx::examples {

/// The bytes of `requested`, or of the first default candidate that exists; `used` gets its path.
inline at::Tensor load_corpus(const std::string& requested, std::string& used) {
  std::vector<std::string> candidates = {"/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/Apache-2.0",
                                         "README.md"};
  if (!requested.empty()) candidates = {requested};
  for (const auto& path : candidates) {
    std::ifstream in(path, std::ios::binary);
    if (!in) continue;
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (text.size() < 1024) continue;
    used = path;
    return at::tensor(std::vector<uint8_t>(text.begin(), text.end()), at::kByte).to(at::kLong);
  }
  FSDPX_CHECK(false, "no corpus found (tried ", candidates.front(), requested.empty() ? " and two others" : "",
              "); pass --corpus FILE (any text file of 1 KiB or more)");
  return {};
}

/// `batch` windows of `seq + 1` bytes of `corpus`, drawn with the current RNG: row i is [x_i, y_i] shifted by one.
inline at::Tensor random_windows(const at::Tensor& corpus, int64_t batch, int64_t seq) {
  const auto starts = at::randint(corpus.numel() - seq - 1, {batch}, at::kLong);
  const auto offsets = at::arange(seq + 1, at::kLong);
  return corpus.index({starts.unsqueeze(1) + offsets.unsqueeze(0)});
}

}  // namespace fsdpx::examples

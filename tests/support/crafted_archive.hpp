// torch.save archives crafted byte by byte, as a hostile checkpoint root would make them: torch's own zip writer
// (PyTorchStreamWriter) around a pickle written opcode by opcode. Used by tests/checkpoint/test_untrusted_archives.cpp
// and benchmarks/untrusted_before_after.cpp (which builds it against older commits too: no fsdpx header here).
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include <caffe2/serialize/inline_container.h>

namespace fsdpx::test::crafted {

/// A torch.save archive of `pickle` (data.pkl) and the storage records `records` ("0" -> its bytes).
inline std::string archive(const std::string& pickle,
                           const std::vector<std::pair<std::string, std::string>>& records = {}) {
  std::string out;
  {
    caffe2::serialize::PyTorchStreamWriter writer([&](const void* data, size_t n) {
      out.append(static_cast<const char*>(data), n);
      return n;
    });
    writer.writeRecord("data.pkl", pickle.data(), pickle.size());
    for (const auto& [key, bytes] : records) writer.writeRecord("data/" + key, bytes.data(), bytes.size());
    writer.writeEndOfFile();
  }
  return out;
}

inline std::filesystem::path write_file(const std::filesystem::path& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  return path;
}

inline std::string u32(uint32_t v) {
  std::string s(4, '\0');
  for (int i = 0; i < 4; ++i) s[i] = static_cast<char>(v >> (8 * i));
  return s;
}
inline std::string binunicode(const std::string& s) { return "X" + u32(static_cast<uint32_t>(s.size())) + s; }
inline std::string binint(int32_t v) { return "J" + u32(static_cast<uint32_t>(v)); }

/// The pickle of one float32 tensor over storage `key` (`numel` elements claimed), as LibTorch's pickler
/// writes it.
inline std::string tensor_pickle(const std::string& key, int64_t numel, int64_t offset,
                                 const std::vector<int64_t>& sizes, const std::vector<int64_t>& strides) {
  std::string p = "ctorch._utils\n_rebuild_tensor_v2\n(";
  p += "(" + binunicode("storage") + "ctorch\nFloatStorage\n" + binunicode(key) + binunicode("cpu") +
       binint(static_cast<int32_t>(numel)) + "tQ";
  p += binint(static_cast<int32_t>(offset));
  p += "(";
  for (const int64_t s : sizes) p += binint(static_cast<int32_t>(s));
  p += "t(";
  for (const int64_t s : strides) p += binint(static_cast<int32_t>(s));
  p += "t";
  p += "\x89";  // requires_grad False
  p += "ccollections\nOrderedDict\n)R";
  p += "tR";
  return p;
}

}  // namespace fsdpx::test::crafted

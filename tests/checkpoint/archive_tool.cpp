// The C++ side of python_archive_test.py: a torch.save archive as fsdpx reads it, as JSON.
//   fsdpx_archive_tool <file.pt>             prints the value load_ivalue makes of the file
//   fsdpx_archive_tool scheduler <file.pt>   reads the file as LightRFT's scheduler_state.pt is read on resume
//                                            (dcp::read_plain_file, then its checks) and prints the value
//   fsdpx_archive_tool client <file.pt> <N>  reads the file as LightRFT's client_state.pt of a folder of step N
// An error is printed and exits with 1.
// The JSON: {"none": null}, {"bool": b}, {"int": i}, {"float": "<the double's 16 hex digits>"}, {"str": s},
// {"list": [...]}, {"tuple": [...]}, {"dict": [[key, value], ...]}, and {"tensor": {"dtype", "sizes",
// "strides", "offset", "storage" (the storages in order of first appearance: 0, 1, ...), "storage_bytes",
// "requires_grad", "bytes" (the elements' bytes in row-major order, hex)}}. The test makes the same of
// torch.load's value.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <map>
#include <string>

#include <ATen/ATen.h>

#include <fsdpx/checkpoint/detail/torch_io.hpp>
#include <fsdpx/dcp.hpp>
#include <fsdpx/detail/json.hpp>
#include <fsdpx/error.hpp>
#include <fsdpx/policies/dtype_names.hpp>

using fsdpx::detail::Json;

namespace {

std::string hex(const void* data, size_t n) {
  static constexpr char digits[] = "0123456789abcdef";
  std::string out;
  out.reserve(2 * n);
  for (size_t i = 0; i < n; ++i) {
    const auto b = static_cast<const unsigned char*>(data)[i];
    out += digits[b >> 4];
    out += digits[b & 15];
  }
  return out;
}

class Describe {
 public:
  Json operator()(const c10::IValue& v) {
    if (v.isNone()) return {{"none", nullptr}};
    if (v.isBool()) return {{"bool", v.toBool()}};
    if (v.isInt()) return {{"int", v.toInt()}};
    if (v.isDouble()) {
      const double d = v.toDouble();
      uint64_t bits = 0;
      std::memcpy(&bits, &d, sizeof bits);
      char buf[17];
      std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(bits));
      return {{"float", buf}};
    }
    if (v.isString()) return {{"str", v.toStringRef()}};
    if (v.isTensor()) return tensor(v.toTensor());
    if (v.isList()) {
      Json items = Json::array();
      for (const c10::IValue& e : v.toListRef()) items.push_back((*this)(e));
      return {{"list", items}};
    }
    if (v.isTuple()) {
      Json items = Json::array();
      for (const c10::IValue& e : v.toTupleRef().elements()) items.push_back((*this)(e));
      return {{"tuple", items}};
    }
    if (v.isGenericDict()) {
      Json items = Json::array();
      for (const auto& item : v.toGenericDict())
        items.push_back(Json::array({(*this)(item.key()), (*this)(item.value())}));
      return {{"dict", items}};
    }
    throw fsdpx::Error(fsdpx::detail::str("fsdpx_archive_tool: a value of kind ", v.tagKind()));
  }

 private:
  Json tensor(const at::Tensor& t) {
    const void* storage = t.storage().data();
    const auto it = storages_.emplace(storage, static_cast<int>(storages_.size())).first;
    const at::Tensor bytes = t.reshape({-1}).contiguous().view(at::kByte);
    const char* dtype = fsdpx::torch_dtype_name(t.scalar_type());
    return {{"tensor",
             {{"dtype", dtype != nullptr ? dtype : "?"},
              {"sizes", t.sizes().vec()},
              {"strides", t.strides().vec()},
              {"offset", t.storage_offset()},
              {"storage", it->second},
              {"storage_bytes", t.storage().nbytes()},
              {"requires_grad", t.requires_grad()},
              {"bytes", hex(bytes.data_ptr(), static_cast<size_t>(bytes.numel()))}}}};
  }
  std::map<const void*, int> storages_;
};

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 2 ? argv[1] : "";
  if (!(argc == 2 || (argc == 3 && mode == "scheduler") || (argc == 4 && mode == "client"))) {
    std::cerr << "usage: fsdpx_archive_tool [scheduler] <file.pt> | client <file.pt> <step>\n";
    return 2;
  }
  try {
    namespace dcp = fsdpx::dcp;
    const c10::IValue value =
        mode == "scheduler" ? dcp::detail::lr_scheduler_state_from_torch(dcp::read_plain_file(argv[2]), argv[2])
        : mode == "client"
            ? dcp::detail::client_state_from_lightrft(dcp::read_plain_file(argv[2]), argv[2], std::stoll(argv[3]))
            : fsdpx::checkpoint::detail::load_ivalue(argv[1]);
    std::cout << Describe()(value).dump() << "\n";
  } catch (const std::exception& e) {
    std::cout << "error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}

// Out-of-line functions of fsdpx/sync/manifest.hpp: included by it (header-only) or by fsdpx/impl/src.hpp
// (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <fsdpx/sync/manifest.hpp>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <limits>
#include <unordered_map>
#include <unordered_set>

#include <ATen/Parallel.h>

#include <fsdpx/detail/crc32c.hpp>
#include <fsdpx/sync/detail/delta_codec.hpp>
#include <fsdpx/sync/detail/receive.hpp>

namespace fsdpx::sync {

namespace detail {

/// The record of one entry that the digest covers (and the manifest carries).
inline void put_identity(Writer& w, const ManifestEntry& e) {
  w.put<uint16_t>(static_cast<uint16_t>(e.name.size()));
  w.put_bytes(e.name);
  w.put<uint8_t>(dtype_code(e.dtype));
  w.put<uint8_t>(static_cast<uint8_t>(e.shape.size()));
  for (const int64_t d : e.shape) w.put<int64_t>(d);
}

}  // namespace detail

FSDPX_DECL const char* to_string(DeltaEncoding e) {
  switch (e) {
    case DeltaEncoding::unchanged: return "unchanged";
    case DeltaEncoding::sparse: return "sparse";
    case DeltaEncoding::full: return "full";
    case DeltaEncoding::xor_zlib: return "xor";
  }
  return "unknown";
}

FSDPX_DECL int64_t ManifestEntry::numel() const {
  int64_t n = 1;
  for (const int64_t d : shape) n *= d;
  return n;
}

FSDPX_DECL uint32_t Manifest::compute_digest() const {
  ::fsdpx::detail::Crc32c crc;
  std::vector<uint8_t> record;
  for (const ManifestEntry& e : entries) {
    record.clear();
    detail::Writer w(record);
    detail::put_identity(w, e);
    w.put<uint32_t>(e.crc);
    crc.update(record.data(), record.size());
  }
  return crc.value();
}

FSDPX_DECL Manifest Manifest::whole() const {
  Manifest m = *this;
  m.base_version = no_version;
  m.base_digest = 0;
  for (ManifestEntry& e : m.entries) {
    e.encoding = DeltaEncoding::full;
    e.index_bytes = 0;
    e.changed = -1;
  }
  return m;
}

FSDPX_DECL const ManifestEntry* Manifest::find(std::string_view name) const {
  for (const auto& e : entries) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

FSDPX_DECL at::Tensor Manifest::encode() const {
  std::vector<uint8_t> out;
  detail::Writer w(out);
  w.put<uint32_t>(detail::manifest_magic);
  w.put<uint16_t>(detail::manifest_format);
  w.put<uint16_t>(is_delta() ? 1 : 0);
  w.put<int64_t>(version);
  w.put<int64_t>(base_version);
  w.put<uint32_t>(base_digest);
  w.put<uint32_t>(digest);
  w.put<uint32_t>(static_cast<uint32_t>(entries.size()));
  w.put<uint32_t>(0);
  w.put<uint64_t>(0);
  for (const ManifestEntry& e : entries) {
    FSDPX_CHECK(e.name.size() < 65536 && e.shape.size() <= static_cast<size_t>(detail::max_ndim),
                "weight sync: tensor '", e.name, "' cannot travel (name of ", e.name.size(), " bytes, ", e.shape.size(),
                " dimensions)");
    detail::put_identity(w, e);
    w.put<uint8_t>(static_cast<uint8_t>(e.encoding));
    w.put<uint8_t>(e.index_bytes);
    w.put<uint16_t>(0);
    w.put<uint32_t>(e.crc);
    w.put<int64_t>(e.changed);
  }
  at::Tensor t = at::empty({static_cast<int64_t>(out.size())}, at::kByte);
  std::memcpy(t.data_ptr(), out.data(), out.size());
  return t;
}

FSDPX_DECL Manifest Manifest::decode(const at::Tensor& bytes, std::string_view where) {
  FSDPX_CHECK_AS(SyncError, bytes.scalar_type() == at::kByte && bytes.dim() == 1, "the manifest from ", where,
                 " is not a 1-D uint8 tensor");
  const at::Tensor host = detail::host_contiguous(bytes);
  const std::string context = ::fsdpx::detail::str("the manifest from ", where);
  detail::Reader r(host.const_data_ptr<uint8_t>(), host.numel(), context);
  if (r.get<uint32_t>("the magic number") != detail::manifest_magic) r.fail("bad magic number (not a manifest)");
  if (const auto f = r.get<uint16_t>("the format"); f != detail::manifest_format) {
    r.fail(::fsdpx::detail::str("format ", f, ", this build reads format ", detail::manifest_format));
  }
  Manifest m;
  const bool delta = (r.get<uint16_t>("the flags") & 1) != 0;
  m.version = r.get<int64_t>("the version");
  m.base_version = r.get<int64_t>("the base version");
  m.base_digest = r.get<uint32_t>("the base digest");
  m.digest = r.get<uint32_t>("the digest");
  const auto count = r.get<uint32_t>("the tensor count");
  r.get<uint32_t>("a reserved field");
  r.get<uint64_t>("a reserved field");
  if (m.version < 0 || delta != (m.base_version != no_version) || (delta && (m.base_version < 0))) {
    r.fail(
        ::fsdpx::detail::str("version ", m.version, " with base ", m.base_version, (delta ? " (a delta)" : " (full)")));
  }
  // An entry takes at least its fixed fields: a count the bytes cannot hold is refused before reserving.
  if (count > (host.numel() - detail::manifest_prefix_bytes) / detail::manifest_min_entry_bytes) {
    r.fail(::fsdpx::detail::str(count, " tensors cannot fit in ", host.numel(), " bytes"));
  }
  if (std::string problem = detail::bookkeeping_problem(
          static_cast<int64_t>(count) * detail::manifest_entry_bookkeeping_bytes, host.numel(),
          detail::version_bookkeeping_floor, ::fsdpx::detail::str("its ", count, " entries"));
      !problem.empty()) {
    r.fail(problem);
  }
  m.entries.reserve(count);
  std::unordered_set<std::string_view> names;
  names.reserve(count);
  for (uint32_t i = 0; i < count; ++i) {
    ManifestEntry e;
    e.name = r.get_string(r.get<uint16_t>("a name's length"), "a name");
    const auto code = r.get<uint8_t>("a dtype");
    const auto dtype = detail::dtype_from_code(code);
    if (!dtype) r.fail(::fsdpx::detail::str("tensor '", e.name, "' has unknown dtype code ", int(code)));
    e.dtype = *dtype;
    const auto ndim = r.get<uint8_t>("a rank");
    if (ndim > detail::max_ndim) r.fail(::fsdpx::detail::str("tensor '", e.name, "' has ", int(ndim), " dimensions"));
    int64_t numel = 1, bytes = 0;
    for (int d = 0; d < ndim; ++d) {
      const auto s = r.get<int64_t>("a shape");
      if (s < 0 || __builtin_mul_overflow(numel, s, &numel)) {
        r.fail(::fsdpx::detail::str("tensor '", e.name, "' has a negative or overflowing shape"));
      }
      e.shape.push_back(s);
    }
    if (__builtin_mul_overflow(numel, static_cast<int64_t>(c10::elementSize(e.dtype)), &bytes)) {
      r.fail(::fsdpx::detail::str("tensor '", e.name, "' has an overflowing size"));
    }
    const auto encoding = r.get<uint8_t>("an encoding");
    if (encoding > static_cast<uint8_t>(DeltaEncoding::xor_zlib)) {
      r.fail(::fsdpx::detail::str("tensor '", e.name, "' has unknown encoding ", int(encoding)));
    }
    e.encoding = DeltaEncoding(encoding);
    e.index_bytes = r.get<uint8_t>("an index width");
    r.get<uint16_t>("a reserved field");
    e.crc = r.get<uint32_t>("a CRC");
    e.changed = r.get<int64_t>("a changed count");
    if (!delta && e.encoding != DeltaEncoding::full) {
      r.fail(::fsdpx::detail::str("tensor '", e.name, "' is ", to_string(e.encoding), " in a full version"));
    }
    if (e.encoding == DeltaEncoding::sparse &&
        ((e.index_bytes != 4 && e.index_bytes != 8) || (e.index_bytes == 4 && numel > detail::narrow_index_limit))) {
      r.fail(::fsdpx::detail::str("tensor '", e.name, "' of ", numel, " elements has ", int(e.index_bytes),
                                  "-byte indices"));
    }
    if (e.changed < -1 || e.changed > numel || (e.encoding == DeltaEncoding::sparse && e.changed < 1)) {
      r.fail(::fsdpx::detail::str("tensor '", e.name, "' of ", numel, " elements says ", e.changed, " changed"));
    }
    m.entries.push_back(std::move(e));
    // Views of the names held in place (reserve() above: the entries never move).
    if (!names.insert(m.entries.back().name).second) {
      r.fail(::fsdpx::detail::str("tensor '", m.entries.back().name, "' is listed twice"));
    }
  }
  if (r.position() != host.numel())
    r.fail(::fsdpx::detail::str(host.numel() - r.position(), " bytes follow the last entry"));
  if (m.compute_digest() != m.digest) r.fail("its digest does not match its entries (corrupted, or made wrongly)");
  return m;
}

FSDPX_DECL uint32_t tensor_crc32c(const at::Tensor& t) {
  using ::fsdpx::detail::Crc32c;
  const at::Tensor host = detail::host_contiguous(t);
  const uint8_t* p = detail::bytes_of(host);
  const int64_t n = static_cast<int64_t>(host.nbytes());
  constexpr int64_t block = int64_t{4} << 20;  // blocks checksummed on the intra-op threads, then joined
  const int64_t blocks = (n + block - 1) / block;
  if (blocks <= 1 || at::get_num_threads() <= 1 || at::in_parallel_region())
    return Crc32c::of(p, static_cast<size_t>(n));
  std::vector<uint32_t> crcs(static_cast<size_t>(blocks));
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      crcs[static_cast<size_t>(b)] = Crc32c::of(p + b * block, static_cast<size_t>(std::min(block, n - b * block)));
    }
  });
  uint32_t crc = crcs[0];
  for (int64_t b = 1; b < blocks; ++b) {
    crc = Crc32c::combine(crc, crcs[static_cast<size_t>(b)], static_cast<uint64_t>(std::min(block, n - b * block)));
  }
  return crc;
}

FSDPX_DECL Manifest full_manifest(int64_t version, const std::vector<NamedTensor>& tensors) {
  Manifest m;
  m.version = version;
  m.entries.reserve(tensors.size());
  for (const auto& t : tensors) {
    m.entries.push_back(
        {t.name, t.tensor.scalar_type(), t.tensor.sizes().vec(), DeltaEncoding::full, 0, tensor_crc32c(t.tensor), -1});
  }
  m.digest = m.compute_digest();
  return m;
}

namespace detail {

FSDPX_DECL std::unordered_map<std::string_view, const ManifestEntry*> entries_by_name(const Manifest& manifest) {
  std::unordered_map<std::string_view, const ManifestEntry*> index;
  index.reserve(manifest.entries.size());
  for (const ManifestEntry& e : manifest.entries) index.emplace(e.name, &e);
  return index;
}

FSDPX_DECL std::optional<ManifestPrefix> peek_manifest(const at::Tensor& bytes) {
  if (bytes.scalar_type() != at::kByte || bytes.dim() != 1 || bytes.numel() < manifest_prefix_bytes) return {};
  const at::Tensor host = host_contiguous(bytes);
  Reader r(host.const_data_ptr<uint8_t>(), host.numel(), "a manifest's prefix");
  if (r.get<uint32_t>("the magic number") != manifest_magic || r.get<uint16_t>("the format") != manifest_format) {
    return {};
  }
  ManifestPrefix prefix;
  prefix.delta = (r.get<uint16_t>("the flags") & 1) != 0;
  prefix.version = r.get<int64_t>("the version");
  return prefix;
}

FSDPX_DECL std::pair<Manifest, std::vector<NamedTensor>> split_manifest(std::vector<NamedTensor> received,
                                                                        std::string_view where) {
  FSDPX_CHECK_AS(SyncError, !received.empty() && received.front().name == detail::manifest_name,
                 "a weight version from ", where, " does not start with its manifest ('", detail::manifest_name,
                 "'): the sender speaks an older protocol, or the version is corrupt");
  Manifest m = Manifest::decode(received.front().tensor, where);
  received.erase(received.begin());
  for (const auto& t : received) {
    FSDPX_CHECK_AS(SyncError, t.name != detail::manifest_name, "weight version ", m.version, " from ", where,
                   " carries two manifests");
  }
  return {std::move(m), std::move(received)};
}

}  // namespace detail

FSDPX_DECL void verify(const std::vector<NamedTensor>& tensors, const Manifest& manifest) {
  std::vector<std::string> problems;
  std::unordered_map<std::string_view, const at::Tensor*> by_name;
  for (const auto& t : tensors) {
    if (!by_name.emplace(t.name, &t.tensor).second)
      problems.push_back(::fsdpx::detail::str("'", t.name, "' is listed twice"));
  }
  for (const ManifestEntry& e : manifest.entries) {
    const auto it = by_name.find(e.name);
    if (it == by_name.end()) {
      problems.push_back(::fsdpx::detail::str("'", e.name, "' is missing"));
      continue;
    }
    const at::Tensor& t = *it->second;
    by_name.erase(it);
    if (t.scalar_type() != e.dtype || t.sizes().vec() != e.shape) {
      problems.push_back(::fsdpx::detail::str("'", e.name, "' is ", t.scalar_type(), " ", t.sizes(), ", version ",
                                              manifest.version, " has ", e.dtype, " ", c10::IntArrayRef(e.shape)));
    } else if (tensor_crc32c(t) != e.crc) {
      problems.push_back(::fsdpx::detail::str("'", e.name, "' differs (its CRC-32C is not the version's)"));
    }
  }
  for (const auto& [name, t] : by_name) {
    problems.push_back(::fsdpx::detail::str("'", name, "' is not in version ", manifest.version));
  }
  FSDPX_CHECK_AS(SyncError, problems.empty(), "these weights are not version ", manifest.version, " (digest ",
                 manifest.digest, "): ", detail::TensorCollector::join(problems));
}

FSDPX_DECL void verify(torch::nn::Module& module, const Manifest& manifest) {
  // Each parameter or buffer once, under the name the version lists it by (a tied one has several).
  std::vector<NamedTensor> tensors;
  std::unordered_map<const c10::TensorImpl*, size_t> seen;
  const auto listed = detail::entries_by_name(manifest);
  const auto add = [&](const std::string& name, const at::Tensor& t) {
    if (!t.defined()) return;
    const auto [it, fresh] = seen.emplace(t.unsafeGetTensorImpl(), tensors.size());
    if (fresh) {
      tensors.push_back({name, t});
    } else if (listed.contains(name) && !listed.contains(tensors[it->second].name)) {
      tensors[it->second].name = name;
    }
  };
  for (const auto& item : module.named_parameters(/*recurse=*/true)) add(item.key(), item.value());
  for (const auto& item : module.named_buffers(/*recurse=*/true)) add(item.key(), item.value());
  verify(tensors, manifest);
}

}  // namespace fsdpx::sync

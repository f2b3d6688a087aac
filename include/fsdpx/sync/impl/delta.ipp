// Out-of-line functions of fsdpx/sync/delta.hpp: included by it (header-only) or by fsdpx/impl/src.hpp
// (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <fsdpx/sync/delta.hpp>

#if defined(FSDPX_WITH_ZLIB)
#include <zlib.h>
#endif

#include <algorithm>
#include <chrono>
#include <cstring>
#include <limits>
#include <unordered_map>
#include <unordered_set>

#include <ATen/Parallel.h>

#include <fsdpx/detail/crc32c.hpp>

namespace fsdpx::sync {

namespace detail {

inline constexpr uint32_t manifest_magic = 0x4D535846;  // "FXSM"
inline constexpr uint16_t manifest_format = 1;
inline constexpr int64_t manifest_prefix_bytes = 48;

/// The integer dtype of `t`'s element size: the bits compared, XORed and moved as they are.
inline at::ScalarType bits_dtype(at::ScalarType t) {
  switch (c10::elementSize(t)) {
    case 1: return at::kByte;
    case 2: return at::kShort;
    case 4: return at::kInt;
    default: return at::kLong;
  }
}

/// A host, contiguous tensor with `t`'s bytes (t itself when it already is one).
inline at::Tensor host_contiguous(const at::Tensor& t) { return t.detach().to(at::kCPU).contiguous(); }

inline const uint8_t* bytes_of(const at::Tensor& t) { return static_cast<const uint8_t*>(t.const_data_ptr()); }

/// Where the elements of `a` and `b` (host, contiguous, same size) differ in their bits, counted per
/// chunk of `grain` elements in one parallel pass that stores nothing else: a tensor that changed
/// everywhere costs no index list, and a sparse payload is then filled in parallel at known offsets.
struct ChangeCount {
  static constexpr int64_t grain = int64_t{1} << 20;
  std::vector<int64_t> per_chunk;
  int64_t total = 0;
};

/// Calls fn(i) for each element i in [begin, end) whose bits differ, in ascending order, for elements of
/// E bytes. Words of 8 bytes are compared first (unchanged weights, the common case, cost one compare
/// per word), then the lanes of a word that differs, as integers.
template <int E, class Fn>
inline void for_each_change_of(const uint8_t* pa, const uint8_t* pb, int64_t begin, int64_t end, Fn&& fn) {
  constexpr int per_word = 8 / E;
  int64_t i = begin;
  for (; i + per_word <= end; i += per_word) {
    uint64_t x, y;
    std::memcpy(&x, pa + i * E, 8);
    std::memcpy(&y, pb + i * E, 8);
    const uint64_t d = x ^ y;
    if (d == 0) continue;
    if constexpr (E == 8) {
      fn(i);
    } else {
      constexpr uint64_t lane = (uint64_t{1} << (8 * E)) - 1;
      for (int j = 0; j < per_word; ++j) {
        if (((d >> (8 * E * j)) & lane) != 0) fn(i + j);
      }
    }
  }
  for (; i < end; ++i) {
    if (std::memcmp(pa + i * E, pb + i * E, E) != 0) fn(i);
  }
}

template <class Fn>
inline void for_each_change(const uint8_t* pa, const uint8_t* pb, int64_t esize, int64_t begin, int64_t end, Fn&& fn) {
  switch (esize) {
    case 1: return for_each_change_of<1>(pa, pb, begin, end, fn);
    case 2: return for_each_change_of<2>(pa, pb, begin, end, fn);
    case 4: return for_each_change_of<4>(pa, pb, begin, end, fn);
    default: return for_each_change_of<8>(pa, pb, begin, end, fn);
  }
}

/// Calls f.template operator()<E, W>() with the element size E and the index width W (4 or 8) as
/// constants: the per-element loops below then copy with fixed sizes, which the compiler inlines.
template <class F>
inline void with_widths(int64_t esize, int64_t index_bytes, F&& f) {
  const auto by_index = [&]<int E>() {
    if (index_bytes == 4) {
      f.template operator()<E, 4>();
    } else {
      f.template operator()<E, 8>();
    }
  };
  switch (esize) {
    case 1: by_index.template operator()<1>(); break;
    case 2: by_index.template operator()<2>(); break;
    case 4: by_index.template operator()<4>(); break;
    default: by_index.template operator()<8>(); break;
  }
}

inline ChangeCount count_changed(const at::Tensor& a, const at::Tensor& b) {
  const int64_t esize = static_cast<int64_t>(a.element_size());
  const int64_t n = a.numel();
  ChangeCount c;
  c.per_chunk.assign(static_cast<size_t>((n + ChangeCount::grain - 1) / ChangeCount::grain), 0);
  at::parallel_for(0, static_cast<int64_t>(c.per_chunk.size()), 1, [&](int64_t c0, int64_t c1) {
    for (int64_t k = c0; k < c1; ++k) {
      int64_t found = 0;
      for_each_change(bytes_of(a), bytes_of(b), esize, k * ChangeCount::grain,
                      std::min(n, (k + 1) * ChangeCount::grain), [&](int64_t) { ++found; });
      c.per_chunk[static_cast<size_t>(k)] = found;
    }
  });
  for (const int64_t k : c.per_chunk) c.total += k;
  return c;
}

/// The sparse payload of `t` against `base`: every changed index (`index_bytes` wide), then the values.
inline at::Tensor sparse_payload(const at::Tensor& t, const at::Tensor& base, const ChangeCount& count,
                                 int64_t index_bytes) {
  const int64_t esize = static_cast<int64_t>(t.element_size());
  at::Tensor payload = at::empty({count.total * (index_bytes + esize)}, at::kByte);
  uint8_t* indices = payload.mutable_data_ptr<uint8_t>();
  uint8_t* values = indices + count.total * index_bytes;
  std::vector<int64_t> first(count.per_chunk.size(), 0);  // where each chunk's changes start
  for (size_t k = 1; k < first.size(); ++k) first[k] = first[k - 1] + count.per_chunk[k - 1];
  const uint8_t* src = bytes_of(t);
  with_widths(esize, index_bytes, [&]<int E, int W>() {
    at::parallel_for(0, static_cast<int64_t>(first.size()), 1, [&](int64_t c0, int64_t c1) {
      for (int64_t k = c0; k < c1; ++k) {
        int64_t at = first[static_cast<size_t>(k)];
        for_each_change_of<E>(src, bytes_of(base), k * ChangeCount::grain,
                              std::min(t.numel(), (k + 1) * ChangeCount::grain), [&](int64_t i) {
                                std::memcpy(indices + at * W, &i, W);  // little-endian
                                std::memcpy(values + at * E, src + i * E, E);
                                ++at;
                              });
      }
    });
  });
  return payload;
}

/// a XOR b over bytes [at, at + n) of both, into `out` (n bytes).
inline void xor_into(const uint8_t* a, const uint8_t* b, int64_t n, uint8_t* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t x, y;
    std::memcpy(&x, a + i, 8);
    std::memcpy(&y, b + i, 8);
    x ^= y;
    std::memcpy(out + i, &x, 8);
  }
  for (; i < n; ++i) out[i] = a[i] ^ b[i];
}

#if defined(FSDPX_WITH_ZLIB)
inline constexpr bool has_zlib = true;

/// zlib (RFC 1950) of `n` bytes at `data`, fed in pieces zlib's 32-bit counters can take.
inline std::vector<uint8_t> deflate_bytes(const uint8_t* data, int64_t n, int level) {
  z_stream z{};
  FSDPX_CHECK_AS(SyncError, deflateInit(&z, level) == Z_OK, "weight sync: zlib could not start compressing");
  std::vector<uint8_t> out(static_cast<size_t>(deflateBound(&z, static_cast<uLong>(std::min<int64_t>(n, 1 << 30)))) +
                           64);
  size_t produced = 0;
  int64_t fed = 0;
  int rc = Z_OK;
  do {
    const int64_t piece = std::min<int64_t>(n - fed, 1 << 30);
    z.next_in = const_cast<Bytef*>(data + fed);
    z.avail_in = static_cast<uInt>(piece);
    fed += piece;
    const int flush = fed == n ? Z_FINISH : Z_NO_FLUSH;
    do {
      if (out.size() - produced < (1 << 16)) out.resize(out.size() * 2);
      z.next_out = out.data() + produced;
      z.avail_out = static_cast<uInt>(std::min<size_t>(out.size() - produced, 1u << 30));
      const uInt before = z.avail_out;
      rc = deflate(&z, flush);
      produced += before - z.avail_out;
    } while (z.avail_in > 0 || (flush == Z_FINISH && rc != Z_STREAM_END));
  } while (fed < n);
  deflateEnd(&z);
  out.resize(produced);
  return out;
}

/// Inflates `stream` into exactly `n` bytes at `out`; why it cannot (corrupt, shorter, longer, trailing
/// bytes), or empty. Never writes beyond `n` bytes, whatever the stream says.
inline std::string inflate_exactly(const uint8_t* stream, int64_t length, uint8_t* out, int64_t n) {
  z_stream z{};
  if (inflateInit(&z) != Z_OK) return "zlib could not start inflating";
  int64_t consumed = 0, produced = 0;
  int rc = Z_OK;
  std::string problem;
  while (true) {
    if (z.avail_in == 0 && consumed < length) {
      const int64_t piece = std::min<int64_t>(length - consumed, 1 << 30);
      z.next_in = const_cast<Bytef*>(stream + consumed);
      z.avail_in = static_cast<uInt>(piece);
      consumed += piece;
    }
    if (produced == n) {
      // Full: the stream must end here. One more byte of room tells a longer stream from its end marker.
      uint8_t extra = 0;
      z.next_out = &extra;
      z.avail_out = 1;
      rc = inflate(&z, Z_NO_FLUSH);
      if (z.avail_out == 0) problem = ::fsdpx::detail::str("the stream inflates beyond the tensor's ", n, " bytes");
      break;
    }
    z.next_out = out + produced;
    z.avail_out = static_cast<uInt>(std::min<int64_t>(n - produced, 1 << 30));
    const uInt before = z.avail_out;
    rc = inflate(&z, Z_NO_FLUSH);
    produced += before - z.avail_out;
    if (rc == Z_STREAM_END || (rc != Z_OK && rc != Z_BUF_ERROR)) break;
    if (rc == Z_BUF_ERROR && z.avail_in == 0 && consumed == length) break;  // input ran out
  }
  const bool ended = rc == Z_STREAM_END;
  const int64_t left = length - consumed + static_cast<int64_t>(z.avail_in);
  inflateEnd(&z);
  if (!problem.empty()) return problem;
  if (rc != Z_STREAM_END && rc != Z_OK && rc != Z_BUF_ERROR)
    return ::fsdpx::detail::str("not a valid zlib stream (zlib error ", rc, ")");
  if (!ended) return ::fsdpx::detail::str("the stream ends after ", produced, " of the tensor's ", n, " bytes");
  if (produced != n) return ::fsdpx::detail::str("the stream inflates to ", produced, " bytes, the tensor has ", n);
  if (left != 0) return ::fsdpx::detail::str(left, " bytes follow the end of the stream");
  return {};
}
#else
inline constexpr bool has_zlib = false;
inline std::vector<uint8_t> deflate_bytes(const uint8_t*, int64_t, int) { return {}; }
inline std::string inflate_exactly(const uint8_t*, int64_t, uint8_t*, int64_t) {
  return "this build of fsdpx has no zlib (FSDPX_WITH_ZLIB): it cannot apply an XOR delta; have the publisher send "
         "deltas without it (DeltaOptions::link_bytes_per_second > 0 rarely picks it), or build with zlib";
}
#endif

/// Whether, by a sample, the delta of `fresh` from `held` would carry 90% or more of the version's bytes
/// (what cut() then sends whole): every 64th run of 4 KiB of every tensor is compared, and the XOR of up
/// to 32 of those runs compressed and timed; each tensor's encoding is then chosen as cut() would, on
/// these estimates. True spares a version where (nearly) everything changed the full comparison pass.
/// Tensors not on the host, or not contiguous, leave it to the pass (false).
inline bool delta_cannot_pay(const std::vector<NamedTensor>& fresh, const std::vector<NamedTensor>& held,
                             const DeltaOptions& options) {
  constexpr int64_t run = 4096, stride = 64 * run;
  constexpr size_t xor_runs = 32;
  struct Sampled {
    int64_t bytes = 0, sampled = 0, changed = 0, esize = 1, numel = 0;
  };
  std::vector<Sampled> per_tensor(fresh.size());
  int64_t total_runs = 0;
  for (size_t i = 0; i < fresh.size(); ++i) {
    const at::Tensor& t = fresh[i].tensor;
    const at::Tensor& h = held[i].tensor;
    if (!t.is_cpu() || !t.is_contiguous() || !h.is_cpu() || !h.is_contiguous()) return false;
    total_runs += (static_cast<int64_t>(t.nbytes()) + stride - 1) / stride;
  }
  const int64_t xor_every = std::max<int64_t>(1, total_runs / static_cast<int64_t>(xor_runs));
  std::vector<uint8_t> xored;
  int64_t run_index = 0;
  for (size_t i = 0; i < fresh.size(); ++i) {
    const at::Tensor& t = fresh[i].tensor;
    Sampled& s = per_tensor[i];
    s.esize = static_cast<int64_t>(t.element_size());
    s.bytes = static_cast<int64_t>(t.nbytes());
    s.numel = t.numel();
    for (int64_t offset = 0; offset < s.bytes; offset += stride, ++run_index) {
      const int64_t len = std::min(run, s.bytes - offset);
      for_each_change(bytes_of(t) + offset, bytes_of(held[i].tensor) + offset, s.esize, 0, len / s.esize,
                      [&](int64_t) { ++s.changed; });
      s.sampled += len / s.esize;
      if (has_zlib && run_index % xor_every == 0 && xored.size() < xor_runs * run) {
        const size_t at_end = xored.size();
        xored.resize(at_end + static_cast<size_t>(len));
        xor_into(bytes_of(t) + offset, bytes_of(held[i].tensor) + offset, len, xored.data() + at_end);
      }
    }
  }
  // The XOR's compressed size and time per byte, from its sample.
  double xor_ratio = 1, xor_seconds_per_byte = 0;
  if (!xored.empty()) {
    const auto start = std::chrono::steady_clock::now();
    const auto z = deflate_bytes(xored.data(), static_cast<int64_t>(xored.size()), options.zlib_level);
    xor_seconds_per_byte = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() /
                           static_cast<double>(xored.size());
    xor_ratio = static_cast<double>(z.size()) / static_cast<double>(xored.size());
  }
  const double rate = options.link_bytes_per_second;
  const auto cost = [&](double bytes, double seconds) { return rate > 0 ? bytes / rate + seconds : bytes; };
  double sent = 0, whole = 0;
  for (const Sampled& s : per_tensor) {
    const double full = static_cast<double>(s.bytes);
    whole += full;
    if (s.sampled == 0 || s.changed == 0) continue;  // unchanged, by the sample: nothing sent
    const double changed =
        static_cast<double>(s.changed) / static_cast<double>(s.sampled) * static_cast<double>(s.numel);
    const double sparse = changed * static_cast<double>((s.numel > (int64_t{1} << 32) ? 8 : 4) + s.esize);
    double best = std::min(cost(sparse, 0), cost(full, 0)), bytes = sparse < full ? sparse : full;
    if (!xored.empty() && changed >= static_cast<double>(options.xor_min_changed) &&
        cost(xor_ratio * full, 2 * xor_seconds_per_byte * full) < best) {
      bytes = xor_ratio * full;
    }
    sent += bytes;
  }
  return whole > 0 && sent >= 0.9 * whole;
}

/// The record of one entry that the digest covers (and the manifest carries).
inline void put_identity(Writer& w, const ManifestEntry& e) {
  w.put<uint16_t>(static_cast<uint16_t>(e.name.size()));
  w.put_bytes(e.name);
  w.put<uint8_t>(dtype_code(e.dtype));
  w.put<uint8_t>(static_cast<uint8_t>(e.shape.size()));
  for (const int64_t d : e.shape) w.put<int64_t>(d);
}

[[noreturn]] inline void delta_fail(std::string_view where, int64_t version, const std::string& why) {
  throw SyncError(::fsdpx::detail::str("fsdpx: weight version ", version, " from ", where, ": ", why));
}

/// One applied tensor, and how to take it back.
struct Undo {
  size_t index;
  at::Tensor saved;    // sparse: old values; full: the old tensor; xor: the inflated bits
  at::Tensor indices;  // sparse
  DeltaEncoding encoding;
};

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
  constexpr int64_t min_entry_bytes = 2 + 1 + 1 + 1 + 1 + 2 + 4 + 8;
  if (count > (host.numel() - detail::manifest_prefix_bytes) / min_entry_bytes) {
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
        ((e.index_bytes != 4 && e.index_bytes != 8) || (e.index_bytes == 4 && numel > (int64_t{1} << 32)))) {
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

FSDPX_DECL std::pair<Manifest, std::vector<NamedTensor>> split_manifest(std::vector<NamedTensor> received,
                                                                        std::string_view where) {
  FSDPX_CHECK_AS(SyncError, !received.empty() && received.front().name == manifest_name, "a weight version from ",
                 where, " does not start with its manifest ('", manifest_name,
                 "'): the sender speaks an older protocol, or the version is corrupt");
  Manifest m = Manifest::decode(received.front().tensor, where);
  received.erase(received.begin());
  for (const auto& t : received) {
    FSDPX_CHECK_AS(SyncError, t.name != manifest_name, "weight version ", m.version, " from ", where,
                   " carries two manifests");
  }
  return {std::move(m), std::move(received)};
}

FSDPX_DECL EncodedVersion VersionStore::cut(int64_t version, const std::vector<NamedTensor>& tensors,
                                            const DeltaOptions& options) const {
  EncodedVersion out;
  Manifest& m = out.manifest;
  m.version = version;
  bool delta =
      options.enabled && manifest_ && manifest_->entries.size() == tensors.size() && version != manifest_->version;
  for (size_t i = 0; delta && i < tensors.size(); ++i) {
    const ManifestEntry& b = manifest_->entries[i];
    const at::Tensor& t = tensors[i].tensor;
    // A tensor that is the held one (the caller handed over memory it still changes) cannot be compared.
    delta = b.name == tensors[i].name && b.dtype == t.scalar_type() && b.shape == t.sizes().vec() &&
            (t.numel() == 0 || t.const_data_ptr() != tensors_[i].tensor.const_data_ptr());
  }
  if (delta && detail::delta_cannot_pay(tensors, tensors_, options)) delta = false;  // no comparison pass
  if (delta) {
    m.base_version = manifest_->version;
    m.base_digest = manifest_->digest;
  }
  out.tensors.push_back({std::string(manifest_name), at::Tensor()});  // filled once the digest is known
  m.entries.reserve(tensors.size());
  out.finals.resize(tensors.size());
  std::vector<at::Tensor> hosts;  // each tensor as sent whole, should the delta not pay
  hosts.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const NamedTensor& nt = tensors[i];
    const at::Tensor t = detail::host_contiguous(nt.tensor);
    detail::dtype_code(t.scalar_type());  // checks the dtype can travel
    ManifestEntry e{nt.name, t.scalar_type(), t.sizes().vec(), DeltaEncoding::full, 0, 0, -1};
    const int64_t esize = static_cast<int64_t>(t.element_size());
    const int64_t full_bytes = static_cast<int64_t>(t.nbytes());
    out.full_bytes += full_bytes;
    hosts.push_back(t);
    if (!delta) {
      e.crc = tensor_crc32c(t);
      out.tensors.push_back({nt.name, t});
      out.finals[i] = t;
      m.entries.push_back(std::move(e));
      continue;
    }
    const at::Tensor& base = tensors_[i].tensor;
    const detail::ChangeCount changes = detail::count_changed(t, base);
    e.changed = changes.total;
    if (e.changed == 0) {
      e.crc = manifest_->entries[i].crc;  // the same bits as the base's
      e.encoding = DeltaEncoding::unchanged;
      m.entries.push_back(std::move(e));
      continue;
    }
    e.crc = tensor_crc32c(t);
    // Each candidate's cost: its bytes over the link, plus (xor) compressing and inflating them.
    const double rate = options.link_bytes_per_second;
    const auto cost = [&](double bytes, double seconds) { return rate > 0 ? bytes / rate + seconds : bytes; };
    e.index_bytes = t.numel() > (int64_t{1} << 32) ? 8 : 4;
    const int64_t sparse_bytes = e.changed * (e.index_bytes + esize);
    double best = std::min(cost(static_cast<double>(sparse_bytes), 0), cost(static_cast<double>(full_bytes), 0));
    e.encoding = sparse_bytes < full_bytes ? DeltaEncoding::sparse : DeltaEncoding::full;
    std::vector<uint8_t> packed;
    if (detail::has_zlib && e.changed >= options.xor_min_changed) {
      // A sample first (4 slices of 16 KiB across the tensor, XORed and compressed), timed: the whole is
      // XORed and compressed only if the sample says it would win.
      constexpr int64_t slice = 16 << 10;
      double sample_in = 0, sample_out = 0, seconds = 0;
      const int64_t slices = full_bytes >= 4 * slice ? 4 : 1;
      std::vector<uint8_t> bits(static_cast<size_t>(std::min(slice, full_bytes)));
      for (int64_t s = 0; s < slices; ++s) {
        const int64_t at = slices == 1 ? 0 : s * (full_bytes - slice) / 3;
        const int64_t len = std::min(slice, full_bytes - at);
        const auto start = std::chrono::steady_clock::now();
        detail::xor_into(detail::bytes_of(t) + at, detail::bytes_of(base) + at, len, bits.data());
        const auto z = detail::deflate_bytes(bits.data(), len, options.zlib_level);
        seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        sample_in += static_cast<double>(len);
        sample_out += static_cast<double>(z.size());
      }
      const double scale = static_cast<double>(full_bytes) / sample_in;
      // Inflating costs about what compressing did at level 1; counted once more.
      if (cost(sample_out * scale, 2 * seconds * scale) < 0.9 * best) {
        const auto start = std::chrono::steady_clock::now();
        std::vector<uint8_t> all(static_cast<size_t>(full_bytes));
        detail::xor_into(detail::bytes_of(t), detail::bytes_of(base), full_bytes, all.data());
        packed = detail::deflate_bytes(all.data(), full_bytes, options.zlib_level);
        const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        if (const double c = cost(static_cast<double>(packed.size()), 2 * took); c < best) {
          best = c;
          e.encoding = DeltaEncoding::xor_zlib;
        }
      }
    }
    switch (e.encoding) {
      case DeltaEncoding::sparse:
        out.tensors.push_back({nt.name, detail::sparse_payload(t, base, changes, e.index_bytes)});
        break;
      case DeltaEncoding::xor_zlib: {
        at::Tensor payload = at::empty({static_cast<int64_t>(packed.size())}, at::kByte);
        std::memcpy(payload.data_ptr(), packed.data(), packed.size());
        out.tensors.push_back({nt.name, std::move(payload)});
        out.finals[i] = t;
        break;
      }
      default:
        out.tensors.push_back({nt.name, t});
        out.finals[i] = t;
        break;
    }
    m.entries.push_back(std::move(e));
  }
  int64_t delta_bytes = 0;
  for (size_t i = 1; i < out.tensors.size(); ++i) delta_bytes += static_cast<int64_t>(out.tensors[i].tensor.nbytes());
  if (delta && delta_bytes * 10 >= out.full_bytes * 9) {
    // Nearly everything changed: the version goes full (a reader then takes it as any full version, with
    // no base to check and nothing to undo), costing the publisher only the comparison.
    m = m.whole();
    out.tensors.resize(1);
    for (size_t i = 0; i < m.entries.size(); ++i) {
      out.tensors.push_back({m.entries[i].name, hosts[i]});
      out.finals[i] = hosts[i];
    }
  }
  m.digest = m.compute_digest();
  out.tensors.front().tensor = m.encode();
  for (const auto& t : out.tensors) out.bytes += static_cast<int64_t>(t.tensor.nbytes());
  return out;
}

FSDPX_DECL void VersionStore::commit(EncodedVersion v) {
  at::NoGradGuard no_grad;
  if (!v.manifest.is_delta()) {
    // The tensors may be the caller's own (host_contiguous returns a tensor as it is): a copy is kept.
    std::vector<NamedTensor> held;
    held.reserve(v.manifest.entries.size());
    for (size_t i = 0; i < v.manifest.entries.size(); ++i)
      held.push_back({v.manifest.entries[i].name, v.finals[i].clone()});
    tensors_ = std::move(held);
    manifest_ = std::move(v.manifest);
    return;
  }
  FSDPX_CHECK(manifest_ && holds(v.manifest.base_version, v.manifest.base_digest),
              "weight sync: internal error: a delta committed onto another version than its base");
  size_t next = 1;  // v.tensors[0] is the manifest
  for (size_t i = 0; i < v.manifest.entries.size(); ++i) {
    const ManifestEntry& e = v.manifest.entries[i];
    if (e.encoding == DeltaEncoding::unchanged) continue;
    const at::Tensor& payload = v.tensors[next++].tensor;
    at::Tensor held = tensors_[i].tensor;
    if (e.encoding == DeltaEncoding::sparse) {
      const uint8_t* p = detail::bytes_of(payload);
      uint8_t* dst = static_cast<uint8_t*>(held.data_ptr());
      detail::with_widths(static_cast<int64_t>(held.element_size()), e.index_bytes, [&]<int E, int W>() {
        const uint8_t* values = p + e.changed * W;
        for (int64_t k = 0; k < e.changed; ++k) {
          uint64_t idx = 0;
          std::memcpy(&idx, p + k * W, W);
          std::memcpy(dst + static_cast<int64_t>(idx) * E, values + k * E, E);
        }
      });
    } else {
      held.copy_(v.finals[i]);
    }
  }
  manifest_ = std::move(v.manifest);
}

FSDPX_DECL void VersionStore::adopt(std::vector<NamedTensor> tensors, Manifest manifest) {
  FSDPX_CHECK_AS(SyncError, tensors.size() == manifest.entries.size(), "weight sync: ", tensors.size(),
                 " tensors cannot hold version ", manifest.version, " of ", manifest.entries.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const ManifestEntry& e = manifest.entries[i];
    const at::Tensor& t = tensors[i].tensor;
    FSDPX_CHECK_AS(
        SyncError,
        tensors[i].name == e.name && t.scalar_type() == e.dtype && t.sizes().vec() == e.shape && t.is_contiguous(),
        "weight sync: tensor '", tensors[i].name, "' cannot hold '", e.name, "' of version ", manifest.version, " (",
        e.dtype, " ", c10::IntArrayRef(e.shape), ", contiguous)");
  }
  tensors_ = std::move(tensors);
  manifest_ = std::move(manifest);
}

FSDPX_DECL void VersionStore::accept(std::vector<NamedTensor> received, Apply mode, std::string_view where) {
  auto [m, rest] = split_manifest(std::move(received), where);
  std::unordered_map<std::string_view, size_t> by_name;
  for (size_t i = 0; i < rest.size(); ++i) {
    if (!by_name.emplace(rest[i].name, i).second) {
      detail::delta_fail(where, m.version, ::fsdpx::detail::str("tensor '", rest[i].name, "' arrived twice"));
    }
  }
  for (const auto& t : rest) {
    const ManifestEntry* e = m.find(t.name);
    if (e == nullptr || e->encoding == DeltaEncoding::unchanged) {
      detail::delta_fail(where, m.version,
                         ::fsdpx::detail::str("tensor '", t.name, "' arrived but its manifest ",
                                              e ? "says it is unchanged" : "does not list it"));
    }
  }
  at::NoGradGuard no_grad;
  if (!m.is_delta()) {
    std::vector<NamedTensor> held;
    held.reserve(m.entries.size());
    for (const ManifestEntry& e : m.entries) {
      const auto it = by_name.find(e.name);
      if (it == by_name.end())
        detail::delta_fail(where, m.version, ::fsdpx::detail::str("tensor '", e.name, "' never arrived"));
      const at::Tensor& t = rest[it->second].tensor;
      if (t.scalar_type() != e.dtype || t.sizes().vec() != e.shape) {
        detail::delta_fail(where, m.version,
                           ::fsdpx::detail::str("tensor '", e.name, "' arrived as ", t.scalar_type(), " ", t.sizes(),
                                                ", its manifest says ", e.dtype, " ", c10::IntArrayRef(e.shape)));
      }
      if (tensor_crc32c(t) != e.crc) {
        detail::delta_fail(where, m.version,
                           ::fsdpx::detail::str("tensor '", e.name,
                                                "' does not match its checksum "
                                                "(CRC-32C): it was corrupted on the way or made wrongly"));
      }
      held.push_back({e.name, t.contiguous()});
    }
    tensors_ = std::move(held);
    manifest_ = std::move(m);
    return;
  }
  if (!manifest_ || !holds(m.base_version, m.base_digest)) {
    detail::delta_fail(
        where, m.version,
        ::fsdpx::detail::str(
            "it is a delta from version ", m.base_version, " (digest ", m.base_digest, ") but this receiver holds ",
            manifest_ ? ::fsdpx::detail::str("version ", manifest_->version, " (digest ", manifest_->digest, ")")
                      : std::string("no version"),
            ": nothing was applied; the next fetch asks for a full version"));
  }
  const Manifest& base = *manifest_;
  if (base.entries.size() != m.entries.size()) {
    detail::delta_fail(
        where, m.version,
        ::fsdpx::detail::str("its delta lists ", m.entries.size(), " tensors, its base ", base.entries.size()));
  }
  for (size_t i = 0; i < m.entries.size(); ++i) {
    const ManifestEntry& e = m.entries[i];
    const ManifestEntry& b = base.entries[i];
    if (e.name != b.name || e.dtype != b.dtype || e.shape != b.shape) {
      detail::delta_fail(where, m.version,
                         ::fsdpx::detail::str("tensor '", e.name, "' (", e.dtype, " ", c10::IntArrayRef(e.shape),
                                              ") is not tensor '", b.name, "' of its base at the same place"));
    }
    if (e.encoding == DeltaEncoding::unchanged && e.crc != b.crc) {
      detail::delta_fail(where, m.version,
                         ::fsdpx::detail::str("tensor '", e.name,
                                              "' is unchanged, but its checksum "
                                              "differs from its base's"));
    }
    if (e.encoding != DeltaEncoding::unchanged && !by_name.contains(e.name)) {
      detail::delta_fail(where, m.version,
                         ::fsdpx::detail::str("tensor '", e.name, "' (", to_string(e.encoding), ") never arrived"));
    }
  }
  std::vector<NamedTensor> next = tensors_;
  std::vector<detail::Undo> undo;
  std::vector<std::pair<at::Tensor, at::Tensor>> deferred;  // in place: (held, sent whole), copied last
  const auto roll_back = [&] {
    for (auto u = undo.rbegin(); u != undo.rend(); ++u) {
      at::Tensor held = tensors_[u->index].tensor;
      at::Tensor bits = held.view({-1}).view(detail::bits_dtype(held.scalar_type()));
      switch (u->encoding) {
        case DeltaEncoding::sparse: bits.index_copy_(0, u->indices, u->saved); break;
        case DeltaEncoding::full: held.copy_(u->saved); break;
        default: bits.bitwise_xor_(u->saved.to(held.device()).view(bits.scalar_type()));
      }
    }
  };
  try {
    for (size_t i = 0; i < m.entries.size(); ++i) {
      const ManifestEntry& e = m.entries[i];
      if (e.encoding == DeltaEncoding::unchanged) continue;
      const at::Tensor& payload = rest[by_name.at(e.name)].tensor;
      const auto bad = [&](const std::string& why) {
        detail::delta_fail(where, m.version,
                           ::fsdpx::detail::str("tensor '", e.name, "' (", to_string(e.encoding), "): ", why));
      };
      const bool whole = e.encoding == DeltaEncoding::full;
      if (whole && (payload.scalar_type() != e.dtype || payload.sizes().vec() != e.shape)) {
        bad(::fsdpx::detail::str("arrived as ", payload.scalar_type(), " ", payload.sizes()));
      }
      // A tensor sent whole is taken as it came unless it must land in the held tensor's memory.
      at::Tensor target = whole && mode != Apply::in_place ? payload.contiguous()
                          : mode == Apply::copy_on_write   ? tensors_[i].tensor.clone()
                                                           : tensors_[i].tensor;
      const int64_t esize = static_cast<int64_t>(c10::elementSize(e.dtype));
      const int64_t numel = e.numel();
      const at::ScalarType bits_type = detail::bits_dtype(e.dtype);
      at::Tensor flat_bits = target.view({-1}).view(bits_type);
      if (whole) {
        if (payload.scalar_type() != e.dtype || payload.sizes().vec() != e.shape) {
          bad(::fsdpx::detail::str("arrived as ", payload.scalar_type(), " ", payload.sizes()));
        }
        if (mode == Apply::in_place) {
          // Checked as it came (it is the final value), copied in once every other tensor checked out:
          // nothing to undo, no copy of the old one.
          if (tensor_crc32c(payload) != e.crc) {
            bad("it does not match its checksum (CRC-32C): it was corrupted on the way or made wrongly");
          }
          deferred.emplace_back(target, payload);
          continue;
        }
      } else {
        if (payload.scalar_type() != at::kByte || payload.dim() != 1) bad("its payload is not 1-D uint8");
        const at::Tensor bytes = detail::host_contiguous(payload);
        if (e.encoding == DeltaEncoding::sparse) {
          int64_t expected = 0;
          if (__builtin_mul_overflow(e.changed, e.index_bytes + esize, &expected) || bytes.numel() != expected) {
            bad(::fsdpx::detail::str(bytes.numel(), " bytes where ", e.changed, " changes take ", expected));
          }
          const uint8_t* p = detail::bytes_of(bytes);
          at::Tensor indices = at::empty({e.changed}, at::kLong);
          int64_t* ip = indices.mutable_data_ptr<int64_t>();
          int64_t previous = -1;
          const auto parse = [&]<int W>() {
            for (int64_t k = 0; k < e.changed; ++k) {
              uint64_t idx = 0;
              std::memcpy(&idx, p + k * W, W);
              if (idx >= static_cast<uint64_t>(numel)) {
                bad(::fsdpx::detail::str("index ", idx, " lies outside its ", numel, " elements"));
              }
              if (static_cast<int64_t>(idx) <= previous) {
                bad(::fsdpx::detail::str("indices do not ascend (", idx, " after ", previous, ")"));
              }
              previous = static_cast<int64_t>(idx);
              ip[k] = previous;
            }
          };
          if (e.index_bytes == 4) {
            parse.template operator()<4>();
          } else {
            parse.template operator()<8>();
          }
          const at::Tensor values = bytes.narrow(0, e.changed * e.index_bytes, e.changed * esize).view(bits_type);
          if (target.is_cpu()) {
            // On the host: one loop keeps the old values (for the undo) and writes the new ones.
            at::Tensor old = mode != Apply::copy_on_write ? at::empty({e.changed}, bits_type) : at::Tensor();
            uint8_t* dst = static_cast<uint8_t*>(target.data_ptr());
            const uint8_t* src = detail::bytes_of(values);
            uint8_t* keep = old.defined() ? static_cast<uint8_t*>(old.data_ptr()) : nullptr;
            detail::with_widths(esize, 8, [&]<int E, int W>() {
              for (int64_t k = 0; k < e.changed; ++k) {
                if (keep) std::memcpy(keep + k * E, dst + ip[k] * E, E);
                std::memcpy(dst + ip[k] * E, src + k * E, E);
              }
            });
            if (old.defined()) undo.push_back({i, std::move(old), indices, e.encoding});
          } else {
            const at::Tensor on_device = indices.to(target.device());
            if (mode != Apply::copy_on_write)
              undo.push_back({i, flat_bits.index_select(0, on_device), on_device, e.encoding});
            flat_bits.index_copy_(0, on_device, values.to(target.device()));
          }
        } else {
          at::Tensor inflated = at::empty({numel * esize}, at::kByte);
          if (std::string why = detail::inflate_exactly(detail::bytes_of(bytes), bytes.numel(),
                                                        inflated.mutable_data_ptr<uint8_t>(), numel * esize);
              !why.empty()) {
            bad(why);
          }
          flat_bits.bitwise_xor_(inflated.view(bits_type).to(target.device()));
          if (mode != Apply::copy_on_write) undo.push_back({i, std::move(inflated), {}, e.encoding});
        }
      }
      if (tensor_crc32c(target) != e.crc) {
        bad("the result does not match its checksum (CRC-32C): the delta was corrupted, or this receiver's copy of "
            "the base was changed since it arrived");
      }
      next[i].tensor = target;
    }
    for (auto& [held, whole] : deferred) held.copy_(whole);
  } catch (...) {
    roll_back();
    throw;
  }
  tensors_ = std::move(next);
  manifest_ = std::move(m);
}

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
                 manifest.digest, "): ", TensorCollector::join(problems));
}

FSDPX_DECL void verify(torch::nn::Module& module, const Manifest& manifest) {
  // Each parameter or buffer once, under the name the version lists it by (a tied one has several).
  std::vector<NamedTensor> tensors;
  std::unordered_map<const c10::TensorImpl*, size_t> seen;
  const auto add = [&](const std::string& name, const at::Tensor& t) {
    if (!t.defined()) return;
    const auto [it, fresh] = seen.emplace(t.unsafeGetTensorImpl(), tensors.size());
    if (fresh) {
      tensors.push_back({name, t});
    } else if (manifest.find(name) && !manifest.find(tensors[it->second].name)) {
      tensors[it->second].name = name;
    }
  };
  for (const auto& item : module.named_parameters(/*recurse=*/true)) add(item.key(), item.value());
  for (const auto& item : module.named_buffers(/*recurse=*/true)) add(item.key(), item.value());
  verify(tensors, manifest);
}

namespace detail {

/// The module's parameters and buffers by name, detached (aliases of their memory).
inline std::unordered_map<std::string, at::Tensor> module_tensors(torch::nn::Module& module) {
  std::unordered_map<std::string, at::Tensor> by_name;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) by_name.emplace(item.key(), item.value().detach());
  for (const auto& item : module.named_buffers(/*recurse=*/true)) {
    if (item.value().defined()) by_name.emplace(item.key(), item.value().detach());
  }
  return by_name;
}

FSDPX_DECL void HeldVersion::prepare(torch::nn::Module* module) {
  if (target_ != module || (module != nullptr && !still_adopted(*module))) forget();
}

FSDPX_DECL std::pair<std::vector<NamedTensor>, std::shared_ptr<const Manifest>> HeldVersion::take(
    std::vector<NamedTensor> received, std::string_view where) {
  prepare(nullptr);
  try {
    store_.accept(std::move(received), VersionStore::Apply::copy_on_write, where);
  } catch (const SyncError&) {
    forget();
    throw;
  }
  return {store_.tensors(), std::make_shared<const Manifest>(store_.manifest())};
}

FSDPX_DECL void HeldVersion::take_into(torch::nn::Module& module, std::vector<NamedTensor> received,
                                       std::string_view where) {
  prepare(&module);
  try {
    FSDPX_CHECK_AS(SyncError, !received.empty(), "an empty version from ", where, " (no manifest)");
    if (Manifest::decode(received.front().tensor, where).is_delta()) {
      store_.accept(std::move(received), VersionStore::Apply::in_place, where);  // into the module's tensors
      note_writes();
      return;
    }
    forget();
    VersionStore staged;  // checked whole, and against the module, before anything is loaded
    staged.accept(std::move(received), VersionStore::Apply::copy_on_write, where);
    check_loadable(module, staged.tensors());
    load_into(module, staged.tensors());
    adopt(module, staged.manifest());
  } catch (const SyncError&) {
    forget();
    throw;
  }
}

FSDPX_DECL void HeldVersion::loaded_into(torch::nn::Module& module, const Manifest& manifest) {
  forget();
  adopt(module, manifest);
}

FSDPX_DECL void HeldVersion::taken(const Manifest& manifest) {
  forget();
  last_manifest_ = std::make_shared<const Manifest>(manifest);
}

FSDPX_DECL void HeldVersion::forget() {
  if (!store_.empty()) last_manifest_ = std::make_shared<const Manifest>(store_.manifest());
  store_.clear();
  target_ = nullptr;
  counters_.clear();
}

FSDPX_DECL std::shared_ptr<const Manifest> HeldVersion::last_manifest() const {
  return store_.empty() ? last_manifest_ : std::make_shared<const Manifest>(store_.manifest());
}

FSDPX_DECL void HeldVersion::verify(torch::nn::Module& module) const {
  const auto m = last_manifest();
  FSDPX_CHECK_AS(SyncError, m != nullptr, "nothing to verify against: no version was received yet");
  ::fsdpx::sync::verify(module, *m);
}

FSDPX_DECL void HeldVersion::verify(const std::vector<NamedTensor>& tensors) const {
  const auto m = last_manifest();
  FSDPX_CHECK_AS(SyncError, m != nullptr, "nothing to verify against: no version was received yet");
  ::fsdpx::sync::verify(tensors, *m);
}

FSDPX_DECL void HeldVersion::adopt(torch::nn::Module& module, const Manifest& manifest) {
  last_manifest_ = std::make_shared<const Manifest>(manifest);
  const auto by_name = module_tensors(module);
  std::vector<NamedTensor> aliases;
  std::vector<std::pair<uintptr_t, uintptr_t>> spans;  // a delta must never land twice in one place
  for (const ManifestEntry& e : manifest.entries) {
    const auto it = by_name.find(e.name);
    if (it == by_name.end() || it->second.scalar_type() != e.dtype || !it->second.is_contiguous()) return;
    const auto begin = reinterpret_cast<uintptr_t>(it->second.const_data_ptr());
    spans.emplace_back(begin, begin + it->second.nbytes());
    aliases.push_back({e.name, it->second});
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i) {
    if (spans[i].first < spans[i - 1].second) return;  // one tensor sent under two names (a tied one): full versions
  }
  store_.adopt(std::move(aliases), manifest);
  target_ = &module;
  note_writes();
}

FSDPX_DECL void HeldVersion::note_writes() {
  counters_.clear();
  for (const NamedTensor& held : store_.tensors()) counters_.push_back(static_cast<int64_t>(held.tensor._version()));
}

FSDPX_DECL bool HeldVersion::still_adopted(torch::nn::Module& module) const {
  if (store_.empty() || counters_.size() != store_.tensors().size()) return false;
  const auto by_name = module_tensors(module);
  for (size_t i = 0; i < store_.tensors().size(); ++i) {
    const NamedTensor& held = store_.tensors()[i];
    const auto it = by_name.find(held.name);
    if (it == by_name.end() || it->second.const_data_ptr() != held.tensor.const_data_ptr() ||
        it->second.scalar_type() != held.tensor.scalar_type() || it->second.sizes() != held.tensor.sizes() ||
        !it->second.is_contiguous() || static_cast<int64_t>(it->second._version()) != counters_[i]) {
      return false;
    }
  }
  return true;
}

FSDPX_DECL void HeldVersion::check_loadable(torch::nn::Module& module, const std::vector<NamedTensor>& tensors) {
  const auto by_name = module_tensors(module);
  std::unordered_set<const void*> filled;  // by memory: a tied parameter is filled under either name
  std::vector<std::string> problems;
  for (const NamedTensor& t : tensors) {
    const auto it = by_name.find(t.name);
    if (it == by_name.end()) {
      problems.push_back(::fsdpx::detail::str("'", t.name, "' is not a parameter or buffer of the module"));
    } else if (it->second.sizes() != t.tensor.sizes()) {
      problems.push_back(::fsdpx::detail::str("'", t.name, "' has shape ", it->second.sizes(), " in the module but ",
                                              t.tensor.sizes(), " was sent"));
    } else {
      filled.insert(it->second.const_data_ptr());
    }
  }
  for (const auto& [name, t] : by_name) {
    if (t.numel() > 0 && !filled.contains(t.const_data_ptr())) {
      problems.push_back(::fsdpx::detail::str("'", name, "' was not sent"));
    }
  }
  std::sort(problems.begin(), problems.end());
  FSDPX_CHECK_AS(SyncError, problems.empty(),
                 "the received weights do not match the module (nothing was "
                 "loaded): ",
                 TensorCollector::join(problems));
}

}  // namespace detail

}  // namespace fsdpx::sync

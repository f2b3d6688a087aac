// The byte kernels of delta versions: which elements of two tensors differ (compared as bits, in
// parallel), their sparse payload, the XOR of two buffers, and zlib (RFC 1950) in pieces its 32-bit
// counters can take. Internals of sync/impl/version_store.ipp, manifest.ipp and held_version.ipp; no user
// includes this.
#pragma once

#if defined(FSDPX_WITH_ZLIB)
#include <zlib.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <fsdpx/error.hpp>

namespace fsdpx::sync::detail {

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

}  // namespace fsdpx::sync::detail

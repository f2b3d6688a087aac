// Out-of-line functions of fsdpx/sync/detail/bucket.hpp: included by it (header-only) or by fsdpx/impl/src.hpp
// (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <fsdpx/sync/detail/bucket.hpp>

#include <cstring>

namespace fsdpx::sync::detail {

FSDPX_DECL std::vector<BucketLayout> plan_buckets(const std::vector<TensorSpec>& specs, int64_t capacity,
                                                  int64_t version) {
  FSDPX_CHECK(capacity >= 4096, "weight sync: a bucket must hold at least 4096 bytes, got ", capacity);
  std::vector<BucketLayout> buckets;
  BucketLayout cur;
  int64_t header_raw = prefix_bytes;
  int64_t payload = 0;  // aligned payload bytes so far
  const auto close = [&] {
    int64_t offset = align_up(header_raw);
    cur.header_bytes = offset;
    for (auto& e : cur.entries) {
      e.byte_offset = offset;
      offset += align_up(e.nbytes());
    }
    cur.total_bytes = offset;
    buckets.push_back(std::move(cur));
    cur = BucketLayout{};
    header_raw = prefix_bytes;
    payload = 0;
  };
  // A chunk smaller than this starts a new bucket instead (avoids slivers of large tensors).
  const int64_t min_chunk_bytes = std::min<int64_t>(capacity / 16, 1 << 20);
  for (const TensorSpec& s : specs) {
    FSDPX_CHECK(s.shape.size() <= static_cast<size_t>(max_ndim), "weight sync: tensor '", s.name, "' has ",
                s.shape.size(), " dimensions; at most ", max_ndim, " can travel");
    FSDPX_CHECK(s.name.size() < 65536, "weight sync: a tensor name is longer than 65535 bytes");
    dtype_code(s.dtype);  // checks the dtype can travel
    const int64_t esize = static_cast<int64_t>(c10::elementSize(s.dtype));
    const int64_t entry = entry_header_bytes(s.name, s.shape.size());
    FSDPX_CHECK(align_up(prefix_bytes + entry) + alignment <= capacity, "weight sync: tensor '", s.name,
                "' cannot fit a bucket of ", capacity, " bytes even as one element; raise bucket_bytes");
    const int64_t total = c10::multiply_integers(s.shape);
    FSDPX_CHECK(std::is_sorted(s.breaks.begin(), s.breaks.end()) &&
                    (s.breaks.empty() || (s.breaks.front() >= 0 && s.breaks.back() <= total)),
                "weight sync: the chunk breaks of '", s.name, "' must ascend within its ", total, " elements");
    int64_t done = 0;
    auto next_break = s.breaks.begin();
    while (true) {
      while (next_break != s.breaks.end() && *next_break <= done) ++next_break;
      const int64_t limit = next_break == s.breaks.end() ? total : *next_break;  // this chunk ends by here
      const int64_t free_bytes = capacity - align_up(header_raw + entry) - payload;
      // Room for the rest, or for a chunk worth sending (one element in an empty bucket; none for an
      // empty tensor, which still travels as an entry so the receiver learns its shape).
      int64_t need = total == 0 ? 0 : std::max(esize, std::min((limit - done) * esize, min_chunk_bytes));
      if (cur.entries.empty()) need = std::min(need, esize);
      if (free_bytes < need) {
        FSDPX_CHECK(!cur.entries.empty(), "weight sync: internal error planning buckets for '", s.name, "'");
        close();
        continue;
      }
      int64_t n = std::min(limit - done, free_bytes / esize);
      if (n < limit - done) {
        // A split lands on an aligned element, so that a chunk sent or received in place starts as
        // aligned as its tensor (a copy between misaligned addresses is far slower). An empty bucket
        // holds at least `alignment` bytes (checked above), so only a started one can be too full.
        n -= (done + n) % std::max<int64_t>(1, alignment / esize);
        if (n <= 0) {
          FSDPX_CHECK(!cur.entries.empty(), "weight sync: internal error splitting '", s.name, "'");
          close();
          continue;
        }
      }
      cur.entries.push_back({s.name, s.dtype, s.shape, done, n, 0});
      header_raw += entry;
      payload += align_up(n * esize);
      done += n;
      if (done >= total) break;
    }
  }
  if (!cur.entries.empty()) close();
  for (size_t i = 0; i < buckets.size(); ++i) {
    buckets[i].version = version;
    buckets[i].index = static_cast<uint32_t>(i);
    buckets[i].count = static_cast<uint32_t>(buckets.size());
    buckets[i].last = i + 1 == buckets.size();
  }
  return buckets;
}

FSDPX_DECL std::vector<uint8_t> encode_header(const BucketLayout& b) {
  std::vector<uint8_t> out;
  out.reserve(static_cast<size_t>(b.header_bytes));
  Writer w(out);
  w.put<uint32_t>(bucket_magic);
  w.put<uint16_t>(bucket_format);
  w.put<uint16_t>(b.last ? 1 : 0);
  w.put<uint32_t>(static_cast<uint32_t>(b.entries.size()));
  w.put<uint32_t>(static_cast<uint32_t>(b.header_bytes));
  w.put<uint64_t>(static_cast<uint64_t>(b.total_bytes));
  w.put<int64_t>(b.version);
  w.put<uint32_t>(b.index);
  w.put<uint32_t>(b.count);
  for (const BucketEntry& e : b.entries) {
    w.put<uint16_t>(static_cast<uint16_t>(e.name.size()));
    w.put_bytes(e.name);
    w.put<uint8_t>(dtype_code(e.dtype));
    w.put<uint8_t>(static_cast<uint8_t>(e.shape.size()));
    for (const int64_t d : e.shape) w.put<int64_t>(d);
    w.put<int64_t>(e.element_offset);
    w.put<int64_t>(e.numel);
    w.put<uint64_t>(static_cast<uint64_t>(e.byte_offset));
  }
  FSDPX_CHECK(static_cast<int64_t>(out.size()) <= b.header_bytes, "weight sync: internal error: header of ", out.size(),
              " bytes exceeds its planned ", b.header_bytes);
  out.resize(static_cast<size_t>(b.header_bytes), 0);
  return out;
}

FSDPX_DECL BucketLayout decode_header(const uint8_t* data, int64_t available, std::string_view where,
                                      std::optional<std::chrono::steady_clock::time_point> deadline) {
  Reader r(data, available, where);
  if (r.get<uint32_t>("the magic number") != bucket_magic) r.fail("bad magic number (not a weight bucket)");
  if (const auto f = r.get<uint16_t>("the format"); f != bucket_format) {
    r.fail(::fsdpx::detail::str("format ", f, ", this build reads format ", bucket_format));
  }
  BucketLayout b;
  b.last = (r.get<uint16_t>("the flags") & 1) != 0;
  const auto n = r.get<uint32_t>("the entry count");
  b.header_bytes = r.get<uint32_t>("the header size");
  b.total_bytes = static_cast<int64_t>(r.get<uint64_t>("the total size"));
  b.version = r.get<int64_t>("the version");
  b.index = r.get<uint32_t>("the bucket index");
  b.count = r.get<uint32_t>("the bucket count");
  if (b.header_bytes > available || b.header_bytes < prefix_bytes || b.total_bytes < b.header_bytes) {
    r.fail(::fsdpx::detail::str("header size ", b.header_bytes, " / total size ", b.total_bytes, " inconsistent with ",
                                available, " bytes available"));
  }
  if (b.index >= b.count) r.fail(::fsdpx::detail::str("bucket index ", b.index, " of ", b.count));
  Reader body(data, b.header_bytes, where);
  body.get_string(prefix_bytes, "the prefix");
  // An entry takes at least its fixed fields: a count the header cannot hold is refused before anything
  // is reserved for it.
  if (n > (b.header_bytes - prefix_bytes) / min_entry_bytes) {
    r.fail(::fsdpx::detail::str(n, " entries cannot fit in a header of ", b.header_bytes, " bytes"));
  }
  // The payload at hand, not the total the header claims: a header cannot buy itself room by lying.
  const int64_t payload = std::min(b.total_bytes, available) - b.header_bytes;
  if (std::string problem = bookkeeping_problem(static_cast<int64_t>(n) * parsed_entry_bytes, payload,
                                                header_bookkeeping_floor, ::fsdpx::detail::str("its ", n, " entries"));
      !problem.empty()) {
    r.fail(problem);
  }
  b.entries.reserve(n);
  for (uint32_t i = 0; i < n; ++i) {
    if (deadline && i % 4096 == 4095 && std::chrono::steady_clock::now() >= *deadline) {
      throw SyncError(::fsdpx::detail::str("fsdpx: weight bucket (", where,
                                           "): did not finish within the fetch's wait (the deadline passed while its ",
                                           n, "-entry header was parsed, ", i, " entries read)"));
    }
    BucketEntry e;
    const auto len = body.get<uint16_t>("an entry's name length");
    e.name = body.get_string(len, "an entry's name");
    const auto code = body.get<uint8_t>("an entry's dtype");
    const auto dtype = dtype_from_code(code);
    if (!dtype) body.fail(::fsdpx::detail::str("entry '", e.name, "' has unknown dtype code ", int(code)));
    e.dtype = *dtype;
    const auto ndim = body.get<uint8_t>("an entry's rank");
    if (ndim > max_ndim) body.fail(::fsdpx::detail::str("entry '", e.name, "' has ", int(ndim), " dimensions"));
    for (int d = 0; d < ndim; ++d) {
      e.shape.push_back(body.get<int64_t>("an entry's shape"));
      if (e.shape.back() < 0) body.fail(::fsdpx::detail::str("entry '", e.name, "' has a negative dimension"));
    }
    e.element_offset = body.get<int64_t>("an entry's element offset");
    e.numel = body.get<int64_t>("an entry's element count");
    const uint64_t byte_offset = body.get<uint64_t>("an entry's byte offset");
    const int64_t esize = static_cast<int64_t>(c10::elementSize(e.dtype));
    // Every product and sum is checked for overflow first: the values come from the network.
    int64_t tensor_numel = 1;
    for (const int64_t d : e.shape) {
      if (__builtin_mul_overflow(tensor_numel, d, &tensor_numel)) tensor_numel = -1;
      if (tensor_numel < 0) break;
    }
    int64_t tensor_bytes = 0, chunk_bytes = 0, chunk_end = 0, end_byte = 0;
    if (tensor_numel < 0 || __builtin_mul_overflow(tensor_numel, esize, &tensor_bytes) || e.numel < 0 ||
        e.element_offset < 0 || __builtin_add_overflow(e.element_offset, e.numel, &chunk_end) ||
        __builtin_mul_overflow(e.numel, esize, &chunk_bytes) || byte_offset > static_cast<uint64_t>(b.total_bytes)) {
      body.fail(::fsdpx::detail::str("entry '", e.name, "' has sizes that overflow (shape of ", e.shape.size(),
                                     " dimensions, elements ", e.element_offset, "+", e.numel, ", byte ", byte_offset,
                                     ")"));
    }
    e.byte_offset = static_cast<int64_t>(byte_offset);
    if (chunk_end > tensor_numel || e.byte_offset < b.header_bytes || e.byte_offset % esize != 0 ||
        __builtin_add_overflow(e.byte_offset, chunk_bytes, &end_byte) || end_byte > b.total_bytes) {
      body.fail(::fsdpx::detail::str("entry '", e.name, "' (elements ", e.element_offset, "+", e.numel, " of ",
                                     e.tensor_numel(), " at byte ", e.byte_offset, ") lies outside the bucket of ",
                                     b.total_bytes, " bytes"));
    }
    b.entries.push_back(std::move(e));
  }
  return b;
}

FSDPX_DECL void pack_entry(const at::Tensor& bucket, const BucketEntry& e, const at::Tensor& source) {
  if (e.numel == 0) return;
  if (bucket.is_cpu() && bucket.is_contiguous() && source.is_cpu() && source.is_contiguous() &&
      source.scalar_type() == e.dtype) {
    // A host tensor of the wire's dtype: its bytes as they lie (no tensor operations per entry).
    std::memcpy(bucket.data_ptr<uint8_t>() + e.byte_offset,
                static_cast<const uint8_t*>(source.const_data_ptr()) + e.element_offset * source.element_size(),
                static_cast<size_t>(e.nbytes()));
    return;
  }
  entry_view(bucket, e).copy_(source.detach().reshape({-1}).narrow(0, e.element_offset, e.numel));
}

FSDPX_DECL void write_header(const at::Tensor& bucket, const BucketLayout& b) {
  auto bytes = encode_header(b);
  const auto host = at::from_blob(bytes.data(), {static_cast<int64_t>(bytes.size())}, at::kByte);
  bucket.narrow(0, 0, b.header_bytes).copy_(host);
}

FSDPX_DECL std::vector<at::Tensor> pack_buckets(const std::vector<NamedTensor>& tensors, int64_t capacity,
                                                int64_t version, std::vector<BucketLayout>* layouts) {
  std::vector<TensorSpec> specs;
  specs.reserve(tensors.size());
  for (const auto& t : tensors) specs.push_back({t.name, t.tensor.sizes().vec(), t.tensor.scalar_type()});
  auto plan = plan_buckets(specs, capacity, version);
  std::vector<at::Tensor> out;
  size_t next = 0;
  for (const BucketLayout& b : plan) {
    auto bucket = at::empty({b.total_bytes}, at::TensorOptions().dtype(at::kByte));
    write_header(bucket, b);
    for (const auto& e : b.entries) {
      while (tensors[next].name != e.name) ++next;  // entries follow the tensors' order
      pack_entry(bucket, e, tensors[next].tensor.to(at::kCPU));
    }
    out.push_back(std::move(bucket));
  }
  if (layouts) *layouts = std::move(plan);
  return out;
}

}  // namespace fsdpx::sync::detail

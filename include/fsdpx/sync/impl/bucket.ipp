// Out-of-line functions of fsdpx/sync/bucket.hpp: included by it (header-only) or by fsdpx/impl/src.hpp
// (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <fsdpx/sync/bucket.hpp>

namespace fsdpx::sync::detail {

FSDPX_DECL uint8_t dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return 1;
    case at::kDouble: return 2;
    case at::kBFloat16: return 3;
    case at::kHalf: return 4;
    case at::kChar: return 5;
    case at::kByte: return 6;
    case at::kInt: return 7;
    case at::kLong: return 8;
    case at::kBool: return 9;
    default: break;
  }
  FSDPX_FAIL(ConfigError, "weight sync cannot send tensors of dtype ", t,
             " (float32, float64, bfloat16, float16, int8, uint8, int32, int64 and bool can travel)");
}

FSDPX_DECL std::optional<at::ScalarType> dtype_from_code(uint8_t code) {
  static constexpr at::ScalarType types[] = {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf, at::kChar,
                                             at::kByte,  at::kInt,    at::kLong,     at::kBool};
  if (code < 1 || code > 9) return std::nullopt;
  return types[code - 1];
}

FSDPX_DECL std::string Coverage::add(int64_t begin, int64_t n, int64_t numel) {
  int64_t end = 0;
  if (begin < 0 || n < 0 || __builtin_add_overflow(begin, n, &end) || end > numel) {
    return ::fsdpx::detail::str("elements [", begin, ", ", begin, "+", n, ") lie outside its ", numel, " elements");
  }
  if (n == 0) {
    // plan_buckets sends an empty chunk only for an empty tensor, once (so its shape travels).
    if (numel != 0)
      return ::fsdpx::detail::str("an empty chunk at element ", begin, " of a tensor of ", numel, " elements");
    if (empty_seen_) return "the empty tensor arrived twice";
    empty_seen_ = true;
    return {};
  }
  auto next = ranges_.lower_bound(begin);  // the first range starting at or after `begin`
  const auto overlap = [&](int64_t b, int64_t e) {
    return ::fsdpx::detail::str("elements [", std::max(begin, b), ", ", std::min(end, e), ") arrived twice (a chunk [",
                                begin, ", ", end, ") overlaps elements already received)");
  };
  if (next != ranges_.end() && next->first < end) return overlap(next->first, next->second);
  auto prev = next == ranges_.begin() ? ranges_.end() : std::prev(next);
  if (prev != ranges_.end() && prev->second > begin) return overlap(prev->first, prev->second);
  // Merge with the neighbours it touches, so in-order chunks keep one range.
  int64_t new_end = end;
  if (next != ranges_.end() && next->first == end) {
    new_end = next->second;
    ranges_.erase(next);
  }
  if (prev != ranges_.end() && prev->second == begin) {
    prev->second = new_end;
  } else {
    ranges_.emplace(begin, new_end);
  }
  covered_ += n;
  return {};
}

FSDPX_DECL std::string Coverage::gap(int64_t numel) const {
  if (numel == 0) return empty_seen_ ? std::string() : "it never arrived";
  if (covered_ == numel) return {};
  int64_t at = 0;  // the first element not covered
  int64_t until = numel;
  for (const auto& [b, e] : ranges_) {
    if (b > at) {
      until = b;
      break;
    }
    at = e;
  }
  return ::fsdpx::detail::str(covered_, " of ", numel, " elements arrived; elements [", at, ", ", until, ") never did");
}

FSDPX_DECL std::string VersionCoverage::add(const BucketEntry& e, uint32_t bucket) {
  auto it = index_.find(e.name);
  if (it == index_.end()) {
    it = index_.emplace(e.name, tensors_.size()).first;
    tensors_.push_back({e.name, e.dtype, e.shape, e.tensor_numel(), {}});
    // A name, a shape and a map node per tensor: a version of many tiny tensors is not free.
    bookkeeping_ += detail::tensor_bookkeeping_bytes + 2 * static_cast<int64_t>(e.name.size()) +
                    8 * static_cast<int64_t>(e.shape.size());
  }
  Tensor& t = tensors_[it->second];
  if (t.dtype != e.dtype || t.shape != e.shape) {
    return ::fsdpx::detail::str("tensor '", e.name, "' arrived with two shapes or dtypes (", c10::IntArrayRef(t.shape),
                                " ", t.dtype, ", then ", c10::IntArrayRef(e.shape), " ", e.dtype, " in bucket ", bucket,
                                ")");
  }
  const size_t ranges = t.coverage.ranges();
  if (std::string problem = t.coverage.add(e.element_offset, e.numel, t.numel); !problem.empty()) {
    return ::fsdpx::detail::str("tensor '", e.name, "': ", problem, " (bucket ", bucket, ")");
  }
  bookkeeping_ +=
      detail::range_bookkeeping_bytes * (static_cast<int64_t>(t.coverage.ranges()) - static_cast<int64_t>(ranges));
  return {};
}

FSDPX_DECL std::string VersionCoverage::missing() const {
  std::vector<std::string> problems;
  for (const Tensor& t : tensors_) {
    if (std::string gap = t.coverage.gap(t.numel); !gap.empty()) {
      problems.push_back(::fsdpx::detail::str("tensor '", t.name, "': ", gap));
    }
  }
  if (problems.empty()) return {};
  return ::fsdpx::detail::str(problems.size(), " tensor(s) did not arrive whole: ", TensorCollector::join(problems));
}

}  // namespace fsdpx::sync::detail

namespace fsdpx::sync {

FSDPX_DECL std::vector<BucketLayout> plan_buckets(const std::vector<TensorSpec>& specs, int64_t capacity,
                                                  int64_t version) {
  FSDPX_CHECK(capacity >= 4096, "weight sync: a bucket must hold at least 4096 bytes, got ", capacity);
  std::vector<BucketLayout> buckets;
  BucketLayout cur;
  int64_t header_raw = detail::prefix_bytes;
  int64_t payload = 0;  // aligned payload bytes so far
  const auto close = [&] {
    int64_t offset = detail::align_up(header_raw);
    cur.header_bytes = offset;
    for (auto& e : cur.entries) {
      e.byte_offset = offset;
      offset += detail::align_up(e.nbytes());
    }
    cur.total_bytes = offset;
    buckets.push_back(std::move(cur));
    cur = BucketLayout{};
    header_raw = detail::prefix_bytes;
    payload = 0;
  };
  // A chunk smaller than this starts a new bucket instead (avoids slivers of large tensors).
  const int64_t min_chunk_bytes = std::min<int64_t>(capacity / 16, 1 << 20);
  for (const TensorSpec& s : specs) {
    FSDPX_CHECK(s.shape.size() <= static_cast<size_t>(detail::max_ndim), "weight sync: tensor '", s.name, "' has ",
                s.shape.size(), " dimensions; at most ", detail::max_ndim, " can travel");
    FSDPX_CHECK(s.name.size() < 65536, "weight sync: a tensor name is longer than 65535 bytes");
    detail::dtype_code(s.dtype);  // checks the dtype can travel
    const int64_t esize = static_cast<int64_t>(c10::elementSize(s.dtype));
    const int64_t entry = detail::entry_header_bytes(s.name, s.shape.size());
    FSDPX_CHECK(detail::align_up(detail::prefix_bytes + entry) + detail::alignment <= capacity, "weight sync: tensor '",
                s.name, "' cannot fit a bucket of ", capacity, " bytes even as one element; raise bucket_bytes");
    const int64_t total = c10::multiply_integers(s.shape);
    FSDPX_CHECK(std::is_sorted(s.breaks.begin(), s.breaks.end()) &&
                    (s.breaks.empty() || (s.breaks.front() >= 0 && s.breaks.back() <= total)),
                "weight sync: the chunk breaks of '", s.name, "' must ascend within its ", total, " elements");
    int64_t done = 0;
    auto next_break = s.breaks.begin();
    while (true) {
      while (next_break != s.breaks.end() && *next_break <= done) ++next_break;
      const int64_t limit = next_break == s.breaks.end() ? total : *next_break;  // this chunk ends by here
      const int64_t free_bytes = capacity - detail::align_up(header_raw + entry) - payload;
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
        n -= (done + n) % std::max<int64_t>(1, detail::alignment / esize);
        if (n <= 0) {
          FSDPX_CHECK(!cur.entries.empty(), "weight sync: internal error splitting '", s.name, "'");
          close();
          continue;
        }
      }
      cur.entries.push_back({s.name, s.dtype, s.shape, done, n, 0});
      header_raw += entry;
      payload += detail::align_up(n * esize);
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
  detail::Writer w(out);
  w.put<uint32_t>(detail::bucket_magic);
  w.put<uint16_t>(detail::bucket_format);
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
    w.put<uint8_t>(detail::dtype_code(e.dtype));
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

FSDPX_DECL std::string detail::bookkeeping_problem(int64_t bookkeeping, int64_t arrived, int64_t floor,
                                                   std::string_view what) {
  if (bookkeeping - arrived <= floor) return {};  // both at most a few GiB: no overflow
  return ::fsdpx::detail::str(what, " would make this receiver hold ", bookkeeping, " bytes of bookkeeping for ",
                              arrived, " bytes that arrived (at most ", floor,
                              " more than the bytes): too many entries or tensors for their bytes");
}

FSDPX_DECL BucketLayout decode_header(const uint8_t* data, int64_t available, std::string_view where,
                                      std::optional<std::chrono::steady_clock::time_point> deadline) {
  detail::Reader r(data, available, where);
  if (r.get<uint32_t>("the magic number") != detail::bucket_magic) r.fail("bad magic number (not a weight bucket)");
  if (const auto f = r.get<uint16_t>("the format"); f != detail::bucket_format) {
    r.fail(::fsdpx::detail::str("format ", f, ", this build reads format ", detail::bucket_format));
  }
  BucketLayout b;
  b.last = (r.get<uint16_t>("the flags") & 1) != 0;
  const auto n = r.get<uint32_t>("the entry count");
  b.header_bytes = r.get<uint32_t>("the header size");
  b.total_bytes = static_cast<int64_t>(r.get<uint64_t>("the total size"));
  b.version = r.get<int64_t>("the version");
  b.index = r.get<uint32_t>("the bucket index");
  b.count = r.get<uint32_t>("the bucket count");
  if (b.header_bytes > available || b.header_bytes < detail::prefix_bytes || b.total_bytes < b.header_bytes) {
    r.fail(::fsdpx::detail::str("header size ", b.header_bytes, " / total size ", b.total_bytes, " inconsistent with ",
                                available, " bytes available"));
  }
  if (b.index >= b.count) r.fail(::fsdpx::detail::str("bucket index ", b.index, " of ", b.count));
  detail::Reader body(data, b.header_bytes, where);
  body.get_string(detail::prefix_bytes, "the prefix");
  // An entry takes at least its fixed fields: a count the header cannot hold is refused before anything
  // is reserved for it.
  constexpr int64_t min_entry_bytes = 2 + 1 + 1 + 3 * 8;
  if (n > (b.header_bytes - detail::prefix_bytes) / min_entry_bytes) {
    r.fail(::fsdpx::detail::str(n, " entries cannot fit in a header of ", b.header_bytes, " bytes"));
  }
  // The payload at hand, not the total the header claims: a header cannot buy itself room by lying.
  const int64_t payload = std::min(b.total_bytes, available) - b.header_bytes;
  if (std::string problem =
          detail::bookkeeping_problem(static_cast<int64_t>(n) * detail::parsed_entry_bytes, payload,
                                      detail::header_bookkeeping_floor, ::fsdpx::detail::str("its ", n, " entries"));
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
    const auto dtype = detail::dtype_from_code(code);
    if (!dtype) body.fail(::fsdpx::detail::str("entry '", e.name, "' has unknown dtype code ", int(code)));
    e.dtype = *dtype;
    const auto ndim = body.get<uint8_t>("an entry's rank");
    if (ndim > detail::max_ndim) body.fail(::fsdpx::detail::str("entry '", e.name, "' has ", int(ndim), " dimensions"));
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

FSDPX_DECL void load_into(torch::nn::Module& module, const std::vector<NamedTensor>& tensors) {
  ModuleLoader loader(module);
  for (const auto& t : tensors) {
    BucketEntry e{t.name, t.tensor.scalar_type(), t.tensor.sizes().vec(), 0, t.tensor.numel(), 0};
    loader.accept(e, t.tensor.reshape({-1}));
  }
  loader.finish();
}

FSDPX_DECL int64_t place_on_huge_pages(torch::nn::Module& module) {
  if (!memory::host_huge_pages()) return 0;
  at::NoGradGuard no_grad;
  int64_t moved = 0;
  for (auto& param : module.parameters(/*recurse=*/true)) {
    const int64_t bytes = param.numel() * static_cast<int64_t>(param.element_size());
    const bool whole_storage = param.storage_offset() == 0 && param.storage().nbytes() == static_cast<size_t>(bytes);
    if (!param.device().is_cpu() || param.is_pinned() || bytes < memory::huge_page_bytes ||
        memory::on_huge_page_boundary(param) || !whole_storage) {
      continue;
    }
    const at::Tensor home = memory::empty_host(param.numel(), param.scalar_type()).view(param.sizes());
    home.copy_(param.detach());
    param.set_data(home);  // the same Parameter (optimisers, tied names) now on the new storage
    moved += bytes;
  }
  return moved;
}

FSDPX_DECL bool TensorCollector::cover(size_t index, const BucketEntry& e) {
  const at::Tensor& t = tensors_[index].tensor;
  if (t.sizes().vec() != e.shape || t.scalar_type() != e.dtype) {
    problems_.push_back(::fsdpx::detail::str("'", e.name, "' arrived with two different shapes or dtypes"));
    return false;
  }
  detail::Coverage& c = received_[index];
  const size_t ranges = c.ranges();
  if (std::string problem = c.add(e.element_offset, e.numel, t.numel()); !problem.empty()) {
    problems_.push_back(::fsdpx::detail::str("'", e.name, "': ", problem));
    return false;
  }
  arrived_ += e.nbytes();
  // Chunks out of order cost a range each: counted, so that a sender cannot grow the bookkeeping freely.
  if (c.ranges() > ranges) {
    bookkeeping_ += detail::range_bookkeeping_bytes;
    const std::string problem =
        detail::bookkeeping_problem(bookkeeping_, arrived_, detail::version_bookkeeping_floor,
                                    ::fsdpx::detail::str("the chunks of '", e.name, "', so scattered,"));
    FSDPX_CHECK_AS(SyncError, problem.empty(), "received weights: ", problem);
  }
  return true;
}

FSDPX_DECL void TensorCollector::accept(const BucketEntry& e, const at::Tensor& chunk) {
  auto it = index_.find(e.name);
  if (it == index_.end()) it = add(e);
  if (!cover(it->second, e)) return;  // nothing is written twice
  if (e.numel > 0) tensors_[it->second].tensor.view({-1}).narrow(0, e.element_offset, e.numel).copy_(chunk);
}

FSDPX_DECL void TensorCollector::accepted(const BucketEntry& e) { cover(index_.at(e.name), e); }

FSDPX_DECL at::Tensor TensorCollector::destination(const BucketEntry& e) {
  auto it = index_.find(e.name);
  if (it == index_.end()) it = add(e);
  const at::Tensor& t = tensors_[it->second].tensor;
  if (t.sizes().vec() != e.shape || t.scalar_type() != e.dtype || e.numel == 0) return {};
  return t.view({-1}).narrow(0, e.element_offset, e.numel);
}

FSDPX_DECL std::vector<NamedTensor> TensorCollector::finish() {
  for (size_t i = 0; i < tensors_.size(); ++i) {
    if (std::string gap = received_[i].gap(tensors_[i].tensor.numel()); !gap.empty()) {
      problems_.push_back(::fsdpx::detail::str("'", tensors_[i].name, "': ", gap));
    }
  }
  FSDPX_CHECK_AS(SyncError, problems_.empty(),
                 "received weights are not whole (every element of every tensor must "
                 "arrive exactly once): ",
                 join(problems_));
  return std::move(tensors_);
}

FSDPX_DECL std::string TensorCollector::join(const std::vector<std::string>& items, size_t max) {
  std::string s;
  for (size_t i = 0; i < items.size() && i < max; ++i) s += (i ? "; " : "") + items[i];
  if (items.size() > max) s += ::fsdpx::detail::str("; and ", items.size() - max, " more");
  return s;
}

FSDPX_DECL std::unordered_map<std::string, size_t>::iterator TensorCollector::add(const BucketEntry& e) {
  const int64_t numel = e.tensor_numel();
  const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(e.dtype));  // checked by decode_header
  FSDPX_CHECK_AS(SyncError, bytes <= max_bytes_ - allocated_, "received weights: tensor '", e.name, "' of ", bytes,
                 " bytes would take the version beyond its limit of ", max_bytes_, " bytes");
  // Each tensor also costs its bookkeeping, so that a sender cannot make many empty ones for free.
  bookkeeping_ += detail::tensor_bookkeeping_bytes + 2 * static_cast<int64_t>(e.name.size());  // kept twice
  const std::string problem =
      detail::bookkeeping_problem(bookkeeping_, arrived_, detail::version_bookkeeping_floor,
                                  ::fsdpx::detail::str("tensor '", e.name, "', the ", tensors_.size() + 1, "th,"));
  FSDPX_CHECK_AS(SyncError, problem.empty(), "received weights: ", problem);
  allocated_ += bytes;
  const auto options = at::TensorOptions().dtype(e.dtype).device(device_);
  tensors_.push_back(
      {e.name, (huge_pages_ ? memory::empty_buffer(numel, options) : at::empty({numel}, options)).view(e.shape)});
  received_.emplace_back();
  return index_.emplace(e.name, tensors_.size() - 1).first;
}

FSDPX_DECL ModuleLoader::ModuleLoader(torch::nn::Module& module) {
  // A tied parameter appears under several names; any of them fills it.
  std::unordered_map<const c10::TensorImpl*, size_t> seen;
  const auto add = [&](const std::string& name, const at::Tensor& t) {
    if (!t.defined()) return;
    const auto [it, fresh] = seen.emplace(t.unsafeGetTensorImpl(), targets_.size());
    if (fresh) targets_.push_back({name, t, {}});
    by_name_.emplace(name, it->second);
  };
  for (const auto& item : module.named_parameters(/*recurse=*/true)) add(item.key(), item.value());
  for (const auto& item : module.named_buffers(/*recurse=*/true)) add(item.key(), item.value());
}

FSDPX_DECL void ModuleLoader::accept(const BucketEntry& e, const at::Tensor& chunk) {
  const auto it = by_name_.find(e.name);
  if (it == by_name_.end()) {
    unknown_.push_back(e.name);
    return;
  }
  Target& t = targets_[it->second];
  if (t.reported) return;
  if (t.param.sizes().vec() != e.shape) {
    t.reported = true;
    problems_.push_back(::fsdpx::detail::str("'", e.name, "' has shape ", t.param.sizes(), " in the module but ",
                                             c10::IntArrayRef(e.shape), " was sent"));
    return;
  }
  if (!t.param.is_contiguous()) {
    t.reported = true;
    problems_.push_back(::fsdpx::detail::str("'", e.name, "' is not contiguous in the module"));
    return;
  }
  if (!cover(t, e)) return;  // nothing is written twice
  at::NoGradGuard no_grad;
  if (e.numel > 0) t.param.detach().view({-1}).narrow(0, e.element_offset, e.numel).copy_(chunk);
}

FSDPX_DECL bool ModuleLoader::cover(Target& t, const BucketEntry& e) {
  if (std::string problem = t.received.add(e.element_offset, e.numel, t.param.numel()); !problem.empty()) {
    problems_.push_back(::fsdpx::detail::str("'", e.name, "': ", problem));
    return false;
  }
  return true;
}

FSDPX_DECL void ModuleLoader::accepted(const BucketEntry& e) { cover(targets_[by_name_.at(e.name)], e); }

FSDPX_DECL at::Tensor ModuleLoader::destination(const BucketEntry& e) const {
  const auto it = by_name_.find(e.name);
  if (it == by_name_.end() || e.numel == 0) return {};
  const Target& t = targets_[it->second];
  if (t.reported || t.param.sizes().vec() != e.shape || !t.param.is_contiguous() || t.param.scalar_type() != e.dtype) {
    return {};
  }
  return t.param.detach().view({-1}).narrow(0, e.element_offset, e.numel);
}

FSDPX_DECL void ModuleLoader::finish() {
  std::vector<std::string> missing;
  for (const Target& t : targets_) {
    if (t.reported) continue;
    if (t.received.covered() == 0 && t.param.numel() > 0) {
      missing.push_back(t.name);
    } else if (t.received.covered() != t.param.numel()) {
      problems_.push_back(::fsdpx::detail::str("'", t.name, "': ", t.received.gap(t.param.numel())));
    }
  }
  std::sort(unknown_.begin(), unknown_.end());
  unknown_.erase(std::unique(unknown_.begin(), unknown_.end()), unknown_.end());
  if (!unknown_.empty()) {
    problems_.push_back(::fsdpx::detail::str(
        unknown_.size(),
        " sent tensor(s) are not parameters or buffers of the module: ", TensorCollector::join(unknown_)));
  }
  if (!missing.empty()) {
    problems_.push_back(::fsdpx::detail::str(
        missing.size(), " module parameter(s) or buffer(s) were not sent: ", TensorCollector::join(missing)));
  }
  FSDPX_CHECK_AS(SyncError, problems_.empty(),
                 "the received weights do not match the module (its other parameters may have been updated): ",
                 TensorCollector::join(problems_));
}

}  // namespace fsdpx::sync

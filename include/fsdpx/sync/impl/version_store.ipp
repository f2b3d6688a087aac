// Out-of-line functions of fsdpx/sync/detail/version_store.hpp: included by it (header-only) or by
// fsdpx/impl/src.hpp (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <fsdpx/sync/detail/version_store.hpp>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <limits>
#include <unordered_map>
#include <unordered_set>

#include <ATen/Parallel.h>

#include <fsdpx/detail/crc32c.hpp>
#include <fsdpx/sync/detail/delta_codec.hpp>

namespace fsdpx::sync::detail {

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
    const double sparse = changed * static_cast<double>((s.numel > narrow_index_limit ? 8 : 4) + s.esize);
    double best = std::min(cost(sparse, 0), cost(full, 0)), bytes = sparse < full ? sparse : full;
    if (!xored.empty() && changed >= static_cast<double>(options.xor_min_changed) &&
        cost(xor_ratio * full, 2 * xor_seconds_per_byte * full) < best) {
      bytes = xor_ratio * full;
    }
    sent += bytes;
  }
  return whole > 0 && sent >= 0.9 * whole;
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
  if (delta && delta_cannot_pay(tensors, tensors_, options)) delta = false;  // no comparison pass
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
    const at::Tensor t = host_contiguous(nt.tensor);
    dtype_code(t.scalar_type());  // checks the dtype can travel
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
    const ChangeCount changes = count_changed(t, base);
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
    e.index_bytes = t.numel() > narrow_index_limit ? 8 : 4;
    const int64_t sparse_bytes = e.changed * (e.index_bytes + esize);
    double best = std::min(cost(static_cast<double>(sparse_bytes), 0), cost(static_cast<double>(full_bytes), 0));
    e.encoding = sparse_bytes < full_bytes ? DeltaEncoding::sparse : DeltaEncoding::full;
    std::vector<uint8_t> packed;
    if (has_zlib && e.changed >= options.xor_min_changed) {
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
        xor_into(bytes_of(t) + at, bytes_of(base) + at, len, bits.data());
        const auto z = deflate_bytes(bits.data(), len, options.zlib_level);
        seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        sample_in += static_cast<double>(len);
        sample_out += static_cast<double>(z.size());
      }
      const double scale = static_cast<double>(full_bytes) / sample_in;
      // Inflating costs about what compressing did at level 1; counted once more.
      if (cost(sample_out * scale, 2 * seconds * scale) < 0.9 * best) {
        const auto start = std::chrono::steady_clock::now();
        std::vector<uint8_t> all(static_cast<size_t>(full_bytes));
        xor_into(bytes_of(t), bytes_of(base), full_bytes, all.data());
        packed = deflate_bytes(all.data(), full_bytes, options.zlib_level);
        const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        if (const double c = cost(static_cast<double>(packed.size()), 2 * took); c < best) {
          best = c;
          e.encoding = DeltaEncoding::xor_zlib;
        }
      }
    }
    switch (e.encoding) {
      case DeltaEncoding::sparse:
        out.tensors.push_back({nt.name, sparse_payload(t, base, changes, e.index_bytes)});
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
    manifest_ = std::make_shared<const Manifest>(std::move(v.manifest));
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
      const uint8_t* p = bytes_of(payload);
      uint8_t* dst = static_cast<uint8_t*>(held.data_ptr());
      with_widths(static_cast<int64_t>(held.element_size()), e.index_bytes, [&]<int E, int W>() {
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
  manifest_ = std::make_shared<const Manifest>(std::move(v.manifest));
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
  manifest_ = std::make_shared<const Manifest>(std::move(manifest));
}

FSDPX_DECL void VersionStore::accept(std::vector<NamedTensor> received, Apply mode, std::string_view where,
                                     std::optional<std::chrono::steady_clock::time_point> deadline) {
  // Named, not a structured binding: the lambdas below use them, which clang before 16 refuses for bindings.
  auto split = split_manifest(std::move(received), where);
  Manifest& m = split.first;
  std::vector<NamedTensor>& rest = split.second;
  // Checked every 256 tensors: a version of many tensors ends by the fetch's deadline too.
  const auto in_time = [&](size_t i) {
    if (deadline && i % 256 == 255 && std::chrono::steady_clock::now() > *deadline) {
      delta_fail(where, m.version,
                 ::fsdpx::detail::str("the fetch's wait ended while its tensors were checked (", i + 1, " of ",
                                      m.entries.size(), "): nothing was taken; wait longer for a version this large"));
    }
  };
  std::unordered_map<std::string_view, size_t> by_name;
  for (size_t i = 0; i < rest.size(); ++i) {
    if (!by_name.emplace(rest[i].name, i).second) {
      delta_fail(where, m.version, ::fsdpx::detail::str("tensor '", rest[i].name, "' arrived twice"));
    }
  }
  const auto listed = entries_by_name(m);
  for (const auto& t : rest) {
    const auto found = listed.find(t.name);
    const ManifestEntry* e = found == listed.end() ? nullptr : found->second;
    if (e == nullptr || e->encoding == DeltaEncoding::unchanged) {
      delta_fail(where, m.version,
                 ::fsdpx::detail::str("tensor '", t.name, "' arrived but its manifest ",
                                      e ? "says it is unchanged" : "does not list it"));
    }
  }
  at::NoGradGuard no_grad;
  if (!m.is_delta()) {
    std::vector<NamedTensor> held;
    held.reserve(m.entries.size());
    for (const ManifestEntry& e : m.entries) {
      in_time(held.size());
      const auto it = by_name.find(e.name);
      if (it == by_name.end())
        delta_fail(where, m.version, ::fsdpx::detail::str("tensor '", e.name, "' never arrived"));
      const at::Tensor& t = rest[it->second].tensor;
      if (t.scalar_type() != e.dtype || t.sizes().vec() != e.shape) {
        delta_fail(where, m.version,
                   ::fsdpx::detail::str("tensor '", e.name, "' arrived as ", t.scalar_type(), " ", t.sizes(),
                                        ", its manifest says ", e.dtype, " ", c10::IntArrayRef(e.shape)));
      }
      if (tensor_crc32c(t) != e.crc) {
        delta_fail(where, m.version,
                   ::fsdpx::detail::str("tensor '", e.name,
                                        "' does not match its checksum "
                                        "(CRC-32C): it was corrupted on the way or made wrongly"));
      }
      held.push_back({e.name, t.contiguous()});
    }
    tensors_ = std::move(held);
    manifest_ = std::make_shared<const Manifest>(std::move(m));
    return;
  }
  if (!manifest_ || !holds(m.base_version, m.base_digest)) {
    delta_fail(
        where, m.version,
        ::fsdpx::detail::str(
            "it is a delta from version ", m.base_version, " (digest ", m.base_digest, ") but this receiver holds ",
            manifest_ ? ::fsdpx::detail::str("version ", manifest_->version, " (digest ", manifest_->digest, ")")
                      : std::string("no version"),
            ": nothing was applied; the next fetch asks for a full version"));
  }
  const Manifest& base = *manifest_;
  if (base.entries.size() != m.entries.size()) {
    delta_fail(where, m.version,
               ::fsdpx::detail::str("its delta lists ", m.entries.size(), " tensors, its base ", base.entries.size()));
  }
  for (size_t i = 0; i < m.entries.size(); ++i) {
    const ManifestEntry& e = m.entries[i];
    const ManifestEntry& b = base.entries[i];
    if (e.name != b.name || e.dtype != b.dtype || e.shape != b.shape) {
      delta_fail(where, m.version,
                 ::fsdpx::detail::str("tensor '", e.name, "' (", e.dtype, " ", c10::IntArrayRef(e.shape),
                                      ") is not tensor '", b.name, "' of its base at the same place"));
    }
    if (e.encoding == DeltaEncoding::unchanged && e.crc != b.crc) {
      delta_fail(where, m.version,
                 ::fsdpx::detail::str("tensor '", e.name,
                                      "' is unchanged, but its checksum "
                                      "differs from its base's"));
    }
    if (e.encoding != DeltaEncoding::unchanged && !by_name.contains(e.name)) {
      delta_fail(where, m.version,
                 ::fsdpx::detail::str("tensor '", e.name, "' (", to_string(e.encoding), ") never arrived"));
    }
  }
  std::vector<NamedTensor> next = tensors_;
  std::vector<Undo> undo;
  std::vector<std::pair<at::Tensor, at::Tensor>> deferred;  // in place: (held, sent whole), copied last
  const auto roll_back = [&] {
    for (auto u = undo.rbegin(); u != undo.rend(); ++u) {
      at::Tensor held = tensors_[u->index].tensor;
      at::Tensor bits = held.view({-1}).view(bits_dtype(held.scalar_type()));
      switch (u->encoding) {
        case DeltaEncoding::sparse: bits.index_copy_(0, u->indices, u->saved); break;
        case DeltaEncoding::full: held.copy_(u->saved); break;
        default: bits.bitwise_xor_(u->saved.to(held.device()).view(bits.scalar_type()));
      }
    }
  };
  try {
    for (size_t i = 0; i < m.entries.size(); ++i) {
      in_time(i);
      const ManifestEntry& e = m.entries[i];
      if (e.encoding == DeltaEncoding::unchanged) continue;
      const at::Tensor& payload = rest[by_name.at(e.name)].tensor;
      const auto bad = [&](const std::string& why) {
        delta_fail(where, m.version,
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
      const at::ScalarType bits_type = bits_dtype(e.dtype);
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
        const at::Tensor bytes = host_contiguous(payload);
        if (e.encoding == DeltaEncoding::sparse) {
          int64_t expected = 0;
          if (__builtin_mul_overflow(e.changed, e.index_bytes + esize, &expected) || bytes.numel() != expected) {
            bad(::fsdpx::detail::str(bytes.numel(), " bytes where ", e.changed, " changes take ", expected));
          }
          const uint8_t* p = bytes_of(bytes);
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
            const uint8_t* src = bytes_of(values);
            uint8_t* keep = old.defined() ? static_cast<uint8_t*>(old.data_ptr()) : nullptr;
            with_widths(esize, 8, [&]<int E, int W>() {
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
          if (std::string why =
                  inflate_exactly(bytes_of(bytes), bytes.numel(), inflated.mutable_data_ptr<uint8_t>(), numel * esize);
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
  manifest_ = std::make_shared<const Manifest>(std::move(m));
}

}  // namespace fsdpx::sync::detail

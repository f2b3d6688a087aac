// The storage a DCP checkpoint is read from: a folder that `dcp.save` wrote (FSDP2, LightRFT, torchtitan, a
// plain `model.state_dict()`), opened, and any range of its tensors read from the chunks that overlap it only
// (torch's FileSystemReader; state_dict_loader.hpp loads a model from it):
//
//   fsdpx::dcp::Reader r("/ckpt/global_step10");
//   at::Tensor w = r.read("model.layers.0.self_attn.q_proj.weight", 0, 4096);  // elements [0, 4096)
//
// In DCP's default format each chunk of a tensor (a box {offsets, sizes} of its global shape) is a whole
// torch.save archive at [offset, offset + length) of a data file (`__<rank>_<n>.distcp`), and a bytes entry
// (a Python value: an optimizer's param_groups) is one too. Every file is untrusted: the `.metadata` is
// read by a pickle reader that runs nothing (metadata.hpp), every range is checked against its file's
// size before a byte is read, each chunk must be a tensor of its entry's dtype and its box's sizes, and a
// bytes entry is read by that pickle reader too, so it can hold plain values only.
#pragma once

#include <fsdpx/detail/config.hpp>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <fsdpx/checkpoint/format.hpp>
#include <fsdpx/dcp/metadata.hpp>
#include <fsdpx/error.hpp>

namespace fsdpx::dcp {

/// Whether `dir` is a DCP checkpoint: a folder that holds a `.metadata` file.
FSDPX_DECL bool is_checkpoint(const fs::path& dir);

struct ReaderOptions {
  MetadataLimits metadata;
  /// The largest pickle of a bytes entry that read_bytes reads (plain values: an lr, param_groups).
  int64_t max_bytes_entry = int64_t{16} << 20;
  /// The most values (numbers, strings, containers) one bytes entry may make.
  int64_t max_bytes_values = int64_t{1} << 20;
  /// The folder's files as an fsdpx commit record lists them (names relative to the folder; a CRC-32C of
  /// nullopt is not checked). Given, `.metadata` and every data file must be listed with their sizes, and each
  /// file's CRC-32C is checked over the whole file before the first record is read from it (so a rank checks
  /// the files it reads). nullopt: a folder another trainer wrote, whose data carries no checksums.
  std::optional<std::map<std::string, checkpoint::CommittedFile>> committed;
};

/// A DCP checkpoint folder, opened: its `.metadata` read and checked, and every data file it names
/// present, a regular file, and large enough for every range recorded in it. Reads are positioned reads
/// of the chunks asked for; nothing is cached.
class Reader {
 public:
  /// An IoError for a folder without a readable `.metadata`, a record whose bytes went through transforms
  /// (a compressor: `transform_descriptors`), a data file that is missing or not a regular file, a range
  /// past a data file's end, a chunk whose record is too small for its box, or (with options.committed) a
  /// file the commit record does not list or lists with another size, each naming the entry and the file.
  FSDPX_DECL explicit Reader(fs::path dir, const ReaderOptions& options = {});

  const fs::path& dir() const { return dir_; }
  const Metadata& metadata() const { return md_; }

  /// The tensor entry `fqn`; nullptr when the checkpoint has none (or `fqn` is a bytes entry).
  FSDPX_DECL const TensorEntry* find_tensor(const std::string& fqn) const;
  /// The tensor entry `fqn`, or an Error naming it.
  FSDPX_DECL const TensorEntry& tensor(const std::string& fqn) const;
  FSDPX_DECL bool has_bytes(const std::string& fqn) const;
  /// Whether any entry's name starts with `prefix` ("optimizer.state.": a nested part of the state dict).
  bool has_entry_under(const std::string& prefix) const {
    const auto it = md_.entries.lower_bound(prefix);
    return it != md_.entries.end() && it->first.starts_with(prefix);
  }

  /// Elements [begin, end) of tensor `fqn` flattened row-major, 1-D in its dtype, read from the chunks that
  /// overlap them only. Overlapping chunks are fine; an element no chunk holds is an IoError naming the
  /// tensor and the element.
  at::Tensor read(const std::string& fqn, int64_t begin, int64_t end) const;
  /// The whole tensor `fqn`, in its shape.
  at::Tensor read(const std::string& fqn) const;
  /// read(fqn, begin, end) into `dst` (1-D, end - begin elements, any dtype and device: copied with a cast).
  FSDPX_DECL void read_into(const std::string& fqn, int64_t begin, int64_t end, const at::Tensor& dst) const;

  /// The Python value of bytes entry `fqn`: None, a bool, an int, a float, a str, or a list, tuple or dict
  /// of those. Anything else (a class, a tensor, bytes) is refused with an IoError naming the entry.
  FSDPX_DECL c10::IValue read_bytes(const std::string& fqn) const;

  /// The chunks and bytes read so far (a rank's share of a load).
  int64_t chunks_read() const { return chunks_read_; }
  int64_t bytes_read() const { return bytes_read_; }

 private:
  FSDPX_DECL const StorageInfo& storage(const StorageIndex& key) const;
  /// Where a record lies, for errors: "bytes [o, o + l) of '<file>'".
  FSDPX_DECL std::string place(const StorageInfo& info) const;
  /// Refuses a blob that is not a torch.save archive (DCP's other serialization format), naming what it is.
  FSDPX_DECL void check_torch_save(const std::string& what, const StorageInfo& info) const;
  FSDPX_DECL at::Tensor load_chunk(const std::string& fqn, const TensorEntry& t, const Chunk& c) const;
  /// With options.committed: the CRC-32C of data file `relative_path`, once, before its first record is read.
  FSDPX_DECL void check_committed(const std::string& relative_path) const;

  fs::path dir_;
  ReaderOptions options_;
  Metadata md_;
  mutable int64_t chunks_read_ = 0;
  mutable int64_t bytes_read_ = 0;
  mutable std::set<std::string> checked_;  // data files whose CRC-32C matched the commit record
};

/// The Python value of a torch.save file of plain values (LightRFT's scheduler_state.pt and client_state.pt beside
/// a DCP checkpoint), read as read_bytes reads a bytes entry: anything but plain values is an IoError naming it.
FSDPX_DECL c10::IValue read_plain_file(const fs::path& path, const ReaderOptions& options = {});

inline at::Tensor Reader::read(const std::string& fqn, int64_t begin, int64_t end) const {
  const TensorEntry& t = tensor(fqn);
  FSDPX_CHECK(begin >= 0 && begin <= end, "reading elements [", begin, ", ", end, ") of DCP tensor '", fqn, "'");
  // The chunks cover the tensor (validate_metadata) and each lies within its record (the constructor), so the
  // size is what the files hold; one larger than this machine's memory is an IoError naming the tensor.
  at::Tensor out;
  try {
    out = at::empty({end - begin}, at::TensorOptions().dtype(t.dtype));
  } catch (const c10::Error& e) {
    throw IoError(
        ::fsdpx::detail::str("fsdpx: DCP checkpoint '", dir_.string(), "': tensor '", fqn, "' of ", end - begin,
                             " elements does not fit in this machine's memory: ", e.what_without_backtrace()));
  }
  read_into(fqn, begin, end, out);
  return out;
}

inline at::Tensor Reader::read(const std::string& fqn) const {
  const TensorEntry& t = tensor(fqn);
  int64_t numel = 1;
  for (const int64_t d : t.size) numel *= d;  // validated: no overflow
  return read(fqn, 0, numel).view(t.size);
}

}  // namespace fsdpx::dcp

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/dcp/impl/reader.ipp>
#endif

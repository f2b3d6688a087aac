// A parsed pickle (fsdpx/pickle/pickle.hpp) as LibTorch values: how fsdpx reads every pickle of a
// checkpoint file, a torch.save archive's data.pkl (its tensors made over the archive's storage records)
// and a DCP bytes entry's plain value alike. LibTorch's unpickler never sees a file's bytes: it makes what
// the pickle says (a storage of the size it claims, a record re-read per reference, a value nested as deep
// as the file nests, whose destructor then recurses past the stack). Here each pickle node is made once
// (what the memo shares stays shared, so sharing cannot multiply memory), without recursion, to a stated
// depth; each storage record is read once however many tensors view it, and each tensor is checked to lie
// within its record before it is made.
#pragma once

#include <fsdpx/detail/config.hpp>

#include <functional>
#include <string>
#include <string_view>

#include <ATen/core/ivalue.h>

#include <fsdpx/pickle/pickle.hpp>

namespace fsdpx::checkpoint::detail {

/// How deeply the values of a checkpoint's pickle may nest (a tensor is 4 levels of pickle; a state dict
/// of optimizer states about 8). Python's pickle stops at its recursion limit, near 1000.
inline constexpr int max_value_depth = 100;

/// The storage record `key` of an archive (its "data/<key>"), as an untyped storage of the record's bytes.
/// Called once per key.
using StorageRecords = std::function<c10::Storage(const std::string& key)>;

/// Whether a torch.save archive's data.pkl may name `module`.`name`: what LibTorch's pickler and Python's
/// torch.save write for tensors and plain values (`torch._utils._rebuild_tensor_v2` and
/// `_rebuild_parameter`, `torch.<Type>Storage`, `collections.OrderedDict`, `torch.jit._pickle.build_*list`).
FSDPX_DECL bool archive_global(std::string_view module, std::string_view name);

/// The pickle limits of a torch.save archive's data.pkl of `max_bytes` bytes at most.
FSDPX_DECL ::fsdpx::pickle::Limits archive_limits(int64_t max_bytes);

/// The value of `p` as LibTorch's unpickler would make it (dicts and lists of AnyType, `build_intlist` and
/// the like as typed lists, tuples, strings, numbers, None), with tensors made over `storages` when given;
/// without them (a plain value) a tensor, a global or bytes is refused. Nesting past max_value_depth, a value
/// that holds itself, a class the archive may not call, a malformed tensor (a storage too small for it, a
/// negative size or stride, a dtype torch cannot store) or an unhashable dict key is an IoError naming `what`
/// and the byte of the value.
FSDPX_DECL c10::IValue pickle_value(const ::fsdpx::pickle::Pickle& p, const std::string& what,
                                    const StorageRecords* storages);

}  // namespace fsdpx::checkpoint::detail

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/checkpoint/impl/archive_reader.ipp>
#endif

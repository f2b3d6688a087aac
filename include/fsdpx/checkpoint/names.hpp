// How a model's tensors are named in a checkpoint that another library writes or reads: PyTorch Distributed
// Checkpoint (<fsdpx/dcp.hpp>: FSDP2, LightRFT, torchtitan, a plain transformers model) names a tensor by its
// place in the torch module, which need not be fsdpx's name of it. Plain data, so that the coordinator's and
// resume's options can carry it without the format's code (models::dcp_save_options and dcp_load_options
// fill them for the decoder).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace fsdpx {

/// Where a tensor lies inside a larger saved tensor (a mixture's experts, which transformers 5 holds stacked
/// per layer): that tensor's name and shape, and the element at which this tensor's flattened elements start.
struct Placement {
  std::string fqn;
  std::vector<int64_t> shape;
  int64_t offset = 0;
};

/// How fsdpx's tensors are named in a checkpoint saved for another library (dcp::SaveOptions).
struct SaveNames {
  /// The name saved for an fsdpx name (e.g. another library's names for the same tensors); empty: the
  /// same. An entry whose name maps to "" is left out.
  std::function<std::string(const std::string&)> saved_name;
  /// Further names a model tensor is saved under too (after saved_name), as torch's state dicts hold a
  /// tied weight under each of its names (models::dcp_save_options: a tied LM head).
  std::function<std::vector<std::string>(const std::string&)> also_saved_as;
  /// Where a tensor (by its saved name) is saved as part of a larger one, as transformers 5 holds a mixture's
  /// experts stacked (models::dcp_save_options); nullopt: as itself. Its optimizer state goes alike.
  std::function<std::optional<Placement>(const std::string&)> placed_in;
};

/// How a checkpoint another library saved meets a model's tensors on load (dcp::LoadOptions).
struct LoadNames {
  /// Names the checkpoint has and the model lacks are errors (missing and mismatched ones always are).
  bool strict = true;
  /// Only the entries under this prefix, which is stripped: "model." for dcp.save({"model": sd, ...}).
  std::string prefix;
  /// The checkpoint's name (after the prefix) of the model's tensor `name`; nullopt: not loaded. Empty: the
  /// same name (fsdpx's decoder is named as transformers names it: models::hf_tensors).
  std::function<std::optional<std::string>(const std::string&)> file_name;
  /// Entries the model deliberately lacks (a tied head's copy, a cached rotary table): neither loaded nor
  /// reported as unexpected.
  std::function<bool(const std::string&)> ignore;
  /// Where a tensor (by its checkpoint name, after file_name) lies inside a larger entry (the stacked experts
  /// of models::dcp_load_options); used where the checkpoint has that entry, else the tensor's own is read.
  std::function<std::optional<Placement>(const std::string&)> placed_in;
  /// Load the module's buffers too (whole, on every rank).
  bool buffers = true;
};

/// The name of LoadNames before the DCP room (2026-12): it reached every program through <fsdpx/fsdp.hpp>.
using DcpLoadOptions
    [[deprecated("fsdpx::DcpLoadOptions is now fsdpx::dcp::LoadOptions (<fsdpx/dcp.hpp>), "
                 "the same struct (fsdpx::LoadNames)")]] = LoadNames;

}  // namespace fsdpx

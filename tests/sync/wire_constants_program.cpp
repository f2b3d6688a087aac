// Prints, as JSON, every constant of weight sync's wire (and of the checkpoints the Python watcher reads)
// that the Python receiver (python/fsdpx_sync) must agree on: tests/sync/python_wire_constants_test.py
// compares them with the package's wire.CONSTANTS and wire.STRINGS, name by name, so that neither
// language can change one alone.
#include <cstdio>
#include <string>
#include <utility>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <fsdpx/checkpoint/format.hpp>
#include <fsdpx/detail/crc32c.hpp>
#include <fsdpx/detail/file_io.hpp>
#include <fsdpx/sync.hpp>
#include <fsdpx/sync/service.hpp>
#include <fsdpx/sync/detail/frame.hpp>
#include <fsdpx/sync/detail/handshake.hpp>

int main() {
  namespace d = fsdpx::sync::detail;
  namespace ckpt = fsdpx::checkpoint;
  using fsdpx::sync::DeltaEncoding;
  using K = d::FrameKind;
  nlohmann::ordered_json c;
  c["frame_magic"] = d::frame_magic;
  c["protocol_version"] = d::protocol_version;
  c["frame_header_bytes"] = sizeof(d::FrameHeader);
  for (const K k : {K::publish_begin, K::bucket, K::publish_end, K::ack, K::fetch, K::snapshot_begin, K::timeout,
                    K::error, K::goodbye, K::hello, K::auth, K::welcome}) {
    c[std::string("msg_") + d::to_string(k)] = static_cast<int>(k);
  }
  c["fetch_holds_base"] = d::fetch_holds_base;
  c["max_error_bytes"] = d::max_error_bytes;
  c["max_run_bytes"] = d::max_run_bytes;
  c["refused_busy"] = d::refused_busy;
  c["default_max_bucket_bytes"] = fsdpx::sync::ClientOptions{}.max_bucket_bytes;
  c["default_max_version_bytes"] = fsdpx::sync::ClientOptions{}.max_version_bytes;
  c["nonce_bytes"] = d::nonce_bytes;
  c["mac_bytes"] = d::mac_bytes;
  c["role_publish"] = static_cast<int>(fsdpx::sync::Role::publish);
  c["role_fetch"] = static_cast<int>(fsdpx::sync::Role::fetch);

  c["bucket_magic"] = d::bucket_magic;
  c["bucket_format"] = d::bucket_format;
  c["bucket_prefix_bytes"] = d::prefix_bytes;
  c["bucket_alignment"] = d::alignment;
  c["max_ndim"] = d::max_ndim;
  c["bucket_min_entry_bytes"] = d::min_entry_bytes;
  for (const auto& [name, dtype] : {std::pair{"float32", at::kFloat},
                                    {"float64", at::kDouble},
                                    {"bfloat16", at::kBFloat16},
                                    {"float16", at::kHalf},
                                    {"int8", at::kChar},
                                    {"uint8", at::kByte},
                                    {"int32", at::kInt},
                                    {"int64", at::kLong},
                                    {"bool", at::kBool}}) {
    c[std::string("dtype_code_") + name] = d::dtype_code(dtype);
  }
  c["header_bookkeeping_floor"] = d::header_bookkeeping_floor;
  c["version_bookkeeping_floor"] = d::version_bookkeeping_floor;
  c["parsed_entry_bytes"] = d::parsed_entry_bytes;
  c["tensor_bookkeeping_bytes"] = d::tensor_bookkeeping_bytes;
  c["range_bookkeeping_bytes"] = d::range_bookkeeping_bytes;
  c["manifest_entry_bookkeeping_bytes"] = d::manifest_entry_bookkeeping_bytes;

  c["manifest_magic"] = d::manifest_magic;
  c["manifest_format"] = d::manifest_format;
  c["manifest_prefix_bytes"] = d::manifest_prefix_bytes;
  c["manifest_min_entry_bytes"] = d::manifest_min_entry_bytes;
  c["encoding_unchanged"] = static_cast<int>(DeltaEncoding::unchanged);
  c["encoding_sparse"] = static_cast<int>(DeltaEncoding::sparse);
  c["encoding_full"] = static_cast<int>(DeltaEncoding::full);
  c["encoding_xor_zlib"] = static_cast<int>(DeltaEncoding::xor_zlib);
  c["sparse_narrow_index_limit"] = d::narrow_index_limit;
  c["crc32c_polynomial"] = fsdpx::detail::Crc32c::polynomial;

  c["checkpoint_format_version"] = ckpt::format_version;
  c["checkpoint_max_world_size"] = ckpt::max_world_size;
  c["max_record_file_bytes"] = fsdpx::detail::max_record_file_bytes;

  nlohmann::ordered_json s;
  s["handshake_client_label"] = std::string(d::client_label);
  s["handshake_server_label"] = std::string(d::server_label);
  s["manifest_name"] = std::string(d::manifest_name);
  s["state_dict_iteration_file"] = std::string(ckpt::state_dict_iteration_file);
  s["commit_record"] = std::string(ckpt::config_file);
  std::printf("%s\n", nlohmann::ordered_json{{"constants", c}, {"strings", s}}.dump(2).c_str());
  return 0;
}

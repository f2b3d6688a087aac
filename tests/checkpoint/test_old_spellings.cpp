// The spellings of the checkpoint calls before DCP's room and the model-first order (2026-12) still compile
// and mean what they meant, for one release: every name of fsdpx::checkpoint::dcp, the DCP loads spelled
// load_model_state_dict / load_optimizer_state_dict, load_checkpoint(root, model, ...),
// load_optimizer_state_dict(optimizer, model, saved), DcpLoadOptions, and the old headers. Each line that uses
// one says, after "warns:", what its deprecation warning says: checkpoint_old_spellings_warn compiles this file
// with the warnings on and requires each of them (tests/checkpoint/old_spellings_warn.cmake).
#include <catch2/catch.hpp>

#if defined(FSDPX_OLD_SPELLINGS_WARN)
#include <fsdpx/checkpoint/dcp_metadata.hpp>  // warns: <fsdpx/checkpoint/dcp_metadata.hpp> is deprecated
#include <fsdpx/checkpoint/dcp_reader.hpp>    // warns: <fsdpx/checkpoint/dcp_reader.hpp> is deprecated
#include <fsdpx/checkpoint/dcp_writer.hpp>    // warns: <fsdpx/checkpoint/dcp_writer.hpp> is deprecated
#else
#include <fsdpx/dcp.hpp>
#endif

#include <filesystem>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

#include <fsdpx/sync/broadcast.hpp>

#include "checkpoint_common.hpp"
#include "fresh_dir.hpp"

#if !defined(FSDPX_OLD_SPELLINGS_WARN)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
#endif

using namespace fsdpx;
using namespace fsdpx::test;
namespace fs = std::filesystem;
namespace old = fsdpx::checkpoint::dcp;

TEST_CASE("the DCP names of fsdpx::checkpoint::dcp are fsdpx::dcp's", "[checkpoint][deprecated][dcp]") {
  static_assert(std::is_same_v<old::Chunk, dcp::Chunk>);                    // warns: checkpoint::dcp::Chunk
  static_assert(std::is_same_v<old::MemoryFormat, dcp::MemoryFormat>);      // warns: checkpoint::dcp::MemoryFormat
  static_assert(std::is_same_v<old::TensorEntry, dcp::TensorEntry>);        // warns: checkpoint::dcp::TensorEntry
  static_assert(std::is_same_v<old::BytesEntry, dcp::BytesEntry>);          // warns: checkpoint::dcp::BytesEntry
  static_assert(std::is_same_v<old::Entry, dcp::Entry>);                    // warns: checkpoint::dcp::Entry
  static_assert(std::is_same_v<old::StorageIndex, dcp::StorageIndex>);      // warns: checkpoint::dcp::StorageIndex
  static_assert(std::is_same_v<old::StorageInfo, dcp::StorageInfo>);        // warns: checkpoint::dcp::StorageInfo
  static_assert(std::is_same_v<old::PathStep, dcp::PathStep>);              // warns: checkpoint::dcp::PathStep
  static_assert(std::is_same_v<old::StorageMeta, dcp::StorageMeta>);        // warns: checkpoint::dcp::StorageMeta
  static_assert(std::is_same_v<old::Metadata, dcp::Metadata>);              // warns: checkpoint::dcp::Metadata
  static_assert(std::is_same_v<old::MetadataLimits, dcp::MetadataLimits>);  // warns: checkpoint::dcp::MetadataLimits
  static_assert(std::is_same_v<old::Placement, Placement>);                 // warns: checkpoint::dcp::Placement
  static_assert(std::is_same_v<old::ReaderOptions, dcp::ReaderOptions>);    // warns: checkpoint::dcp::ReaderOptions
  static_assert(std::is_same_v<old::Reader, dcp::Reader>);                  // warns: checkpoint::dcp::Reader
  static_assert(std::is_same_v<old::SavedTensor, dcp::SavedTensor>);        // warns: checkpoint::dcp::SavedTensor
  static_assert(std::is_same_v<old::SavedBytes, dcp::SavedBytes>);          // warns: checkpoint::dcp::SavedBytes
  static_assert(std::is_same_v<old::RankState, dcp::RankState>);            // warns: checkpoint::dcp::RankState
  static_assert(std::is_same_v<old::SaveOptions, dcp::SaveOptions>);        // warns: checkpoint::dcp::SaveOptions
  static_assert(std::is_same_v<DcpLoadOptions, dcp::LoadOptions>);          // warns: fsdpx::DcpLoadOptions
  static_assert(old::HasShardedModel<CkptModel<>> && sync::HasShardedModel<CkptModel<>>);
  CHECK(std::string(old::metadata_file_name) == dcp::metadata_file_name);  // warns: checkpoint::dcp::metadata_file_name
  CHECK(std::string(old::current_version) == dcp::current_version);        // warns: checkpoint::dcp::current_version

  CHECK(std::string(old::dtype_name(c10::kBFloat16)) == "bfloat16");  // warns: checkpoint::dcp::dtype_name
  CHECK(old::dtype_from_name("float8_e4m3fn") ==
        c10::ScalarType::Float8_e4m3fn);                    // warns: checkpoint::dcp::dtype_from_name
  CHECK(old::data_file_name(3) == dcp::data_file_name(3));  // warns: checkpoint::dcp::data_file_name
  const std::vector<int64_t> shape{4, 3};
  CHECK((old::cover_flat_range(shape, 2, 9) ==
         dcp::cover_flat_range(shape, 2, 9)));  // warns: checkpoint::dcp::cover_flat_range

  // The .metadata functions, on a checkpoint of one tensor in one chunk.
  dcp::Metadata md;
  md.entries["w"] = dcp::TensorEntry{.dtype = c10::kFloat, .size = {4, 3}, .chunks = {{{0, 0}, {4, 3}}}};
  md.storage[{"w", std::vector<int64_t>{0, 0}}] = {.relative_path = "__0_0.distcp", .offset = 0, .length = 10};
  old::validate_metadata(md, "old");                                 // warns: checkpoint::dcp::validate_metadata
  const std::vector<std::byte> bytes = old::serialize_metadata(md);  // warns: checkpoint::dcp::serialize_metadata
  CHECK((old::parse_metadata(bytes) == md));                         // warns: checkpoint::dcp::parse_metadata
  const fs::path dir = fresh_dir("old_dcp_metadata") / (std::to_string(fsdpx::test::world().rank()) + ".metadata");
  old::write_metadata(dir, md);            // warns: checkpoint::dcp::write_metadata
  CHECK((old::read_metadata(dir) == md));  // warns: checkpoint::dcp::read_metadata
  CHECK_FALSE(old::is_checkpoint(dir));    // warns: checkpoint::dcp::is_checkpoint
}

TEST_CASE("the DCP calls before the model came first save and load what the new ones do",
          "[checkpoint][deprecated][dcp]") {
  auto world = any_world();
  const fs::path root = fresh_dir("old_dcp_calls");
  torch::manual_seed(21);
  CkptModel<> model(ResMlp(), world);
  auto opt = make_adamw(model, adamw_options());
  train_step(model, opt, world);

  old::save_model(root / "model", model);  // warns: save_model(dir, model, ...)
  old::save_optimizer(root / "model" / "optim_states", model,
                      opt);  // warns: save_optimizer(dir, model, optimizer, ...)
  old::save_model(root / "sharded", model.sharded(), old::SaveOptions{});  // warns: save_model(dir, model, ...)
  CHECK(old::is_checkpoint(root / "model"));                               // warns: checkpoint::dcp::is_checkpoint

  torch::manual_seed(22);  // other values, which the loads replace
  CkptModel<> by_path(ResMlp(), world), by_reader(ResMlp(), world);
  auto opt_path = make_adamw(by_path, adamw_options()), opt_reader = make_adamw(by_reader, adamw_options());
  REQUIRE_FALSE(same_shards(by_path, model));
  load_model_state_dict(by_path.sharded(), root / "model",
                        DcpLoadOptions{});             // warns: load_model_state_dict(model, dir, options)
  const old::Reader reader(root / "sharded");          // warns: checkpoint::dcp::Reader
  load_model_state_dict(by_reader.sharded(), reader);  // warns: load_model_state_dict(model, reader, options)
  CHECK(same_shards(by_path, model));
  CHECK(same_shards(by_reader, model));
  load_optimizer_state_dict(
      opt_path, by_path.sharded(),
      root / "model" / "optim_states");  // warns: load_optimizer_state_dict(optimizer, model, dir, options)
  load_optimizer_state_dict(
      opt_reader, by_reader.sharded(),
      dcp::Reader(root / "model" /
                  "optim_states"));  // warns: load_optimizer_state_dict(optimizer, model, reader, options)
  // The same optimizer state: the next step is the same on all three.
  torch::manual_seed(23);
  train_step(model, opt, world);
  torch::manual_seed(23);
  train_step(by_path, opt_path, world);
  torch::manual_seed(23);
  train_step(by_reader, opt_reader, world);
  CHECK(same_shards(by_path, model));
  CHECK(same_shards(by_reader, model));

  // The lower-level writers: what save_model wrote is their output.
  const StateDict sd = sharded_state_dict(model);
  const auto tensors = old::model_tensors(sd);  // warns: checkpoint::dcp::model_tensors
  CHECK(tensors.size() == dcp::model_tensors(sd).size());
  const auto state =
      old::optimizer_tensors(optimizer_state_dict(model, opt));  // warns: checkpoint::dcp::optimizer_tensors
  CHECK(state.size() == dcp::optimizer_tensors(optimizer_state_dict(model, opt)).size());
  const auto groups = old::param_group_entries(model.sharded(), opt);  // warns: checkpoint::dcp::param_group_entries
  CHECK(groups.size() == dcp::param_group_entries(model, opt).size());
  old::save_state(root / "state", world, old::RankState{tensors, {}});  // warns: checkpoint::dcp::save_state
  CHECK(dcp::Reader(root / "state").metadata().entries.size() == dcp::Reader(root / "model").metadata().entries.size());
  // A file of plain values, as LightRFT's client_state.pt
  c10::impl::GenericDict client(c10::StringType::get(), c10::AnyType::get());
  client.insert("consumed_samples", int64_t{64});
  const fs::path client_file = root / ("client_state_" + std::to_string(world.rank()) + ".pt");
  checkpoint::detail::save_ivalue(client_file, client);
  const c10::IValue read =
      old::read_plain_file(client_file, dcp::ReaderOptions{});  // warns: checkpoint::dcp::read_plain_file
  CHECK(read.toGenericDict().at("consumed_samples").toInt() == 64);
  world.barrier();
}

TEST_CASE("load_checkpoint(root, model, ...) and load_optimizer_state_dict(optimizer, model, ...) still resume",
          "[checkpoint][deprecated]") {
  auto world = any_world();
  const fs::path root = fresh_dir("old_load_checkpoint");
  torch::manual_seed(31);
  CkptModel<> model(ResMlp(), world);
  auto opt = make_adamw(model, adamw_options());
  LrScheduler scheduler(opt, LrSchedule::cosine(1, 10));
  train_step(model, opt, world);
  scheduler.step();
  {
    CheckpointCoordinator run(root, model);
    run.save(1, model, opt, scheduler);
    run.wait();
  }
  const auto fresh_model = [&] {
    torch::manual_seed(32);
    return std::make_unique<CkptModel<>>(ResMlp(), world);
  };
  {
    auto m = fresh_model();
    REQUIRE(load_checkpoint(root, *m)->step == 1);  // warns: load_checkpoint(root, model, ...)
    CHECK(same_shards(*m, model));
  }
  {
    auto m = fresh_model();
    auto o = make_adamw(*m, adamw_options());
    REQUIRE(load_checkpoint(root, *m, o)->step == 1);                  // warns: load_checkpoint(root, model, ...)
    REQUIRE(load_checkpoint(root, *m, &o, LoadOptions{})->step == 1);  // warns: load_checkpoint(root, model, ...)
    CHECK(same_shards(*m, model));
  }
  {
    auto m = fresh_model();
    auto o = make_adamw(*m, adamw_options());
    LrScheduler s(o, LrSchedule::cosine(1, 10));
    REQUIRE(load_checkpoint(root, *m, o, s)->step == 1);              // warns: load_checkpoint(root, model, ...)
    REQUIRE(load_checkpoint(root, m->sharded(), &o, &s)->step == 1);  // warns: load_checkpoint(root, model, ...)
    CHECK(s.last_step() == 1);
  }
  {
    auto m = fresh_model();
    auto o = make_adamw(*m, adamw_options());
    const StateDict saved = optimizer_state_dict(model, opt);
    load_model_state_dict(*m, sharded_state_dict(model));
    load_optimizer_state_dict(o, m->sharded(), [&](const auto& fn) {
      fn(saved);
    });  // warns: load_optimizer_state_dict(optimizer, model, saved)
    torch::manual_seed(33);
    train_step(model, opt, world);
    torch::manual_seed(33);
    train_step(*m, o, world);
    CHECK(same_shards(*m, model));
  }
  world.barrier();
}

#if !defined(FSDPX_OLD_SPELLINGS_WARN)
#pragma GCC diagnostic pop
#endif

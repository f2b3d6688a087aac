// A program built with <fsdpx/fsdp.hpp> alone, header-only (the DCP room is not in it): each way it meets
// PyTorch Distributed Checkpoint is refused with an error that names the header to include, never taken for
// an empty root (a resume that silently starts over) nor for garbage.
//   fsdpx_without_dcp_program <scratch dir>     (one MPI rank; prints "without-dcp checks passed")
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>

#include <fsdpx/fsdp.hpp>

#include "../core/models.hpp"

using namespace fsdpx;
namespace fs = std::filesystem;

namespace {

using Model =
    Fsdp<test::ResMlp, FullShard, NoOffload, FullPrecision, ShardedStateDict, WrapModules<test::ResBlockImpl>>;

int failures = 0;

/// `fn` must throw an fsdpx::ConfigError whose message names <fsdpx/dcp.hpp> and `cause`.
void refused(const char* what, const std::string& cause, const std::function<void()>& fn) {
  try {
    fn();
  } catch (const ConfigError& e) {
    const std::string message = e.what();
    if (message.find("<fsdpx/dcp.hpp>") != std::string::npos && message.find(cause) != std::string::npos) {
      std::printf("ok: %s: %s\n", what, e.what());
      return;
    }
    std::printf("FAILED: %s: the error does not name <fsdpx/dcp.hpp> and '%s': %s\n", what, cause.c_str(), e.what());
    ++failures;
    return;
  } catch (const std::exception& e) {
    std::printf("FAILED: %s: not a ConfigError: %s\n", what, e.what());
    ++failures;
    return;
  }
  std::printf("FAILED: %s: nothing was refused\n", what);
  ++failures;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: fsdpx_without_dcp_program <scratch dir>\n");
    return 2;
  }
  const fs::path scratch = argv[1];
  fs::remove_all(scratch);
  fs::create_directories(scratch);
  auto mpi = dist::MpiCommunicator::world();
  dist::AnyCommunicator world(mpi);
  torch::manual_seed(3);
  Model model(test::ResMlp(), world);
  auto optimizer = make_adamw(model, torch::optim::AdamWOptions(1e-3));

  // Writing: the coordinator refuses the format at once, before anything is saved.
  refused("CheckpointCoordinator with CheckpointFormat::dcp", "CheckpointCoordinator",
          [&] { CheckpointCoordinator run(scratch / "dcp_root", model, {.format = CheckpointFormat::dcp}); });

  // Reading a DCP folder (anything with a .metadata is one): named, not "no checkpoint here".
  const fs::path folder = scratch / "global_step10";
  fs::create_directories(folder);
  std::ofstream(folder / ".metadata") << "not read: the header is missing before the file is";
  refused("load_checkpoint of a DCP folder", folder.string(), [&] { load_checkpoint(model, folder, optimizer); });
  refused("merge_checkpoint of a DCP folder", folder.string(), [&] { checkpoint::merge_checkpoint(folder); });

  // An fsdpx root whose step was saved with CheckpointFormat::dcp: its commit record says so.
  const fs::path root = scratch / "root";
  {
    CheckpointCoordinator run(root, model);
    ExtraState extra;
    run.save(1, model, optimizer, extra);
    run.wait();
  }
  const fs::path record = checkpoint::step_dir(root, 1) / checkpoint::config_file;
  std::string text = fsdpx::detail::read_text(record, "commit record");
  text.replace(text.find("\"format\""), 0, "\"files_format\": \"dcp\",\n  ");
  fsdpx::detail::write_text_durably(record, text);
  refused("load_checkpoint of a root saved in DCP", "checkpoint step 1",
          [&] { load_checkpoint(model, root, optimizer); });
  refused("merge_checkpoint of a step saved in DCP", checkpoint::step_dir(root, 1).string(),
          [&] { checkpoint::merge_checkpoint(checkpoint::step_dir(root, 1)); });

  if (failures != 0) {
    std::printf("%d check(s) failed\n", failures);
    return 1;
  }
  std::printf("without-dcp checks passed\n");
  return 0;
}

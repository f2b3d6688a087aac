// fsdpx-inspect: what a checkpoint root holds, and whether its files are intact.
//
//   fsdpx-inspect <checkpoint root>                 the steps, their commit state, world size, mesh and bytes,
//                                                   the iteration files and where they point, live leases
//   fsdpx-inspect <root> --step N [--tensors]       one step: its files, and its model's tensors (shape, dtype)
//   fsdpx-inspect <root> --verify [--step N]        every committed file's size and CRC-32C against the commit
//                                                   record; exit 1 naming each file that is wrong
//   fsdpx-inspect <DCP folder> [--tensors] [--verify]
//                                                   a PyTorch Distributed Checkpoint: its entries and files;
//                                                   --verify reads every chunk and bytes entry through
//                                                   dcp::Reader's checks; exit 1 naming each problem
//
// Reads only; never writes or leases anything. Exit 0, or 1 with the reason.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <map>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include <CLI/CLI.hpp>

#include <fsdpx/detail/file_io.hpp>
#include <fsdpx/dcp.hpp>
#include <fsdpx/checkpoint/format.hpp>
#include <fsdpx/checkpoint/layout.hpp>
#include <fsdpx/error.hpp>

namespace {

namespace fs = std::filesystem;
namespace ckpt = fsdpx::checkpoint;

std::string bytes_text(int64_t n) {
  char buf[32];
  if (n >= (int64_t{1} << 30)) {
    std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(n) / (1 << 30));
  } else if (n >= (1 << 20)) {
    std::snprintf(buf, sizeof buf, "%.1f MiB", static_cast<double>(n) / (1 << 20));
  } else {
    std::snprintf(buf, sizeof buf, "%lld B", static_cast<long long>(n));
  }
  return buf;
}

/// The commit state of a step directory, in words, and its record when it has one.
std::pair<std::string, std::optional<ckpt::CommitRecord>> commit_state(const fs::path& dir) {
  try {
    const auto record = ckpt::read_commit_record(dir);
    if (!record) return {"NOT committed (a save that failed or is running)", std::nullopt};
    std::string comps;
    for (const auto& c : record->components) comps += (comps.empty() ? "" : "+") + c;
    return {std::string(record->complete ? "committed, complete" : "committed") + " (" + comps + ")", record};
  } catch (const fsdpx::Error& e) {
    return {std::string("UNREADABLE commit record: ") + e.what(), std::nullopt};
  }
}

/// Size and CRC-32C of every file the record lists, read in full; each problem named.
std::vector<std::string> verify_files(const fs::path& dir, const ckpt::CommitRecord& record) {
  std::vector<std::string> problems;
  for (const auto& [name, info] : record.files) {
    const fs::path path = dir / name;
    try {
      const std::vector<char> data = fsdpx::detail::read_file(path, "checkpoint file", info.bytes);
      ckpt::detail::check_committed_bytes(path, "checkpoint file", data, info.bytes, info.crc32c);
      if (const auto parsed = ckpt::parse_shard_file_name(name);
          parsed && parsed->component != ckpt::Component::extra_state) {
        ckpt::load_shard_file(dir, name, record.file(dir, name, true));  // and it parses as what its name says
      }
    } catch (const fsdpx::Error& e) {
      problems.push_back(e.what());
    }
  }
  return problems;
}

void print_tensors(const fs::path& dir, const ckpt::CommitRecord& record) {
  struct Tensor {
    std::vector<int64_t> shape;
    std::string dtype;
    int64_t elements = 0;
    int64_t bytes = 0;
  };
  std::map<std::string, Tensor> tensors;
  for (int r = 0; r < record.world_size; ++r) {
    const std::string name = ckpt::shard_file_name(ckpt::Component::model, record.world_size, r);
    const auto sd = ckpt::load_shard_file(dir, name, record.file(dir, name, true));
    for (const auto& e : sd.entries) {
      Tensor& t = tensors[e.name];
      const at::Tensor& data = e.tensors.at("data");
      t.shape = e.shape;
      t.dtype = c10::toString(data.scalar_type());
      t.elements += e.end - e.begin;
      t.bytes += data.nbytes();
    }
  }
  int64_t elements = 0, bytes = 0;
  std::cout << "  model tensors (" << tensors.size() << "):\n";
  for (const auto& [name, t] : tensors) {
    std::cout << "    " << name << "  " << c10::IntArrayRef(t.shape) << "  " << t.dtype << "\n";
    elements += t.elements;
    bytes += t.bytes;
  }
  std::cout << "  " << elements << " elements, " << bytes_text(bytes) << " of model data over " << record.world_size
            << " files\n";
}

/// A PyTorch Distributed Checkpoint folder: its entries, files and bytes; with `verify`, every tensor read
/// whole and every bytes entry decoded (DCP records no checksums: what is checked is each chunk's place in
/// its file, its archive, dtype and shape, not its values). Returns the exit code.
int inspect_dcp(const fs::path& dir, bool tensors, bool verify) {
  const fsdpx::dcp::Reader reader(dir);  // .metadata read and validated: an IoError naming the cause otherwise
  const fsdpx::dcp::Metadata& md = reader.metadata();
  std::map<std::string, int64_t> files;
  for (const auto& [key, info] : md.storage) files[info.relative_path] += info.length;
  int64_t n_tensors = 0, n_chunks = 0;
  for (const auto& [fqn, entry] : md.entries) {
    if (const auto* t = std::get_if<fsdpx::dcp::TensorEntry>(&entry)) {
      ++n_tensors;
      n_chunks += static_cast<int64_t>(t->chunks.size());
      if (tensors)
        std::cout << "    " << fqn << "  " << c10::IntArrayRef(t->size) << "  " << c10::toString(t->dtype) << "  "
                  << t->chunks.size() << (t->chunks.size() == 1 ? " chunk" : " chunks") << "\n";
    } else if (tensors) {
      std::cout << "    " << fqn << "  (bytes)\n";
    }
  }
  std::cout << "PyTorch Distributed Checkpoint " << dir.string() << " (version " << md.version.value_or("none")
            << "): " << n_tensors << " tensors in " << n_chunks << " chunks, "
            << md.entries.size() - static_cast<size_t>(n_tensors) << " bytes entries, " << files.size()
            << " data files\n";
  for (const auto& [file, bytes] : files) std::cout << "  " << file << "  " << bytes << " bytes referenced\n";
  if (!verify) return 0;
  std::vector<std::string> problems;
  for (const auto& [fqn, entry] : md.entries) {
    try {
      if (std::holds_alternative<fsdpx::dcp::TensorEntry>(entry)) reader.read(fqn);
      else reader.read_bytes(fqn);
    } catch (const std::exception& e) {
      problems.push_back(e.what());
    }
  }
  if (problems.empty()) {
    std::cout << "  verify: every chunk and bytes entry reads and matches .metadata (" << md.storage.size()
              << " records; DCP keeps no checksums of the values)\n";
    return 0;
  }
  for (const auto& p : problems) std::cerr << "fsdpx-inspect: " << p << "\n";
  std::cerr << "fsdpx-inspect: " << problems.size() << " of " << md.entries.size() << " entries are damaged\n";
  return 1;
}

int run(int argc, char** argv) {
  std::string root;
  std::optional<int64_t> step;
  bool tensors = false, verify = false;
  CLI::App app{
      "fsdpx-inspect: the steps of an fsdpx checkpoint root, their commit state and files; --verify checks them"};
  app.add_option("root", root, "checkpoint root (holding global_step_<N> directories)")
      ->required()
      ->check(CLI::ExistingDirectory);
  app.add_option("--step", step, "one step: its files (and --tensors: its model's tensors)");
  app.add_flag("--tensors", tensors, "list the model's tensors: name, shape, dtype");
  app.add_flag("--verify", verify,
               "check every committed file's size and CRC-32C against its commit record (exit 1 on any problem)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  if (fsdpx::dcp::is_checkpoint(root)) {
    FSDPX_CHECK(!step, "--step applies to an fsdpx checkpoint root, not to a DCP folder");
    return inspect_dcp(root, tensors, verify);
  }
  std::cout << "checkpoint root " << root << "\n";
  const auto steps = ckpt::list_steps(root);
  std::vector<std::string> problems;
  for (const char* file : {ckpt::checkpointed_iteration_file, ckpt::state_dict_iteration_file}) {
    const fs::path path = fs::path(root) / file;
    try {
      const auto s = ckpt::read_iteration_file(path);
      std::cout << "  " << file << " -> " << (s ? "step " + std::to_string(*s) : std::string("(none)")) << "\n";
      // A resume follows the iteration file: a step it names must be there, committed.
      if (verify && s) {
        const auto named = std::find_if(steps.begin(), steps.end(), [&](const auto& st) { return st.step == *s; });
        if (named == steps.end()) {
          problems.push_back(fsdpx::detail::str("'", path.string(), "' names step ", *s, ", which has no global_step_",
                                                *s, " directory"));
        } else if (!commit_state(named->path / "actor").second) {
          problems.push_back(
              fsdpx::detail::str("'", path.string(), "' names step ", *s, ", which has no readable commit record"));
        }
      }
    } catch (const fsdpx::Error& e) {
      std::cout << "  " << file << ": " << e.what() << "\n";
      if (verify) problems.push_back(e.what());
    }
  }
  if (steps.empty()) std::cout << "  no global_step_<N> directories\n";
  bool found = !step.has_value();
  for (const auto& s : steps) {
    if (step && s.step != *step) continue;
    found = true;
    const fs::path dir = s.path / "actor";
    const auto [state, record] = commit_state(dir);
    std::cout << "step " << s.step << ": " << state;
    if (record) {
      std::cout << "; world size " << record->world_size;
      if (record->mesh_shard) std::cout << ", shard groups of " << *record->mesh_shard;
      if (!record->kind.empty()) std::cout << ", " << record->kind << " state dicts";
    }
    std::cout << "; " << bytes_text(ckpt::directory_bytes(s.path))
              << (ckpt::is_leased(s.path) ? "; leased by a reader" : "") << "\n";
    if (step && record) {
      for (const auto& [name, info] : record->files) {
        std::cout << "    " << name << "  " << bytes_text(info.bytes);
        if (info.crc32c) std::cout << "  crc32c " << *info.crc32c;
        std::cout << "\n";
      }
      if (tensors) print_tensors(dir, *record);
    }
    if (verify && !record && state.rfind("UNREADABLE", 0) == 0)
      problems.push_back("step " + std::to_string(s.step) + ": " + state);
    if (verify && record) {
      const auto found_problems = verify_files(dir, *record);
      std::cout << "  verify: "
                << (found_problems.empty() ? "every file intact (" + std::to_string(record->files.size()) + ")"
                                           : "PROBLEMS")
                << "\n";
      for (const auto& p : found_problems) std::cout << "    " << p << "\n";
      problems.insert(problems.end(), found_problems.begin(), found_problems.end());
    }
  }
  FSDPX_CHECK_AS(fsdpx::IoError, found, "'", root, "' has no step ", step.value_or(-1));
  if (verify && !problems.empty()) {
    std::cerr << "fsdpx-inspect: " << problems.size() << " problem(s) found:\n";
    for (const auto& p : problems) std::cerr << "  " << p << "\n";
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << e.what() << "\n";  // fsdpx's errors say "fsdpx: " and name the file
    return 1;
  }
}

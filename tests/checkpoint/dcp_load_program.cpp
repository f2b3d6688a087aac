// The C++ side of python_dcp_reader_test.py: PyTorch Distributed Checkpoints read by fsdpx.
//   fsdpx_dcp_load_program model <dcp dir> <reference.pt> [--prefix P]     (under mpiexec, any world size)
//       loads the checkpoint into the checkpoint tests' ResMlp (Fsdp, FullShard) with each rank reading the
//       chunks that overlap its shards, and requires its full state dict to equal, bit for bit, the tensors
//       of reference.pt (a dict name -> tensor that Python torch.save'd); prints what each rank read
//   fsdpx_dcp_load_program resume <dcp dir> <reference.pt>    the same through load_checkpoint (prints the step)
//   fsdpx_dcp_load_program read <dcp dir> <fqn> [<begin> <end>]    prints tensor fqn's elements [begin, end)
//   fsdpx_dcp_load_program bytes <dcp dir> <fqn>                   prints bytes entry fqn as JSON
// An error is printed and exits with 1.
#include <cstdio>
#include <iostream>
#include <string>

#include <fsdpx/checkpoint/detail/torch_io.hpp>
#include <fsdpx/checkpoint/resume.hpp>
#include <fsdpx/checkpoint/state_dict.hpp>
#include <fsdpx/core/fsdp.hpp>
#include <fsdpx/dcp.hpp>
#include <fsdpx/detail/json.hpp>
#include <fsdpx/dist/mpi.hpp>

#include "../core/models.hpp"

using namespace fsdpx;
using namespace fsdpx::test;
using fsdpx::detail::Json;

namespace {

/// The checkpoint tests' model (checkpoint_common.hpp's CkptModel<>), which python_dcp_reader_test.py mirrors.
using Model = Fsdp<ResMlp, FullShard, NoOffload, FullPrecision, ShardedStateDict, WrapModules<ResBlockImpl>>;

Json to_json(const c10::IValue& v) {
  if (v.isNone()) return nullptr;
  if (v.isBool()) return v.toBool();
  if (v.isInt()) return v.toInt();
  if (v.isDouble()) return v.toDouble();
  if (v.isString()) return v.toStringRef();
  Json out = Json::array();
  if (v.isList()) {
    for (const c10::IValue& e : v.toListRef()) out.push_back(to_json(e));
  } else if (v.isTuple()) {
    for (const c10::IValue& e : v.toTupleRef().elements()) out.push_back(to_json(e));
  } else {
    out = Json::object();
    for (const auto& item : v.toGenericDict()) {
      const c10::IValue& k = item.key();
      out[k.isString() ? k.toStringRef() : to_json(k).dump()] = to_json(item.value());
    }
  }
  return out;
}

int load_model(const std::string& dir, const std::string& reference, const std::string& prefix, bool resume) {
  auto mpi = dist::MpiCommunicator::world();
  dist::AnyCommunicator world(mpi);
  torch::manual_seed(1234);  // every rank builds the same values, which the load replaces
  Model model(ResMlp(), world);
  const dcp::Reader reader(dir);
  if (resume) {  // the resume path: load_checkpoint recognises the folder by its .metadata
    const auto info = load_checkpoint(model, dir);
    if (world.rank() == 0) std::printf("resumed step %lld\n", static_cast<long long>(info.value().step));
  } else {
    dcp::load_model(model, reader, {.prefix = prefix});
  }
  int64_t chunks = 0;
  for (const auto& [fqn, entry] : reader.metadata().entries) {
    if (const auto* t = std::get_if<dcp::TensorEntry>(&entry)) chunks += static_cast<int64_t>(t->chunks.size());
  }
  std::printf("rank %d of %d read %lld of %lld chunks (%lld bytes)\n", world.rank(), world.size(),
              static_cast<long long>(reader.chunks_read()), static_cast<long long>(chunks),
              static_cast<long long>(reader.bytes_read()));
  // Each rank reads only what overlaps its shards: with several ranks, none reads every chunk.
  int ok = world.size() == 1 || reader.chunks_read() < chunks ? 1 : 0;
  if (ok == 0) std::printf("rank %d read every chunk\n", world.rank());
  const StateDict full = full_state_dict(model.sharded());
  if (world.rank() == 0) {
    const auto want = checkpoint::detail::load_ivalue(reference).toGenericDict();
    size_t compared = 0;
    for (const TensorSlice& e : full.entries) {
      const auto it = want.find(e.name);
      const bool same = it != want.end() && it->value().toTensor().sizes() == c10::IntArrayRef(e.shape) &&
                        it->value().toTensor().scalar_type() == e.data().scalar_type() &&
                        at::equal(it->value().toTensor(), e.data());
      if (!same) std::printf("differs: %s\n", e.name.c_str());
      ok = same ? ok : 0;
      compared += same ? 1 : 0;
    }
    if (compared != want.size()) ok = 0;
    std::printf("%s: %zu of %zu tensors bit-equal to the reference\n", ok != 0 ? "equal" : "NOT equal", compared,
                want.size());
  }
  at::Tensor flag = at::full({1}, ok, at::kInt);
  world.all_reduce(flag, dist::ReduceOp::min);
  return flag.item<int>() == 1 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  try {
    if (mode == "model" && (argc == 4 || (argc == 6 && std::string(argv[4]) == "--prefix"))) {
      return load_model(argv[2], argv[3], argc == 6 ? argv[5] : "", false);
    }
    if (mode == "resume" && argc == 4) return load_model(argv[2], argv[3], "", true);
    if (mode == "read" && (argc == 4 || argc == 6)) {
      const dcp::Reader reader(argv[2]);
      const at::Tensor t = argc == 6 ? reader.read(argv[3], std::stoll(argv[4]), std::stoll(argv[5]))
                                     : reader.read(argv[3]).reshape({-1});
      const at::Tensor d = t.to(at::kDouble).contiguous();
      std::cout << Json(std::vector<double>(d.data_ptr<double>(), d.data_ptr<double>() + d.numel())).dump() << "\n";
      return 0;
    }
    if (mode == "bytes" && argc == 4) {
      std::cout << to_json(dcp::Reader(argv[2]).read_bytes(argv[3])).dump() << "\n";
      return 0;
    }
  } catch (const std::exception& e) {
    std::cerr << e.what() << "\n";
    return 1;
  }
  std::cerr << "usage: fsdpx_dcp_load_program model <dir> <reference.pt> [--prefix P] | resume <dir> <reference.pt> | "
               "read <dir> <fqn> [<begin> "
               "<end>] | bytes <dir> <fqn>\n";
  return 2;
}

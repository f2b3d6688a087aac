// The checkpoint tests' per-test roots under mpiexec: emptied by rank 0 while the other ranks wait.
#pragma once

#include <filesystem>
#include <string>

#include <fsdpx/dist/any.hpp>

#include "../support/mpi_world.hpp"
#include "checkpoint_common.hpp"

namespace fsdpx::test {

inline dist::AnyCommunicator any_world() { return dist::AnyCommunicator(world()); }

/// Rank 0 empties `<scratch>/<name>_np<world size>`; everyone waits for it.
inline std::filesystem::path fresh_dir(const std::string& name) {
  const std::filesystem::path dir = scratch_dir(name + "_np" + std::to_string(world().size()));
  world().barrier();  // nobody still reads the previous section's files
  if (world().rank() == 0) {
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
  }
  world().barrier();
  return dir;
}

}  // namespace fsdpx::test

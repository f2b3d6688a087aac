// The MPI world shared by the test cases of one multi-process test executable.
#pragma once

#include <fsdpx/dist/mpi.hpp>

namespace fsdpx::test {
fsdpx::dist::MpiCommunicator& world();
}  // namespace fsdpx::test

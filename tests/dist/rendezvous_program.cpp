// TCP rendezvous under any launcher that sets MASTER_ADDR/MASTER_PORT (torchrun, or mpiexec with
// them exported).  exchange: rank 0's bytes reach every rank, barriers pass.  timeout: a world that
// never fills fails with TimeoutError naming the endpoint.
#include <cstdio>
#include <string>
#include <vector>

#include <fsdpx/dist/rendezvous.hpp>

#include "../support/expect.hpp"

using namespace fsdpx;

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "exchange";
  const auto env = dist::detect_launch_env();
  if (mode == "timeout") {
    return test::expect_error<TimeoutError>([&] { dist::Rendezvous rv(env, std::chrono::milliseconds(2000)); },
                                            {"rendezvous connect at 127.0.0.1:", "within 2000 ms"});
  }
  dist::Rendezvous rv(env, std::chrono::seconds(60));
  for (int round = 0; round < 3; ++round) {
    std::vector<std::uint8_t> mine;
    std::vector<std::uint8_t> want(128);
    for (size_t i = 0; i < want.size(); ++i) want[i] = static_cast<std::uint8_t>(i * 7 + round);
    if (env.rank == 0) mine = want;
    const auto got = rv.broadcast("blob", mine);
    if (got != want) {
      std::fprintf(stderr, "rank %d round %d: wrong bytes from the store\n", env.rank, round);
      return 1;
    }
    rv.barrier("round");
  }
  std::printf("rank %d of %d (%s): rendezvous ok\n", env.rank, env.world_size,
              std::string(dist::to_string(env.launcher)).c_str());
  return 0;
}

// Launcher environments: torchrun, Open MPI, PMI, SLURM, and their errors.
#include <catch2/catch.hpp>

#include <map>

#include <fsdpx/dist/env.hpp>

using namespace fsdpx::dist;
using Catch::Matchers::Contains;

namespace {
EnvLookup fake(std::map<std::string, std::string> vars) {
  return [vars = std::move(vars)](std::string_view name) -> std::optional<std::string> {
    if (auto it = vars.find(std::string(name)); it != vars.end()) return it->second;
    return std::nullopt;
  };
}
}  // namespace

TEST_CASE("no launcher variables: a single process", "[env]") {
  const auto env = detect_launch_env(fake({}));
  CHECK(env.launcher == Launcher::single_process);
  CHECK(env.rank == 0);
  CHECK(env.world_size == 1);
  CHECK_THROWS_WITH(env.require_rendezvous(), Contains("MASTER_ADDR and MASTER_PORT"));
}

TEST_CASE("torchrun", "[env]") {
  const auto env = detect_launch_env(fake({{"RANK", "3"},
                                           {"WORLD_SIZE", "8"},
                                           {"LOCAL_RANK", "1"},
                                           {"LOCAL_WORLD_SIZE", "2"},
                                           {"MASTER_ADDR", "10.1.2.3"},
                                           {"MASTER_PORT", "29500"},
                                           {"TORCHELASTIC_RUN_ID", "x"}}));
  CHECK(env.launcher == Launcher::torchrun);
  CHECK(env.rank == 3);
  CHECK(env.world_size == 8);
  CHECK(env.local_rank == 1);
  CHECK(env.local_world_size == 2);
  CHECK(env.master_addr == "10.1.2.3");
  CHECK(env.master_port == 29500);
}

TEST_CASE("Open MPI's mpirun", "[env]") {
  const auto env = detect_launch_env(fake({{"OMPI_COMM_WORLD_RANK", "2"},
                                           {"OMPI_COMM_WORLD_SIZE", "4"},
                                           {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                                           {"OMPI_COMM_WORLD_LOCAL_SIZE", "1"}}));
  CHECK(env.launcher == Launcher::open_mpi);
  CHECK(env.rank == 2);
  CHECK(env.world_size == 4);
  CHECK(env.local_rank == 0);
  CHECK(env.master_port == 0);
}

TEST_CASE("MPICH / Intel MPI hydra", "[env]") {
  const auto env = detect_launch_env(fake({{"PMI_RANK", "1"}, {"PMI_SIZE", "2"}}));
  CHECK(env.launcher == Launcher::pmi);
  CHECK(env.rank == 1);
  CHECK(env.local_rank == 1);
}

TEST_CASE("SLURM srun: rank from SLURM_PROCID, rendezvous from the node list", "[env]") {
  const auto env = detect_launch_env(fake({{"SLURM_PROCID", "5"},
                                           {"SLURM_NTASKS", "8"},
                                           {"SLURM_LOCALID", "1"},
                                           {"SLURM_NTASKS_PER_NODE", "4(x2)"},
                                           {"SLURM_STEP_ID", "0"},
                                           {"SLURM_STEP_NODELIST", "gpu[007-008]"}}));
  CHECK(env.launcher == Launcher::slurm);
  CHECK(env.rank == 5);
  CHECK(env.world_size == 8);
  CHECK(env.local_rank == 1);
  CHECK(env.local_world_size == 4);
  CHECK(env.master_addr == "gpu007");
  CHECK(env.master_port == 29500);
}

TEST_CASE("SLURM batch-step variables do not override mpirun's", "[env]") {
  // Inside sbatch, SLURM_PROCID=0 is inherited by every rank mpirun starts; without SLURM_STEP_ID it is ignored.
  const auto env = detect_launch_env(fake(
      {{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}, {"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "4"}}));
  CHECK(env.launcher == Launcher::open_mpi);
  CHECK(env.rank == 3);
}

TEST_CASE("SLURM host lists", "[env]") {
  CHECK(fsdpx::dist::detail::first_slurm_host("node1") == "node1");
  CHECK(fsdpx::dist::detail::first_slurm_host("node1,node2") == "node1");
  CHECK(fsdpx::dist::detail::first_slurm_host("gpu[003-006,9],cpu1") == "gpu003");
  CHECK(fsdpx::dist::detail::first_slurm_host("rack[2,4]-n[1-2]") == "rack2-n[1-2]");
  CHECK_THROWS_WITH(fsdpx::dist::detail::first_slurm_host("gpu[003"), Contains("cannot parse SLURM node list"));
}

TEST_CASE("missing, malformed and contradictory variables name themselves", "[env][errors]") {
  CHECK_THROWS_AS(detect_launch_env(fake({{"RANK", "0"}})), fsdpx::ConfigError);
  CHECK_THROWS_WITH(detect_launch_env(fake({{"RANK", "0"}})), Contains("RANK is set but WORLD_SIZE is missing"));
  CHECK_THROWS_WITH(detect_launch_env(fake({{"WORLD_SIZE", "2"}})), Contains("WORLD_SIZE is set but RANK is missing"));
  CHECK_THROWS_WITH(detect_launch_env(fake({{"RANK", "x1"}, {"WORLD_SIZE", "2"}})),
                    Contains("RANK='x1' is not an integer"));
  CHECK_THROWS_WITH(
      detect_launch_env(fake({{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}})),
      Contains("RANK=2 is not below WORLD_SIZE=2"));
  CHECK_THROWS_WITH(detect_launch_env(fake({{"RANK", "0"}, {"WORLD_SIZE", "0"}})),
                    Contains("WORLD_SIZE='0' is not an integer >= 1"));
  CHECK_THROWS_WITH(detect_launch_env(fake({{"RANK", "1"}, {"WORLD_SIZE", "2"}})),
                    Contains("MASTER_ADDR and MASTER_PORT"));
  CHECK_THROWS_WITH(
      detect_launch_env(fake({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "70000"}})),
      Contains("MASTER_PORT=70000 is not a TCP port"));
  CHECK_THROWS_WITH(detect_launch_env(fake({{"RANK", "1"},
                                            {"WORLD_SIZE", "4"},
                                            {"OMPI_COMM_WORLD_RANK", "2"},
                                            {"OMPI_COMM_WORLD_SIZE", "4"},
                                            {"MASTER_ADDR", "h"},
                                            {"MASTER_PORT", "1"}})),
                    Contains("RANK=1 contradicts OMPI_COMM_WORLD_RANK=2"));
  CHECK_THROWS_WITH(detect_launch_env(fake({{"RANK", "1"},
                                            {"WORLD_SIZE", "4"},
                                            {"OMPI_COMM_WORLD_RANK", "1"},
                                            {"OMPI_COMM_WORLD_SIZE", "2"},
                                            {"MASTER_ADDR", "h"},
                                            {"MASTER_PORT", "1"}})),
                    Contains("WORLD_SIZE=4 contradicts OMPI_COMM_WORLD_SIZE=2"));
  CHECK_THROWS_WITH(detect_launch_env(fake({{"RANK", "1"},
                                            {"WORLD_SIZE", "4"},
                                            {"LOCAL_RANK", "3"},
                                            {"LOCAL_WORLD_SIZE", "2"},
                                            {"MASTER_ADDR", "h"},
                                            {"MASTER_PORT", "1"}})),
                    Contains("LOCAL_RANK=3 is not below LOCAL_WORLD_SIZE=2"));
}

TEST_CASE("a launcher MPI does not agree with is named with what to do about it", "[env]") {
  using fsdpx::dist::Launcher;
  using fsdpx::dist::launcher_mismatch_hint;
  CHECK_THAT(launcher_mismatch_hint(Launcher::slurm),
             Catch::Contains("srun --mpi=pmix") && !Catch::Contains("torchrun"));
  CHECK_THAT(launcher_mismatch_hint(Launcher::torchrun), Catch::Contains("NCCL"));
  CHECK_THAT(launcher_mismatch_hint(Launcher::open_mpi), Catch::Contains("one launcher"));
}

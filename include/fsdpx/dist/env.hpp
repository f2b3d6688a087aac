// Launcher environment: which launcher started this process, and this process's place in the job.
//
// Precedence: torchrun-style variables (RANK, WORLD_SIZE, ...), then Open MPI's mpirun
// (OMPI_COMM_WORLD_*), then MPICH/Intel MPI hydra (PMI_*), then SLURM srun (SLURM_PROCID, ...).
// Variables of two launchers that disagree about rank or world size are an error naming both.
#pragma once

#include <cstdlib>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <fsdpx/dist/types.hpp>
#include <fsdpx/error.hpp>

namespace fsdpx::dist {

enum class Launcher { single_process, torchrun, open_mpi, pmi, slurm };

constexpr std::string_view to_string(Launcher l) {
  switch (l) {
    case Launcher::single_process: return "single process";
    case Launcher::torchrun: return "torchrun";
    case Launcher::open_mpi: return "mpirun (Open MPI)";
    case Launcher::pmi: return "mpiexec (PMI)";
    case Launcher::slurm: return "srun (SLURM)";
  }
  return "?";
}

struct LaunchEnv {
  Launcher launcher = Launcher::single_process;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  /// Rendezvous endpoint for a TCP store (NCCL bootstrap); empty / 0 when the launcher gave none.
  std::string master_addr;
  int master_port = 0;

  /// Throws ConfigError naming what is missing when there is no rendezvous endpoint.
  /// Whether MASTER_ADDR and MASTER_PORT name a TCP rendezvous.
  bool has_rendezvous() const { return !master_addr.empty() && master_port > 0; }

  void require_rendezvous() const {
    FSDPX_CHECK(has_rendezvous(), "a TCP rendezvous needs MASTER_ADDR and MASTER_PORT (", to_string(launcher),
                " launch, rank ", rank, " of ", world_size, ", MASTER_ADDR='", master_addr,
                "', MASTER_PORT=", master_port, "); torchrun sets both, under mpirun or srun export them");
  }
};

/// Looks up one environment variable; tests pass their own.
using EnvLookup = std::function<std::optional<std::string>(std::string_view)>;

inline std::optional<std::string> process_env(std::string_view name) {
  if (const char* v = std::getenv(std::string(name).c_str()); v != nullptr) return std::string(v);
  return std::nullopt;
}

namespace detail {

inline int parse_env_int(std::string_view name, const std::string& value, int min_value) {
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(value.c_str(), &end, 10);
  FSDPX_CHECK(!value.empty() && end != nullptr && *end == '\0' && errno == 0 && v >= min_value && v <= 1 << 30,
              "environment variable ", name, "='", value, "' is not an integer >= ", min_value);
  return static_cast<int>(v);
}

/// First host of a SLURM hostlist: "gpu[003-006,9],cpu1" -> "gpu003".
inline std::string first_slurm_host(std::string_view list) {
  const auto end = list.find_first_of(",[");
  if (end == std::string_view::npos || list[end] == ',') return std::string(list.substr(0, end));
  const auto close = list.find(']', end);
  FSDPX_CHECK(close != std::string_view::npos, "cannot parse SLURM node list '", list, "'");
  const auto ranges = list.substr(end + 1, close - end - 1);
  const auto first = ranges.substr(0, ranges.find_first_of(",-"));
  const auto rest = list.substr(close + 1);
  return std::string(list.substr(0, end)) + std::string(first) + std::string(rest.substr(0, rest.find(',')));
}

/// The variables one launcher sets for rank, size, local rank and local size.
struct LauncherVars {
  Launcher launcher;
  std::string_view rank, size, local_rank, local_size;
};

inline constexpr LauncherVars launcher_vars[] = {
    {Launcher::torchrun, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"},
    {Launcher::open_mpi, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"},
    {Launcher::pmi, "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"},
    {Launcher::slurm, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"},
};

}  // namespace detail

/// What to do when the launcher's variables and MPI disagree about the ranks (MpiCommunicator::world()).
inline std::string launcher_mismatch_hint(Launcher launcher) {
  switch (launcher) {
    case Launcher::slurm:
      return "srun started these processes, but MPI did not join them into one job (each one is a world of its "
             "own): give srun the PMI plugin your MPI was built with, e.g. srun --mpi=pmix (srun --mpi=list shows "
             "them), or start the ranks with mpirun inside the allocation";
    case Launcher::torchrun:
      return "torchrun started these processes, and the MPI backend cannot join a torchrun job: use the NCCL "
             "backend there, or start the ranks with mpirun or mpiexec";
    default:
      return "start every rank with one launcher (mpirun, mpiexec, or srun with its MPI plugin), and do not set "
             "another launcher's variables (RANK, WORLD_SIZE) by hand";
  }
}

/// Reads the launcher's variables. Missing, malformed or contradictory ones throw ConfigError naming them.
inline LaunchEnv detect_launch_env(const EnvLookup& env = process_env) {
  using detail::parse_env_int;
  struct Found {
    const detail::LauncherVars* vars;
    int rank, size;
  };
  std::vector<Found> found;
  for (const auto& v : detail::launcher_vars) {
    const auto rank = env(v.rank);
    const auto size = env(v.size);
    // Inside an sbatch script SLURM_PROCID is set for the batch step too; it only names this
    // process's rank when srun started the step (SLURM_STEP_ID present).
    if (v.launcher == Launcher::slurm && !env("SLURM_STEP_ID")) continue;
    if (!rank && !size) continue;
    FSDPX_CHECK(rank && size, "incomplete ", to_string(v.launcher), " environment: ", rank ? v.rank : v.size,
                " is set but ", rank ? v.size : v.rank,
                " is missing (when launching by hand set RANK, "
                "WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT)");
    found.push_back({&v, parse_env_int(v.rank, *rank, 0), parse_env_int(v.size, *size, 1)});
  }

  LaunchEnv out;
  if (found.empty()) return out;
  const Found& primary = found.front();
  for (const Found& other : found) {
    // A job step's SLURM variables describe the allocation when mpirun or torchrun start the ranks.
    if (other.vars->launcher == Launcher::slurm && &other != &primary) continue;
    FSDPX_CHECK(other.rank == primary.rank, primary.vars->rank, "=", primary.rank, " contradicts ", other.vars->rank,
                "=", other.rank, ": two launchers disagree about this process's rank");
    FSDPX_CHECK(other.size == primary.size, primary.vars->size, "=", primary.size, " contradicts ", other.vars->size,
                "=", other.size, ": two launchers disagree about the world size");
  }
  const auto& v = *primary.vars;
  out.launcher = v.launcher;
  out.rank = primary.rank;
  out.world_size = primary.size;
  FSDPX_CHECK(out.rank < out.world_size, v.rank, "=", out.rank, " is not below ", v.size, "=", out.world_size);

  out.local_rank = out.rank;
  out.local_world_size = out.world_size;
  if (const auto lr = env(v.local_rank)) out.local_rank = parse_env_int(v.local_rank, *lr, 0);
  if (const auto ls = env(v.local_size)) {
    // SLURM_NTASKS_PER_NODE may read "4(x2)": the leading count is this node's.
    const std::string count = ls->substr(0, ls->find('('));
    out.local_world_size = parse_env_int(v.local_size, count, 1);
  }
  FSDPX_CHECK(out.local_rank < out.local_world_size, v.local_rank, "=", out.local_rank, " is not below ", v.local_size,
              "=", out.local_world_size);

  if (const auto addr = env("MASTER_ADDR"); addr && !addr->empty()) {
    out.master_addr = *addr;
  } else if (v.launcher == Launcher::slurm) {
    const auto nodes = env("SLURM_STEP_NODELIST") ? env("SLURM_STEP_NODELIST") : env("SLURM_JOB_NODELIST");
    if (nodes) out.master_addr = detail::first_slurm_host(*nodes);
  }
  if (const auto port = env("MASTER_PORT"); port && !port->empty()) {
    out.master_port = parse_env_int("MASTER_PORT", *port, 1);
    FSDPX_CHECK(out.master_port <= 65535, "MASTER_PORT=", out.master_port, " is not a TCP port");
  } else if (v.launcher == Launcher::slurm) {
    out.master_port = 29500;  // torchrun's default, so srun and torchrun jobs agree
  }
  if (v.launcher == Launcher::torchrun && out.world_size > 1) out.require_rendezvous();
  return out;
}

}  // namespace fsdpx::dist

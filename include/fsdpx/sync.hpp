// Weight sync for RL post-training: the trainer's weights to rollout workers, by broadcast (MPI on
// CPUs, NCCL on GPUs), through a versioned in-memory hand-off, in-process or as a TCP service, or by
// following the checkpoints a trainer commits (CheckpointWatcher).
// The TCP service is not in here (nor in <fsdpx/fsdp.hpp>): it compiles Boost.Asio's networking and
// OpenSSL, so it is a header and a CMake component of its own: <fsdpx/sync/service.hpp>, fsdpx::sync_service.
// See docs/sync.md.
#pragma once

#include <fsdpx/sync/weights.hpp>
#include <fsdpx/sync/load.hpp>
#include <fsdpx/sync/manifest.hpp>
#include <fsdpx/sync/delta.hpp>
#include <fsdpx/sync/broadcast.hpp>
#include <fsdpx/sync/synchronizer.hpp>
#include <fsdpx/sync/watcher.hpp>
#include <fsdpx/sync/compat.hpp>  // the names made internal in 2026-11, deprecated

// Weight sync for RL post-training: the trainer's weights to rollout workers, by broadcast (MPI on
// CPUs, NCCL on GPUs), through a versioned in-memory hand-off, in-process or as a TCP service, or by
// following the checkpoints a trainer commits (CheckpointWatcher).
// See docs/sync.md.
#pragma once

#include <fsdpx/sync/bucket.hpp>
#include <fsdpx/sync/delta.hpp>
#include <fsdpx/sync/broadcast.hpp>
#include <fsdpx/sync/synchronizer.hpp>
#include <fsdpx/sync/watcher.hpp>
#if defined(FSDPX_WITH_BOOST) && defined(FSDPX_WITH_OPENSSL)  // the TCP service: Asio and libcrypto
#include <fsdpx/sync/service.hpp>
#endif

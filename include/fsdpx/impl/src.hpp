// The separately compiled part of fsdpx: include this in exactly one source file of a program whose
// every translation unit defines FSDPX_SEPARATE_COMPILATION (fsdpx/detail/config.hpp). CMake: link
// fsdpx::separate instead (in fsdpx's own build) or a library made by fsdpx_add_separate_library(<name>)
// (an installed fsdpx's CMake package): it compiles this file and defines the macro for its users.
#pragma once

#if !defined(FSDPX_SEPARATE_COMPILATION)
#error \
    "fsdpx/impl/src.hpp is the separately compiled part of fsdpx: define FSDPX_SEPARATE_COMPILATION for every translation unit of the program (or link fsdpx::separate), or do not include this file (fsdpx is header-only by default)"
#endif

#include <fsdpx/detail/impl/file_io.ipp>
#if defined(FSDPX_WITH_MPI)  // the MPI backend (its control channel, engine and runtime with it)
#include <fsdpx/dist/impl/mpi.ipp>
#endif
#if defined(FSDPX_WITH_NCCL)  // the NCCL backend (its communicator state and watchdog with it)
#include <fsdpx/dist/impl/nccl.ipp>
#endif
#include <fsdpx/dist/impl/rendezvous.ipp>
#include <fsdpx/core/impl/autograd.ipp>
#include <fsdpx/core/impl/storage.ipp>
#include <fsdpx/core/impl/deferred_init.ipp>
#include <fsdpx/core/impl/unit.ipp>
#include <fsdpx/core/impl/sync_batch_norm.ipp>
#include <fsdpx/core/impl/module_precision.ipp>
#include <fsdpx/core/impl/model_plan.ipp>
#include <fsdpx/core/impl/sharded_model.ipp>
#include <fsdpx/hf/impl/model_folder.ipp>
#include <fsdpx/hf/impl/safetensors.ipp>
#include <fsdpx/hf/impl/model_safetensors.ipp>
#include <fsdpx/checkpoint/impl/state_dict.ipp>
#include <fsdpx/checkpoint/impl/archive_reader.ipp>
#include <fsdpx/checkpoint/impl/torch_io.ipp>
#include <fsdpx/checkpoint/impl/format.ipp>
#include <fsdpx/checkpoint/impl/extra_state.ipp>
#include <fsdpx/checkpoint/impl/layout.ipp>
#include <fsdpx/checkpoint/impl/memory_tier.ipp>
#include <fsdpx/checkpoint/impl/merge.ipp>
#include <fsdpx/checkpoint/impl/resume.ipp>
#include <fsdpx/checkpoint/impl/step_format.ipp>
#include <fsdpx/pickle/impl/pickle.ipp>
#include <fsdpx/dcp/impl/metadata_check.ipp>
#include <fsdpx/dcp/impl/metadata_read.ipp>
#include <fsdpx/dcp/impl/metadata_write.ipp>
#include <fsdpx/dcp/impl/plan.ipp>
#include <fsdpx/dcp/impl/reader.ipp>
#include <fsdpx/dcp/impl/writer.ipp>
#include <fsdpx/dcp/impl/state_dict_loader.ipp>
#include <fsdpx/dcp/impl/state_dict_saver.ipp>
#include <fsdpx/dcp/impl/layouts.ipp>
#include <fsdpx/sync/impl/wire.ipp>
#include <fsdpx/sync/impl/bucket.ipp>
#include <fsdpx/sync/impl/receive.ipp>
#include <fsdpx/sync/impl/load.ipp>
#include <fsdpx/sync/impl/manifest.ipp>
#include <fsdpx/sync/impl/version_store.ipp>
#include <fsdpx/sync/impl/held_version.ipp>
#include <fsdpx/sync/impl/broadcast.ipp>
#include <fsdpx/sync/impl/synchronizer.ipp>
#include <fsdpx/sync/impl/watcher.ipp>
#include <fsdpx/models/impl/loss.ipp>
#include <fsdpx/models/impl/packing.ipp>
#if defined(FSDPX_WITH_BOOST)  // the checkpoint coordinator's threads
#include <fsdpx/checkpoint/impl/worker_pool.ipp>
#include <fsdpx/checkpoint/impl/coordinator.ipp>
#endif
#if defined(FSDPX_WITH_SYNC_SERVICE)  // the TCP weight-sync service
#include <fsdpx/sync/impl/client.ipp>
#include <fsdpx/sync/impl/server.ipp>
#endif

// fsdpx: Fully Sharded Data Parallel training for LibTorch. The one header a user includes.
#pragma once

#include <fsdpx/error.hpp>
#include <fsdpx/version.hpp>

#include <fsdpx/policies.hpp>

#include <fsdpx/dist.hpp>

#include <fsdpx/core/deferred_init.hpp>
#include <fsdpx/core/fsdp.hpp>
#include <fsdpx/core/lr_schedule.hpp>
#include <fsdpx/core/memory.hpp>
#include <fsdpx/core/optim.hpp>
#include <fsdpx/core/progress.hpp>
#include <fsdpx/core/sync_batch_norm.hpp>
#include <fsdpx/core/train_step.hpp>

#include <fsdpx/checkpoint.hpp>
#include <fsdpx/sync.hpp>

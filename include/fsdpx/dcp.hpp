// PyTorch Distributed Checkpoint (torch.distributed.checkpoint, "DCP"), read and written: the checkpoints of
// FSDP2, LightRFT and torchtitan. Not part of <fsdpx/fsdp.hpp>: a program that reads or writes DCP includes
// this header in one of its translation units, which also lets CheckpointCoordinator write
// CheckpointFormat::dcp and load_checkpoint and merge_checkpoint (fsdpx-merge) read such steps.
//
//   fsdpx::dcp::save_model(model, dir);                       // collective; model: an Fsdp<...>
//   fsdpx::dcp::load_model(model, dir);                       // any world size reads any
//   fsdpx::dcp::save_optimizer(model, optimizer, dir / "optim_states");
//   fsdpx::dcp::load_optimizer(model, optimizer, dir / "optim_states");
//
// The room follows torch's package: the `.metadata` (metadata.hpp), the plan that meets fsdpx's flat shards
// with DCP's boxes (plan.hpp), the storage read and written (reader.hpp, writer.hpp), the state-dict loader
// and saver (state_dict_loader.hpp, state_dict_saver.hpp), and the folder layouts fsdpx knows with DCP's
// checkpoint format seam (layouts.hpp). docs/checkpoint.md, "PyTorch Distributed Checkpoint".
#pragma once

#include <fsdpx/dcp/layouts.hpp>
#include <fsdpx/dcp/metadata.hpp>
#include <fsdpx/dcp/options.hpp>
#include <fsdpx/dcp/plan.hpp>
#include <fsdpx/dcp/reader.hpp>
#include <fsdpx/dcp/state_dict_loader.hpp>
#include <fsdpx/dcp/state_dict_saver.hpp>
#include <fsdpx/dcp/writer.hpp>

#include <fsdpx/dcp/compat.hpp>  // the spellings before the DCP room (2026-12), deprecated

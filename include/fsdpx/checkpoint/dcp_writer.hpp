// PyTorch Distributed Checkpoint's writer, as included before DCP had a room of its own (2026-12): now in
// <fsdpx/dcp.hpp> (dcp/writer.hpp,
// dcp/plan.hpp, dcp/state_dict_saver.hpp). Kept one release: it includes <fsdpx/dcp.hpp>, whose old
// spellings (dcp/compat.hpp) compile with deprecation warnings.
#pragma once

#pragma GCC warning "<fsdpx/checkpoint/dcp_writer.hpp> is deprecated: include <fsdpx/dcp.hpp>"

#include <fsdpx/dcp.hpp>

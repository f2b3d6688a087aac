// Deprecated header: the bucket wire format is internal now (sync/detail/bucket.hpp). Including this
// header still brings every name it brought before the rebuild (2026-11), as deprecated spellings
// (sync/compat.hpp), for one release. Include <fsdpx/sync.hpp> instead.
#pragma once

#include <fsdpx/sync/compat.hpp>
#include <fsdpx/sync/load.hpp>
#include <fsdpx/sync/weights.hpp>

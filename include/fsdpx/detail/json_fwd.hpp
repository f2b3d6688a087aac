// The JSON type's name, for declarations: nlohmann/json itself (detail/json.hpp) is included only where
// JSON is read or written, so a translation unit that only declares functions taking it stays cheap.
#pragma once

#include <nlohmann/json_fwd.hpp>

namespace fsdpx::detail {

using Json = nlohmann::json;

}  // namespace fsdpx::detail

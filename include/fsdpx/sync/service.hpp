// The synchronizer as a TCP service (Boost.Asio): the trainer publishes versions to it, rollout
// processes fetch a version newer than theirs, each connection authenticated by a shared secret.
//
//   fsdpx::sync::SynchronizerServer server({.host = "0.0.0.0", .port = 5710, .secret = secret});
//   // trainer rank 0 (or server.publish(...) when the server lives in the trainer process):
//   fsdpx::sync::SynchronizerClient trainer("10.0.0.1", 5710, {.secret = secret});
//   trainer.publish(step, fsdpx::sync::gather_full_state_dict(model, true, {.dtype = at::kBFloat16}));
//   // a rollout process (C++; Python: the fsdpx_sync package in python/):
//   fsdpx::sync::SynchronizerClient rollout("10.0.0.1", 5710, {.secret = secret});
//   have = rollout.fetch_newer_into(*model, have, std::chrono::seconds(60));
//
// The pieces: sync/detail/frame.hpp (the frame codec), sync/detail/auth.hpp (the HMAC handshake),
// sync/server.hpp, sync/client.hpp. docs/sync.md specifies the protocol and its threat model.
#pragma once

#include <fsdpx/sync/client.hpp>
#include <fsdpx/sync/server.hpp>

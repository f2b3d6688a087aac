// Rendezvous through c10d::TCPStore at MASTER_ADDR:MASTER_PORT (rank 0 hosts it), as torchrun does.
// Used to exchange NCCL's unique id when the job was not started by an MPI launcher. The store is
// held out of sight (impl/rendezvous.ipp), so including this header does not compile c10d's.
#pragma once

#include <fsdpx/detail/config.hpp>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <fsdpx/dist/env.hpp>
#include <fsdpx/dist/types.hpp>

namespace fsdpx::dist {

class Rendezvous {
 public:
  /// Rank 0 starts the store and waits for every rank to connect; others connect. Fails with
  /// TimeoutError naming the endpoint when a rank does not arrive within `timeout`.
  FSDPX_DECL explicit Rendezvous(const LaunchEnv& env, std::chrono::milliseconds timeout = default_timeout());

  Rendezvous(const Rendezvous&) = delete;
  Rendezvous& operator=(const Rendezvous&) = delete;
  FSDPX_DECL Rendezvous(Rendezvous&&) noexcept;
  Rendezvous& operator=(Rendezvous&&) = delete;

  /// Every rank says it leaves; rank 0, which hosts the store, then waits (bounded by the timeout)
  /// until all have, so a rank still finishing a barrier or reading a key never finds the server
  /// gone. Not while an exception unwinds: the peers then fail on their own, and must not wait on us.
  FSDPX_DECL ~Rendezvous();

  int rank() const { return env_.rank; }
  int world_size() const { return env_.world_size; }

  /// `root` publishes `value`; every rank returns root's bytes.
  FSDPX_DECL std::vector<std::uint8_t> broadcast(const std::string& key, std::vector<std::uint8_t> value, int root = 0);

  FSDPX_DECL void barrier(const std::string& key);

 private:
  struct Store;  // the c10d::TCPStore

  FSDPX_DECL std::string next_key(const std::string& key);

  /// Runs `fn` (a store call), turning the store's errors into fsdpx's, naming `what` and the endpoint.
  template <class Fn>
  auto guarded(const std::string& what, Fn&& fn) -> decltype(fn());

  LaunchEnv env_;
  std::chrono::milliseconds timeout_;
  std::unique_ptr<Store> store_;
  std::uint64_t sequence_ = 0;
};

}  // namespace fsdpx::dist

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/dist/impl/rendezvous.ipp>
#endif

// Rendezvous through c10d::TCPStore at MASTER_ADDR:MASTER_PORT (rank 0 hosts it), as torchrun does.
// Used to exchange NCCL's unique id when the job was not started by an MPI launcher.
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <string>
#include <thread>
#include <vector>

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <fsdpx/dist/env.hpp>
#include <fsdpx/dist/types.hpp>
#include <fsdpx/error.hpp>

namespace fsdpx::dist {

class Rendezvous {
 public:
  /// Rank 0 starts the store and waits for every rank to connect; others connect. Fails with
  /// TimeoutError naming the endpoint when a rank does not arrive within `timeout`.
  explicit Rendezvous(const LaunchEnv& env, std::chrono::milliseconds timeout = default_timeout())
      : env_(env), timeout_(timeout) {
    env_.require_rendezvous();
    c10d::TCPStoreOptions opts;
    opts.port = static_cast<std::uint16_t>(env_.master_port);
    opts.isServer = env_.rank == 0;
    opts.numWorkers = static_cast<std::size_t>(env_.world_size);
    opts.waitWorkers = true;
    opts.timeout = timeout_;
    guarded("connect", [&] { store_ = c10::make_intrusive<c10d::TCPStore>(env_.master_addr, opts); });
  }

  Rendezvous(const Rendezvous&) = delete;
  Rendezvous& operator=(const Rendezvous&) = delete;
  Rendezvous(Rendezvous&&) noexcept = default;
  Rendezvous& operator=(Rendezvous&&) = delete;

  /// Every rank says it leaves; rank 0, which hosts the store, then waits (bounded by the timeout)
  /// until all have, so a rank still finishing a barrier or reading a key never finds the server
  /// gone. Not while an exception unwinds: the peers then fail on their own, and must not wait on us.
  ~Rendezvous() {
    if (!store_) return;
    try {
      const std::string key = "fsdpx/left";
      if (store_->add(key, 1) < env_.world_size && env_.rank == 0 && std::uncaught_exceptions() == 0) {
        const auto deadline = std::chrono::steady_clock::now() + timeout_;
        while (store_->add(key, 0) < env_.world_size && std::chrono::steady_clock::now() < deadline) {
          std::this_thread::sleep_for(std::chrono::milliseconds(2));
        }
      }
    } catch (...) {
      // A peer already gone: nothing to wait for.
    }
  }

  int rank() const { return env_.rank; }
  int world_size() const { return env_.world_size; }

  /// `root` publishes `value`; every rank returns root's bytes.
  std::vector<std::uint8_t> broadcast(const std::string& key, std::vector<std::uint8_t> value, int root = 0) {
    const std::string k = next_key(key);
    return guarded(detail::str("broadcast '", key, "'"), [&] {
      if (env_.rank == root) store_->set(k, value);
      return store_->get(k);  // waits up to the store's timeout
    });
  }

  void barrier(const std::string& key) {
    const std::string k = next_key(key);
    guarded(detail::str("barrier '", key, "'"), [&] {
      if (store_->add(k, 1) == env_.world_size) store_->set(k + "/done", {1});
      store_->wait({k + "/done"}, timeout_);
    });
  }

 private:
  std::string next_key(const std::string& key) { return detail::str("fsdpx/", key, "/", sequence_++); }

  template <class Fn>
  auto guarded(const std::string& what, Fn&& fn) -> decltype(fn()) {
    const auto where = [&] {
      return detail::str("rendezvous ", what, " at ", env_.master_addr, ":", env_.master_port, " (",
                         to_string(env_.launcher), ", rank ", env_.rank, " of ", env_.world_size, ")");
    };
    try {
      return fn();
    } catch (const c10::DistError& e) {
      // The store retries connections and waits for keys until its timeout: both surface here.
      if (dynamic_cast<const c10::DistBackendError*>(&e) != nullptr) {
        throw CommError(detail::str("fsdpx: ", where(), " failed: ", e.what_without_backtrace()));
      }
      throw TimeoutError(detail::str("fsdpx: ", where(), " did not complete within ", timeout_.count(),
                                     " ms: not every rank arrived (", e.what_without_backtrace(), ")"));
    } catch (const c10::Error& e) {
      throw CommError(detail::str("fsdpx: ", where(), " failed: ", e.what_without_backtrace()));
    }
  }

  LaunchEnv env_;
  std::chrono::milliseconds timeout_;
  c10::intrusive_ptr<c10d::TCPStore> store_;
  std::uint64_t sequence_ = 0;
};

}  // namespace fsdpx::dist

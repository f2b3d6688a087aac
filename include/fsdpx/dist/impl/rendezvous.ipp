// Rendezvous's member functions, out of line: included by fsdpx/dist/rendezvous.hpp (header-only) or
// by fsdpx/impl/src.hpp (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <exception>
#include <thread>

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <fsdpx/dist/rendezvous.hpp>
#include <fsdpx/error.hpp>

namespace fsdpx::dist {

struct Rendezvous::Store {
  c10::intrusive_ptr<c10d::TCPStore> tcp;
};

template <class Fn>
auto Rendezvous::guarded(const std::string& what, Fn&& fn) -> decltype(fn()) {
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

FSDPX_DECL Rendezvous::Rendezvous(const LaunchEnv& env, std::chrono::milliseconds timeout)
    : env_(env), timeout_(timeout), store_(std::make_unique<Store>()) {
  env_.require_rendezvous();
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<std::uint16_t>(env_.master_port);
  opts.isServer = env_.rank == 0;
  opts.numWorkers = static_cast<std::size_t>(env_.world_size);
  opts.waitWorkers = true;
  opts.timeout = timeout_;
  guarded("connect", [&] { store_->tcp = c10::make_intrusive<c10d::TCPStore>(env_.master_addr, opts); });
}

FSDPX_DECL Rendezvous::Rendezvous(Rendezvous&&) noexcept = default;

FSDPX_DECL Rendezvous::~Rendezvous() {
  if (!store_ || !store_->tcp) return;
  auto& store = *store_->tcp;
  try {
    const std::string key = "fsdpx/left";
    if (store.add(key, 1) < env_.world_size && env_.rank == 0 && std::uncaught_exceptions() == 0) {
      const auto deadline = std::chrono::steady_clock::now() + timeout_;
      while (store.add(key, 0) < env_.world_size && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
      }
    }
  } catch (...) {
    // A peer already gone: nothing to wait for.
  }
}

FSDPX_DECL std::vector<std::uint8_t> Rendezvous::broadcast(const std::string& key, std::vector<std::uint8_t> value,
                                                           int root) {
  const std::string k = next_key(key);
  return guarded(detail::str("broadcast '", key, "'"), [&] {
    if (env_.rank == root) store_->tcp->set(k, value);
    return store_->tcp->get(k);  // waits up to the store's timeout
  });
}

FSDPX_DECL void Rendezvous::barrier(const std::string& key) {
  const std::string k = next_key(key);
  guarded(detail::str("barrier '", key, "'"), [&] {
    if (store_->tcp->add(k, 1) == env_.world_size) store_->tcp->set(k + "/done", {1});
    store_->tcp->wait({k + "/done"}, timeout_);
  });
}

FSDPX_DECL std::string Rendezvous::next_key(const std::string& key) {
  return detail::str("fsdpx/", key, "/", sequence_++);
}

}  // namespace fsdpx::dist

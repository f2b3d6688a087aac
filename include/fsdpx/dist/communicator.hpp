// The Communicator concept: the collectives FSDP needs, asynchronous first, with blocking forms.
//
// A communicator is a cheap-to-copy handle (copies share one underlying group). Every collective
// checks its arguments, and an operation that cannot complete within CommOptions::timeout fails with
// fsdpx::TimeoutError naming the operation, communicator, rank and timeout.
#pragma once

#include <concepts>
#include <optional>
#include <string_view>

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <fsdpx/dist/types.hpp>
#include <fsdpx/dist/work.hpp>

namespace fsdpx::dist {

/// Colour to pass to split() by ranks that take no part in the new group.
inline constexpr int no_color = -1;

template <class C>
concept Communicator = std::copy_constructible<C> && requires(C& c, const C& cc, at::Tensor t, const at::Tensor& ct,
                                                              ReduceOp op, int i, at::IntArrayRef splits) {
  { cc.device_type() } -> std::convertible_to<c10::DeviceType>;
  { cc.backend_name() } -> std::convertible_to<std::string_view>;
  { cc.rank() } -> std::same_as<int>;
  { cc.size() } -> std::same_as<int>;
  { cc.name() } -> std::convertible_to<std::string_view>;
  // output (size x n elements) <- every rank's input (n elements), in rank order.
  { c.all_gather_async(t, ct) } -> std::same_as<Work>;
  // On rank `root` only: output (size x n elements) <- every rank's input (n elements), in rank
  // order; other ranks' output is ignored (may be undefined). A root input that is its own slot
  // of the output is in place: that slot is neither read nor written.
  { c.gather_async(t, ct, i) } -> std::same_as<Work>;
  // output (n elements) <- reduction over ranks of input chunk `rank` (input has size x n).
  { c.reduce_scatter_async(t, ct, op) } -> std::same_as<Work>;
  // output (size x n elements): slot c <- rank c's input chunk `rank` (input: size x n, chunk c to rank c).
  { c.all_to_all_async(t, ct) } -> std::same_as<Work>;
  // Along dimension 0: input rows in blocks of input_splits[c], block c to rank c; output rows in
  // blocks of output_splits[c], block c from rank c. output_splits[c] must be what rank c sends
  // here (MPI names a rank that sends otherwise; NCCL cannot tell).
  { c.all_to_all_v_async(t, ct, splits, splits) } -> std::same_as<Work>;
  { c.all_reduce_async(t, op) } -> std::same_as<Work>;
  { c.broadcast_async(t, i) } -> std::same_as<Work>;
  { c.barrier_async() } -> std::same_as<Work>;
  { c.all_gather(t, ct) } -> std::same_as<void>;
  { c.gather(t, ct, i) } -> std::same_as<void>;
  { c.reduce_scatter(t, ct, op) } -> std::same_as<void>;
  { c.all_to_all(t, ct) } -> std::same_as<void>;
  { c.all_to_all_v(t, ct, splits, splits) } -> std::same_as<void>;
  { c.all_reduce(t, op) } -> std::same_as<void>;
  { c.broadcast(t, i) } -> std::same_as<void>;
  { c.barrier() } -> std::same_as<void>;
  // Collective over this communicator; ranks passing no_color get std::nullopt.
  { cc.split(i, i, std::string_view{}) } -> std::same_as<std::optional<C>>;
};

/// Blocking collectives written once in terms of the asynchronous ones (CRTP). Their results are ready
/// in the caller's stream order (Work::wait_stream: on NCCL the host does not wait; reading a result on
/// the host synchronizes); barrier() blocks the host.
template <class Derived>
class BlockingCollectives {
 public:
  void all_gather(at::Tensor output, const at::Tensor& input) {
    self().all_gather_async(std::move(output), input).wait_stream();
  }
  void gather(at::Tensor output, const at::Tensor& input, int root) {
    self().gather_async(std::move(output), input, root).wait_stream();
  }
  void reduce_scatter(at::Tensor output, const at::Tensor& input, ReduceOp op = ReduceOp::sum) {
    self().reduce_scatter_async(std::move(output), input, op).wait_stream();
  }
  void all_to_all(at::Tensor output, const at::Tensor& input) {
    self().all_to_all_async(std::move(output), input).wait_stream();
  }
  void all_to_all_v(at::Tensor output, const at::Tensor& input, at::IntArrayRef output_splits,
                    at::IntArrayRef input_splits) {
    self().all_to_all_v_async(std::move(output), input, output_splits, input_splits).wait_stream();
  }
  void all_reduce(at::Tensor tensor, ReduceOp op = ReduceOp::sum) {
    self().all_reduce_async(std::move(tensor), op).wait_stream();
  }
  void broadcast(at::Tensor tensor, int root) { self().broadcast_async(std::move(tensor), root).wait_stream(); }
  void barrier() { self().barrier_async().wait_host(); }

 private:
  Derived& self() { return static_cast<Derived&>(*this); }
};

}  // namespace fsdpx::dist

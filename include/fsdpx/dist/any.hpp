// AnyCommunicator: any Communicator behind one type, so that code above the communication layer
// (the FSDP core, checkpoints, weight sync) is written once for MPI and NCCL. One virtual call per
// collective is noise next to the collective itself.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include <ATen/core/Tensor.h>

#include <fsdpx/dist/communicator.hpp>

namespace fsdpx::dist {

class AnyCommunicator : public BlockingCollectives<AnyCommunicator> {
 public:
  // Not-self first: checking Communicator<AnyCommunicator> here would recurse into this constructor.
  template <class C>
    requires(!std::same_as<std::remove_cvref_t<C>, AnyCommunicator> && Communicator<C>)
  AnyCommunicator(C comm) : self_(std::make_shared<Model<C>>(std::move(comm))) {}  // NOLINT: implicit on purpose

  c10::DeviceType device_type() const { return self_->device_type(); }
  std::string_view backend_name() const { return self_->backend_name(); }
  int rank() const { return self_->rank(); }
  int size() const { return self_->size(); }
  std::string_view name() const { return self_->name(); }
  /// True after a collective on this communicator failed or timed out, or (MPI) once one of its ranks
  /// left after an error or stopped answering; false for a backend that cannot tell.
  bool is_broken() const { return self_->is_broken(); }

  Work all_gather_async(at::Tensor output, const at::Tensor& input) {
    return self_->all_gather_async(std::move(output), input);
  }
  Work gather_async(at::Tensor output, const at::Tensor& input, int root) {
    return self_->gather_async(std::move(output), input, root);
  }
  Work reduce_scatter_async(at::Tensor output, const at::Tensor& input, ReduceOp op = ReduceOp::sum) {
    return self_->reduce_scatter_async(std::move(output), input, op);
  }
  Work all_to_all_async(at::Tensor output, const at::Tensor& input) {
    return self_->all_to_all_async(std::move(output), input);
  }
  Work all_to_all_v_async(at::Tensor output, const at::Tensor& input, at::IntArrayRef output_splits,
                          at::IntArrayRef input_splits) {
    return self_->all_to_all_v_async(std::move(output), input, output_splits, input_splits);
  }
  Work all_reduce_async(at::Tensor tensor, ReduceOp op = ReduceOp::sum) {
    return self_->all_reduce_async(std::move(tensor), op);
  }
  Work broadcast_async(at::Tensor tensor, int root) { return self_->broadcast_async(std::move(tensor), root); }
  Work barrier_async() { return self_->barrier_async(); }
  std::optional<AnyCommunicator> split(int color, int key, std::string_view name = {}) const {
    return self_->split(color, key, name);
  }

  /// The backend communicator, when it is a `C` (nullptr otherwise).
  template <Communicator C>
  C* get_if() {
    auto* model = dynamic_cast<Model<C>*>(self_.get());
    return model != nullptr ? &model->comm : nullptr;
  }

 private:
  struct Interface {
    virtual ~Interface() = default;
    virtual c10::DeviceType device_type() const = 0;
    virtual std::string_view backend_name() const = 0;
    virtual int rank() const = 0;
    virtual int size() const = 0;
    virtual std::string_view name() const = 0;
    virtual bool is_broken() const = 0;
    virtual Work all_gather_async(at::Tensor, const at::Tensor&) = 0;
    virtual Work gather_async(at::Tensor, const at::Tensor&, int) = 0;
    virtual Work reduce_scatter_async(at::Tensor, const at::Tensor&, ReduceOp) = 0;
    virtual Work all_to_all_async(at::Tensor, const at::Tensor&) = 0;
    virtual Work all_to_all_v_async(at::Tensor, const at::Tensor&, at::IntArrayRef, at::IntArrayRef) = 0;
    virtual Work all_reduce_async(at::Tensor, ReduceOp) = 0;
    virtual Work broadcast_async(at::Tensor, int) = 0;
    virtual Work barrier_async() = 0;
    virtual std::optional<AnyCommunicator> split(int, int, std::string_view) const = 0;
  };

  template <class C>
  struct Model final : Interface {
    explicit Model(C c) : comm(std::move(c)) {}
    c10::DeviceType device_type() const override { return comm.device_type(); }
    std::string_view backend_name() const override { return comm.backend_name(); }
    int rank() const override { return comm.rank(); }
    int size() const override { return comm.size(); }
    std::string_view name() const override { return comm.name(); }
    bool is_broken() const override {
      if constexpr (requires {
                      { comm.is_broken() } -> std::convertible_to<bool>;
                    }) {
        return comm.is_broken();
      } else {
        return false;
      }
    }
    Work all_gather_async(at::Tensor o, const at::Tensor& i) override { return comm.all_gather_async(std::move(o), i); }
    Work gather_async(at::Tensor o, const at::Tensor& i, int root) override {
      return comm.gather_async(std::move(o), i, root);
    }
    Work reduce_scatter_async(at::Tensor o, const at::Tensor& i, ReduceOp op) override {
      return comm.reduce_scatter_async(std::move(o), i, op);
    }
    Work all_to_all_async(at::Tensor o, const at::Tensor& i) override { return comm.all_to_all_async(std::move(o), i); }
    Work all_to_all_v_async(at::Tensor o, const at::Tensor& i, at::IntArrayRef os, at::IntArrayRef is) override {
      return comm.all_to_all_v_async(std::move(o), i, os, is);
    }
    Work all_reduce_async(at::Tensor t, ReduceOp op) override { return comm.all_reduce_async(std::move(t), op); }
    Work broadcast_async(at::Tensor t, int root) override { return comm.broadcast_async(std::move(t), root); }
    Work barrier_async() override { return comm.barrier_async(); }
    std::optional<AnyCommunicator> split(int color, int key, std::string_view name) const override {
      auto child = comm.split(color, key, name);
      if (!child) return std::nullopt;
      return AnyCommunicator(std::move(*child));
    }
    C comm;
  };

  std::shared_ptr<Interface> self_;
};

static_assert(Communicator<AnyCommunicator>);

}  // namespace fsdpx::dist

// What every load, save and sync call takes: a sharded model, or anything that holds one (an
// fsdpx::Fsdp<...>), as one argument, always the first (as torch's set_model_state_dict(model, ...)):
//
//   fsdpx::load_model_state_dict(model, sd);      // model: an Fsdp<...> or a core::ShardedModel
//   fsdpx::dcp::save_model(model, dir);
//   fsdpx::sync::WeightBroadcaster sender(model, groups.model_update);
//
// ShardedModelRef is to a sharded model what std::string_view is to a string: a non-owning reference that
// converts from either, so that the functions taking it stay non-templates with their bodies out of the
// headers (docs/architecture.md). It must not outlive the model.
#pragma once

#include <concepts>
#include <type_traits>

namespace fsdpx::core {
class ShardedModel;  // core/sharded_model.hpp
}

namespace fsdpx {

/// A core::ShardedModel itself, or a type whose sharded() gives one (fsdpx::Fsdp<...>).
template <class M>
concept ShardedModelLike = std::same_as<std::remove_const_t<M>, core::ShardedModel> || requires(M& m) {
  { m.sharded() } -> std::convertible_to<const core::ShardedModel&>;
};

/// A reference to a sharded model (`Model`: core::ShardedModel, or const core::ShardedModel for calls that
/// only read it), made from the model or from what holds it.
template <class Model>
class BasicShardedModelRef {
  static_assert(std::same_as<std::remove_const_t<Model>, core::ShardedModel>,
                "BasicShardedModelRef<Model>: Model is core::ShardedModel or const core::ShardedModel");

 public:
  BasicShardedModelRef(Model& model) noexcept : model_(&model) {}  // NOLINT(google-explicit-constructor)
  template <ShardedModelLike Holder>
    requires(!std::same_as<std::remove_const_t<Holder>, core::ShardedModel>) && requires(Holder& h) {
      { h.sharded() } -> std::convertible_to<Model&>;
    }
  BasicShardedModelRef(Holder& holder) noexcept : model_(&holder.sharded()) {}  // NOLINT(google-explicit-constructor)
  /// A reference that may change the model also reads it.
  template <class Other>
    requires(std::is_const_v<Model> && !std::is_const_v<Other>)
  BasicShardedModelRef(BasicShardedModelRef<Other> other) noexcept : model_(&other.get()) {}  // NOLINT

  Model& get() const noexcept { return *model_; }
  Model& operator*() const noexcept { return *model_; }
  Model* operator->() const noexcept { return model_; }

 private:
  Model* model_;
};

using ShardedModelRef = BasicShardedModelRef<core::ShardedModel>;
using ConstShardedModelRef = BasicShardedModelRef<const core::ShardedModel>;

}  // namespace fsdpx

// FusedAdamW: ATen's fused AdamW kernel behind LibTorch's AdamW type. Its updates equal LibTorch's AdamW
// within float32 rounding (adamw_update_bound with no gradient difference), and its state is AdamW's.
#include <catch2/catch.hpp>

#include <sstream>
#include <vector>

#include <torch/optim.h>
#include <torch/serialize.h>

#include <fsdpx/core/optim.hpp>

#include "../support/step_parity.hpp"

using fsdpx::FusedAdamW;
using torch::optim::AdamW;
using torch::optim::AdamWOptions;
using torch::optim::AdamWParamState;

namespace {

// Five parameters: three decayed matrices, a bias and a norm weight in a second group. The last never
// gets a gradient (a frozen or unused parameter: never stepped, never given state).
std::vector<at::Tensor> make_params() {
  at::manual_seed(7);
  std::vector<at::Tensor> out;
  for (const auto& shape : std::vector<std::vector<int64_t>>{{33, 17}, {64, 8}, {5, 129}, {129}, {17}}) {
    out.push_back(at::randn(shape).requires_grad_(true));
  }
  return out;
}

std::vector<torch::optim::OptimizerParamGroup> groups(const std::vector<at::Tensor>& p, bool amsgrad) {
  std::vector<torch::optim::OptimizerParamGroup> g;
  g.emplace_back(std::vector<at::Tensor>{p[0], p[1], p[2]},
                 std::make_unique<AdamWOptions>(AdamWOptions(1e-2).weight_decay(0.1).eps(1e-8).amsgrad(amsgrad)));
  g.emplace_back(std::vector<at::Tensor>{p[3], p[4]},
                 std::make_unique<AdamWOptions>(AdamWOptions(3e-3).weight_decay(0.0).eps(1e-6).amsgrad(amsgrad)));
  return g;
}

// The same gradients into both sets of parameters, at scales from 1e2 to 1e-6 (a tiny gradient makes
// AdamW's update most sensitive to rounding); the last parameter gets none.
void set_gradients(int step, const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  at::manual_seed(100 + step);
  const std::vector<double> scales{1.0, 1e-3, 1e2, 1e-6};
  for (size_t i = 0; i + 1 < a.size(); ++i) {
    const at::Tensor g = at::randn(a[i].sizes()) * scales[i];
    a[i].mutable_grad() = g.clone();
    b[i].mutable_grad() = g.clone();
  }
}

const AdamWParamState& state_of(torch::optim::Optimizer& o, const at::Tensor& p) {
  return static_cast<const AdamWParamState&>(*o.state().at(p.unsafeGetTensorImpl()));
}

// Every stepped parameter of `fused` against `reference`'s, within adamw_update_bound; then the
// reference takes the fused weights, so that each step is compared from the same weights.
void check_and_align(torch::optim::Optimizer& fused, const std::vector<at::Tensor>& a,
                     torch::optim::Optimizer& reference, const std::vector<at::Tensor>& b) {
  at::NoGradGuard no_grad;
  for (size_t gi = 0; gi < fused.param_groups().size(); ++gi) {
    const auto& o = static_cast<const AdamWOptions&>(fused.param_groups()[gi].options());
    const auto& ps = fused.param_groups()[gi].params();
    for (size_t j = 0; j < ps.size(); ++j) {
      const size_t i = gi == 0 ? j : 3 + j;
      if (!a[i].grad().defined()) continue;
      const AdamWParamState& s = state_of(fused, a[i]);
      REQUIRE(s.step() == state_of(reference, b[i]).step());
      const at::Tensor bound = fsdpx::test::adamw_update_bound(a[i], s.exp_avg_sq(), s.step(), o, o.lr(), 0.0);
      const at::Tensor ratio = (a[i] - b[i]).abs() / bound;
      INFO("parameter " << i << " after step " << s.step() << ": error / bound " << ratio.max().item<double>());
      CHECK(ratio.max().item<double>() <= 1.0);
      b[i].copy_(a[i]);
    }
  }
}

}  // namespace

TEST_CASE("FusedAdamW steps as LibTorch's AdamW does, within float32 rounding", "[optim]") {
  for (const bool amsgrad : {false, true}) {
    INFO("amsgrad " << amsgrad);
    const auto a = make_params(), b = make_params();
    FusedAdamW fused(groups(a, amsgrad));
    AdamW reference(groups(b, amsgrad));
    const at::Tensor frozen = a.back().detach().clone();
    for (int step = 1; step <= 6; ++step) {
      set_gradients(step, a, b);
      fused.step();
      reference.step();
      check_and_align(fused, a, reference, b);
    }
    CHECK(at::equal(a.back(), frozen));  // never given a gradient: untouched, no state
    CHECK(fused.state().count(a.back().unsafeGetTensorImpl()) == 0);
    CHECK(fused.state().size() == reference.state().size());
    CHECK(state_of(fused, a[0]).max_exp_avg_sq().defined() == amsgrad);
  }
}

TEST_CASE("FusedAdamW's state is AdamW's: each resumes the other's saved state", "[optim]") {
  const auto a = make_params(), b = make_params();
  FusedAdamW fused(groups(a, false));
  AdamW reference(groups(b, false));
  for (int step = 1; step <= 3; ++step) {
    set_gradients(step, a, b);
    fused.step();
    reference.step();
    check_and_align(fused, a, reference, b);
  }
  // fsdpx sees it as the AdamW it is (checkpoints, optimizer state dicts, move_optimizer_state).
  CHECK(dynamic_cast<AdamW*>(&fused) != nullptr);
  torch::optim::OptimizerParamState& any_state = *fused.state().at(a[0].unsafeGetTensorImpl());
  CHECK(fsdpx::detail::optimizer_state_tensors(any_state).size() == 2);

  // Swap the states through LibTorch's serialization: a FusedAdamW over b resumes the AdamW's, an AdamW
  // over a the FusedAdamW's; both keep stepping as one.
  std::stringstream fused_saved, reference_saved;
  torch::save(fused, fused_saved);
  torch::save(reference, reference_saved);
  FusedAdamW resumed_fused(groups(b, false));
  AdamW resumed_reference(groups(a, false));
  torch::load(resumed_fused, reference_saved);
  torch::load(resumed_reference, fused_saved);
  CHECK(state_of(resumed_fused, b[0]).step() == 3);
  CHECK(state_of(resumed_reference, a[0]).step() == 3);
  for (int step = 4; step <= 6; ++step) {
    set_gradients(step, b, a);
    resumed_fused.step();
    resumed_reference.step();
    check_and_align(resumed_fused, b, resumed_reference, a);
  }
}

TEST_CASE("FusedAdamW refuses a gradient of another dtype than its parameter's, naming both", "[optim][errors]") {
  at::Tensor p = at::randn({4, 4}).requires_grad_(true);
  p.mutable_grad() = at::randn({4, 4}).to(at::kBFloat16);
  FusedAdamW fused(std::vector<at::Tensor>{p}, AdamWOptions(1e-3));
  CHECK_THROWS_WITH(fused.step(), Catch::Contains("Float") && Catch::Contains("BFloat16") &&
                                      Catch::Contains("must share dtype and device"));
}

// Prints the LRs of fsdpx's schedules over 100 optimizer steps, one line per schedule:
//   <name> <lr after construction> <lr after step 1> ... <lr after step 100>
// for tests/core/lr_schedules_test.py, which compares them with transformers' own schedules.
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include <torch/optim/sgd.h>

#include <fsdpx/core/lr_schedule.hpp>

int main() {
  using fsdpx::LrSchedule;
  const std::vector<std::pair<std::string, LrSchedule>> schedules = {
      {"constant", LrSchedule::constant()},
      {"constant_with_warmup", LrSchedule::constant_with_warmup(10)},
      {"linear", LrSchedule::linear(10, 100)},
      {"linear_no_warmup", LrSchedule::linear(0, 80)},
      {"cosine", LrSchedule::cosine(10, 100)},
      {"cosine_cycles", LrSchedule::cosine(5, 100, 0.0, 1.5)},
      {"cosine_min_lr", LrSchedule::cosine(10, 100, 0.1)},
      {"cosine_min_lr_short", LrSchedule::cosine(3, 60, 0.25)},
  };
  for (const auto& [name, schedule] : schedules) {
    // Two groups with different base LRs: every group follows the schedule.
    torch::optim::SGD optimizer(std::vector<at::Tensor>{at::zeros({1}, at::requires_grad())},
                                torch::optim::SGDOptions(3e-4));
    auto second = std::make_unique<torch::optim::SGDOptions>(1e-2);
    optimizer.add_param_group(
        torch::optim::OptimizerParamGroup({at::zeros({1}, at::requires_grad())}, std::move(second)));
    fsdpx::LrScheduler scheduler(optimizer, schedule);
    std::vector<std::vector<double>> lrs;  // [step][group]
    for (int step = 0; step <= 100; ++step) {
      if (step > 0) scheduler.step();
      lrs.push_back(scheduler.last_lr());
    }
    for (int group = 0; group < 2; ++group) {
      std::printf("%s/%d", name.c_str(), group);
      for (const auto& at_step : lrs) std::printf(" %.17g", at_step[group]);
      std::printf("\n");
    }
  }
  return 0;
}

// ProgressReporter: the training loop's one line per step on world rank 0, so a program need not write
// it: step, loss (averaged over the ranks), gradient norm, learning rate, tokens/s (all ranks), the
// largest memory over the ranks, the ETA when the step count is known, and checkpoint events (saving,
// committed, failed) as they happen. Lines, or a progress bar redrawn in place when the output is a
// terminal.
//
//   fsdpx::ProgressReporter progress(model.mesh().world(), {.total_steps = 1000}, device);
//   for (int64_t step = 1; step <= 1000; ++step) {
//     ...
//     const auto report = train_step.optimizer_step();
//     progress.step(step, loss, tokens_this_rank, report.grad_norm, report.lr);  // collective
//   }
//   // A checkpoint coordinator's events (its monitor runs on rank 0's coordinator thread):
//   ckpt.add_monitor({.on_commit = [&](int64_t s, bool weights_only) { if (!weights_only) progress.committed(s); },
//                     .on_failure = [&](int64_t s, const std::string& why) { progress.failed(s, why); }});
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>

#include <unistd.h>

#include <ATen/ATen.h>

#include <fsdpx/core/memory.hpp>
#include <fsdpx/dist/any.hpp>
#include <fsdpx/error.hpp>

namespace fsdpx {

struct ProgressOptions {
  /// The run's last step: the ETA and the bar's length. Unset: neither.
  std::optional<int64_t> total_steps;
  /// A line every this many steps (the first and the last step always have one).
  int64_t every = 1;
  /// Where rank 0 writes; default stdout.
  std::FILE* out = nullptr;
  enum class Style { automatic, lines, bar };
  /// automatic: a bar redrawn in place when `out` is a terminal and total_steps is set, lines otherwise
  /// (always under Open MPI's mpirun, whose ranks write to a pseudo-terminal even when its output is a file).
  Style style = Style::automatic;
};

class ProgressReporter {
 public:
  /// `device`: where the model computes (its memory is reported; the CPU's resident set otherwise).
  ProgressReporter(dist::AnyCommunicator world, ProgressOptions options = {},
                   c10::Device device = c10::Device(c10::kCPU))
      : world_(std::move(world)), options_(options), device_(device), out_(options.out ? options.out : stdout) {
    FSDPX_CHECK(options_.every >= 1, "ProgressReporter: every is ", options_.every, "; it must be >= 1");
    FSDPX_CHECK(!options_.total_steps || *options_.total_steps >= 1, "ProgressReporter: total_steps is ",
                options_.total_steps.value_or(0), "; it must be >= 1");
    bar_ = options_.style == ProgressOptions::Style::bar ||
           (options_.style == ProgressOptions::Style::automatic && options_.total_steps && writes_to_terminal(out_));
    last_ = start_ = std::chrono::steady_clock::now();
  }
  ~ProgressReporter() {
    std::lock_guard lock(mutex_);
    end_bar();
  }
  ProgressReporter(const ProgressReporter&) = delete;
  ProgressReporter& operator=(const ProgressReporter&) = delete;

  /// After step `step`'s update, on every rank (collective over the world: one all-gather of three
  /// values). `loss`: this rank's (a scalar tensor, or undefined); `tokens`: what this rank trained on in
  /// the step.
  void step(int64_t step, const at::Tensor& loss, int64_t tokens, std::optional<double> grad_norm = std::nullopt,
            std::optional<double> lr = std::nullopt) {
    const auto now = std::chrono::steady_clock::now();
    const double seconds = std::chrono::duration<double>(now - last_).count();
    last_ = now;
    const MemoryReport memory = memory_report(device_);
    const double bytes =
        static_cast<double>(memory.device_total_bytes ? memory.peak_allocated_bytes : memory.host_peak_rss_bytes);
    const double mine[3] = {loss.defined() ? loss.detach().to(at::kDouble).item<double>() : NAN,
                            static_cast<double>(tokens), bytes};
    const auto comm = world_.device_type() == c10::kCPU ? at::Device(at::kCPU) : device_;
    const at::Tensor in = at::tensor(at::ArrayRef<double>(mine, 3), at::kDouble).to(comm);
    at::Tensor all = at::empty({3 * world_.size()}, in.options());
    world_.all_gather(all, in);
    if (world_.rank() != 0) return;
    const at::Tensor host = all.cpu().view({world_.size(), 3});
    const double mean_loss = host.select(1, 0).mean().item<double>();
    const double all_tokens = host.select(1, 1).sum().item<double>();
    const double peak = host.select(1, 2).max().item<double>();
    ++steps_seen_;
    first_step_ = first_step_.value_or(step);
    const bool last = options_.total_steps && step >= *options_.total_steps;
    if (!(step == *first_step_ || last || step % options_.every == 0)) return;
    std::string line = detail::str("step ", step, "  loss ", fixed(mean_loss, 4));
    if (grad_norm) line += detail::str("  grad-norm ", fixed(*grad_norm, 3));
    if (lr) line += "  lr " + scientific(*lr);
    line += detail::str("  ", fixed(seconds > 0 ? all_tokens / seconds : 0.0, 0), " tokens/s  ",
                        memory.device_total_bytes ? "peak device " : "peak RSS ", fixed(peak / 1073741824.0, 2),
                        " GiB (max of ", world_.size(), world_.size() == 1 ? " rank)" : " ranks)");
    if (options_.total_steps) {
      // The average step since the first reported one (the first includes warm-up).
      const double elapsed = std::chrono::duration<double>(now - start_).count();
      const double per_step = elapsed / static_cast<double>(steps_seen_);
      line += detail::str("  ", std::min(step, *options_.total_steps), "/", *options_.total_steps, "  ETA ",
                          clock(per_step * static_cast<double>(std::max<int64_t>(*options_.total_steps - step, 0))));
    }
    std::lock_guard lock(mutex_);
    if (bar_) {
      const int64_t total = *options_.total_steps, width = 24;
      const int64_t done = std::clamp<int64_t>(step * width / total, 0, width);
      std::fprintf(out_, "\r[%s%s] %s\x1b[K", std::string(static_cast<size_t>(done), '#').c_str(),
                   std::string(static_cast<size_t>(width - done), '.').c_str(), line.c_str());
      bar_drawn_ = true;
      if (last) end_bar();
    } else {
      std::fprintf(out_, "%s\n", line.c_str());
    }
    std::fflush(out_);
  }

  /// Checkpoint events, from any thread. Rank 0 prints saving and committed (other ranks' calls print
  /// nothing); a failure is printed by every rank that reports one, naming it.
  void saving(int64_t step) { event(detail::str("checkpoint: saving step ", step, " in the background")); }
  void committed(int64_t step) { event(detail::str("checkpoint: step ", step, " committed")); }
  void failed(int64_t step, std::string_view why) {
    event(detail::str("checkpoint: step ", step, " FAILED",
                      world_.rank() == 0 ? std::string() : detail::str(" on rank ", world_.rank()), ": ", why,
                      " (the newest committed step is unchanged)"),
          /*any_rank=*/true);
  }

 private:
  void event(const std::string& text, bool any_rank = false) {
    if (world_.rank() != 0 && !any_rank) return;
    std::lock_guard lock(mutex_);
    end_bar();
    std::fprintf(out_, "%s\n", text.c_str());
    std::fflush(out_);
  }
  /// A bar being drawn ends its line before anything else is printed.
  void end_bar() {
    if (!bar_drawn_) return;
    std::fprintf(out_, "\n");
    std::fflush(out_);
    bar_drawn_ = false;
  }
  /// Open MPI gives every rank a pseudo-terminal for its output whatever mpirun's own output is (a
  /// file, a pipe): its ranks cannot tell, and print lines.
  static bool writes_to_terminal(std::FILE* f) {
    return isatty(fileno(f)) == 1 && std::getenv("OMPI_COMM_WORLD_SIZE") == nullptr;
  }
  static std::string fixed(double v, int digits) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.*f", digits, v);
    return buf;
  }
  static std::string scientific(double v) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.3g", v);
    return buf;
  }
  static std::string clock(double seconds) {
    const auto s = static_cast<int64_t>(std::llround(seconds));
    char buf[64];
    std::snprintf(buf, sizeof buf, "%lld:%02lld:%02lld", static_cast<long long>(s / 3600),
                  static_cast<long long>(s / 60 % 60), static_cast<long long>(s % 60));
    return buf;
  }

  dist::AnyCommunicator world_;
  ProgressOptions options_;
  c10::Device device_;
  std::FILE* out_;
  bool bar_ = false;
  bool bar_drawn_ = false;
  std::chrono::steady_clock::time_point start_, last_;
  int64_t steps_seen_ = 0;
  std::optional<int64_t> first_step_;
  std::mutex mutex_;
};

}  // namespace fsdpx

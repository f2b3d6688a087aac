// The crafted checkpoint files of issue 62, read by one commit's readers, each in a child process under a
// 6 GiB address-space cap and a 60 s alarm: what each reader did (its error, a crash, an allocation failure or
// a success), in how long and at what peak RSS. Built against the headers of two commits by
// benchmarks/untrusted_before_after.sh, so the same files meet the readers before and after the change.
// FSDPX_AB_OLD_LAYOUT selects the headers and namespaces of commits before the DCP room (issue 61).
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "../tests/support/crafted_archive.hpp"

#include <fsdpx/checkpoint/detail/torch_io.hpp>
#include <fsdpx/error.hpp>
#ifdef FSDPX_AB_OLD_LAYOUT
#include <fsdpx/checkpoint/dcp_metadata.hpp>
#include <fsdpx/checkpoint/dcp_reader.hpp>
namespace dcp = fsdpx::checkpoint::dcp;
#else
#include <fsdpx/dcp.hpp>
namespace dcp = fsdpx::dcp;
#endif

namespace {

namespace fs = std::filesystem;
using namespace std::string_literals;

namespace crafted = fsdpx::test::crafted;
using crafted::archive;
using crafted::binunicode;
using crafted::write_file;

std::string tensor_pickle(const std::string& key, int64_t numel, int64_t offset, int64_t size) {
  return crafted::tensor_pickle(key, numel, offset, {size}, {1});
}

struct Case {
  std::string name;
  std::function<void()> read;
};

/// Runs `c` in a child; prints one line: the outcome, the seconds and the child's peak RSS.
void run(const Case& c) {
  int fds[2];
  if (pipe(fds) != 0) return;
  const auto t0 = std::chrono::steady_clock::now();
  const pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    const rlimit cap{int64_t{6} << 30, int64_t{6} << 30};
    setrlimit(RLIMIT_AS, &cap);
    alarm(60);
    std::string out;
    try {
      c.read();
      out = "read, no error";
    } catch (const fsdpx::IoError& e) {
      out = "IoError: "s + e.what();
    } catch (const std::bad_alloc&) {
      out = "std::bad_alloc";
    } catch (const std::exception& e) {
      out = "other error: "s + e.what();
    }
    for (char& ch : out) {
      if (ch == '\n') ch = ' ';
    }
    (void)!::write(fds[1], out.data(), std::min<size_t>(out.size(), 400));
    _exit(0);
  }
  close(fds[1]);
  std::string out;
  char buf[512];
  for (ssize_t n; (n = read(fds[0], buf, sizeof buf)) > 0;) out.append(buf, static_cast<size_t>(n));
  close(fds[0]);
  int status = 0;
  rusage usage{};
  wait4(pid, &status, 0, &usage);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (WIFSIGNALED(status))
    out = "killed by signal "s + std::to_string(WTERMSIG(status)) + " (" + strsignal(WTERMSIG(status)) + ")";
  std::printf("%-34s %7.2f s %7.0f MiB  %s\n", c.name.c_str(), s, usage.ru_maxrss / 1024.0, out.substr(0, 180).c_str());
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  const fs::path dir = argc > 1 ? fs::path(argv[1]) : fs::temp_directory_path() / "fsdpx_untrusted_ab";
  fs::create_directories(dir);
  const auto load = [](const fs::path& p) { return [p] { (void)fsdpx::checkpoint::detail::load_ivalue(p); }; };
  const auto plain = [](const fs::path& p) { return [p] { (void)dcp::read_plain_file(p); }; };
  std::vector<Case> cases;

  const int levels = 1 << 20;
  const fs::path lists =
      write_file(dir / "lists.pt", archive("\x80\x02" + std::string(levels, ']') + std::string(levels - 1, 'a') + "."));
  cases.push_back({"2^20 nested lists, load_ivalue", load(lists)});
  cases.push_back({"2^20 nested lists, read_plain_file", plain(lists)});
  const fs::path tuples = write_file(dir / "tuples.pt", archive("\x80\x02)" + std::string(levels, '\x85') + "."));
  cases.push_back({"2^20 nested tuples, load_ivalue", load(tuples)});

  {  // 2048 tensors over one 4 MiB storage, each naming it again
    const int64_t numel = int64_t{1} << 20;
    std::string p = "\x80\x02](";
    for (int i = 0; i < 2048; ++i) p += tensor_pickle("0", numel, i * 512, 512);
    const fs::path shared = write_file(dir / "shared.pt", archive(p + "e.", {{"0", std::string(numel * 4, '\0')}}));
    cases.push_back({"2048 views of a 4 MiB storage", load(shared)});
  }
  {
    std::string p = "\x80\x02\x8d";  // BINUNICODE8 behind a protocol 2 header, as LibTorch reads
    const uint64_t n = uint64_t{7} << 29;
    for (int i = 0; i < 8; ++i) p += static_cast<char>(n >> (8 * i));
    const fs::path longs = write_file(dir / "long_string.pt", archive(p + "abc."));
    cases.push_back({"BINUNICODE8 of 3.5 GiB, load_ivalue", load(longs)});
  }
  {
    std::string p = "\x80\x02](" + binunicode(std::string(1 << 20, 'x')) + "q\x00"s;
    for (int i = 1; i < 8192; ++i) p += "h\x00"s;
    const fs::path memo = write_file(dir / "memo.pt", archive(p + "e."));
    cases.push_back({"1 MiB string x 8192 memo, load_ivalue", load(memo)});
    cases.push_back({"1 MiB string x 8192 memo, plain", plain(memo)});
  }
  {
    const fs::path lies = write_file(dir / "storage.pt", archive("\x80\x02" + tensor_pickle("0", 1 << 28, 0, 4) + ".",
                                                                 {{"0", std::string(64, '\0')}}));
    cases.push_back({"2^28 floats claimed over 64 bytes", load(lies)});
  }
  {
    const fs::path folder = dir / "dcp";
    fs::create_directories(folder);
    const auto chunk = fsdpx::checkpoint::detail::save_ivalue(folder / "__0_0.distcp", at::arange(4, at::kFloat));
    const auto metadata = [folder, bytes = chunk.bytes](std::vector<int64_t> size, std::vector<dcp::Chunk> boxes) {
      dcp::Metadata md;
      for (const auto& box : boxes) md.storage[{"w", box.offsets}] = {.relative_path = "__0_0.distcp", .length = bytes};
      md.entries["w"] = dcp::TensorEntry{.dtype = c10::kFloat, .size = std::move(size), .chunks = std::move(boxes)};
      dcp::write_metadata(folder / dcp::metadata_file_name, md);
    };
    const int64_t rows = int64_t{1} << 27;
    cases.push_back({"DCP: two columns of 2^27 rows", [=] {
                       metadata({rows, 2}, {{{0, 0}, {rows, 1}}, {{0, 1}, {rows, 1}}});
                       (void)dcp::Reader(folder).read("w");
                     }});
    cases.push_back({"DCP: a tensor of 2^40 floats", [=] {
                       metadata({int64_t{1} << 40}, {{{0}, {int64_t{1} << 40}}});
                       (void)dcp::Reader(folder).read("w");
                     }});
  }
  for (const Case& c : cases) run(c);
  return 0;
}

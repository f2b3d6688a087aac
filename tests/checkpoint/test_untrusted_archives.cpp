// torch.save archives crafted as a hostile checkpoint root would (label "security"): a pickle nested a
// million deep, storages shared by thousands of tensors, a length of gigabytes in a small file, a string
// shared a million times through the memo, a list that holds itself, tensors and storages that lie about
// their records. Every file is made here with torch's own zip writer (PyTorchStreamWriter) around a pickle
// written byte by byte (tests/support/crafted_archive.hpp), and read by every reader of a checkpoint file (load_ivalue:
// fsdpx's shards, commit records, fsdpx-merge, fsdpx-inspect; dcp::read_plain_file: LightRFT's extra files). Each ends
// in an IoError naming the file and the cause within 2 s and 256 MiB of growth, or, for a legitimate sharing, loads
// with the storage read once.
#include <catch2/catch.hpp>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include <fsdpx/checkpoint/detail/torch_io.hpp>
#include <fsdpx/checkpoint/format.hpp>
#include <fsdpx/dcp.hpp>
#include <fsdpx/error.hpp>

#include "../support/crafted_archive.hpp"
#include "../support/process_memory.hpp"
#include "merge_fixture.hpp"

namespace {

namespace fs = std::filesystem;
using namespace std::string_literals;

namespace crafted = fsdpx::test::crafted;
using crafted::archive;
using crafted::binint;
using crafted::binunicode;
using crafted::tensor_pickle;

fs::path write(const fs::path& dir, const std::string& name, const std::string& bytes) {
  return crafted::write_file(dir / name, bytes);
}

/// What a refusal must be: an IoError naming `path` and `cause`, within 2 s and 256 MiB of growth.
template <class Read>
void refused(const fs::path& path, const std::string& cause, Read&& read) {
  INFO(cause);
  REQUIRE(fsdpx::test::reset_peak());
  const int64_t before = fsdpx::test::status_bytes("VmRSS");
  const auto t0 = std::chrono::steady_clock::now();
  try {
    read();
    FAIL("read without an error");
  } catch (const fsdpx::IoError& e) {
    const std::string what = e.what();
    INFO(what);
    CHECK(what.find(path.string()) != std::string::npos);
    CHECK(what.find(cause) != std::string::npos);
  }
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(2));
  CHECK(fsdpx::test::status_bytes("VmHWM") - before < (int64_t{256} << 20));
}

c10::IValue load(const fs::path& path) { return fsdpx::checkpoint::detail::load_ivalue(path); }

}  // namespace

TEST_CASE("archives: a pickle nested a million deep is refused without recursing, in every reader",
          "[security][checkpoint]") {
  merge_fixture::TempDir tmp;
  const fs::path& dir = tmp.path;
  const int levels = 1 << 20;
  const fs::path lists =
      write(dir, "lists.pt", archive("\x80\x02" + std::string(levels, ']') + std::string(levels - 1, 'a') + "."));
  refused(lists, "nests deeper than 100 levels", [&] { load(lists); });
  // the plain-value reader stops a million at its count of values (ReaderOptions::max_bytes_values) first
  refused(lists, "makes more than 1048576 values", [&] { fsdpx::dcp::read_plain_file(lists); });
  const int fewer = 1 << 18;
  const fs::path plain =
      write(dir, "plain.pt", archive("\x80\x02" + std::string(fewer, ']') + std::string(fewer - 1, 'a') + "."));
  refused(plain, "nests deeper than 100 levels", [&] { fsdpx::dcp::read_plain_file(plain); });
  std::string tuples = "\x80\x02)";
  tuples += std::string(levels, '\x85');  // TUPLE1 of the tuple below it, a million times
  const fs::path nested = write(dir, "tuples.pt", archive(tuples + "."));
  refused(nested, "nests deeper than 100 levels", [&] { load(nested); });
  // 100 levels read: the bound is the stated one, not a crash further down
  const fs::path shallow =
      write(dir, "shallow.pt", archive("\x80\x02" + std::string(100, ']') + std::string(99, 'a') + "."));
  CHECK(load(shallow).isList());
}

TEST_CASE("archives: a dict of a million items, unbatched as LibTorch's pickler writes it, reads",
          "[checkpoint][memory]") {
  merge_fixture::TempDir tmp;
  std::string p = "\x80\x02}(";
  const int32_t items = 1 << 20;
  for (int32_t i = 0; i < items; ++i) p += binint(i) + "N";
  p += "u.";
  const fs::path path = write(tmp.path, "big_dict.pt", archive(p));
  CHECK(load(path).toGenericDict().size() == static_cast<size_t>(items));
}

TEST_CASE("archives: a committed file is read only as itself, never through a symbolic link",
          "[security][checkpoint]") {
  merge_fixture::TempDir tmp;
  const fs::path real = tmp.path / "outside.pt";
  const auto written = fsdpx::checkpoint::detail::save_ivalue(real, c10::IValue(int64_t{7}));
  const fsdpx::checkpoint::CommittedFile committed{written.bytes, written.crc32c};
  CHECK(fsdpx::checkpoint::load_committed_ivalue(real, committed).toInt() == 7);
  // The link has the committed size and CRC-32C; it is refused at the open, not measured through.
  const fs::path link = tmp.path / "model_world_size_1_rank_0.pt";
  fs::create_symlink(real, link);
  refused(link, "is a symbolic link", [&] { (void)fsdpx::checkpoint::load_committed_ivalue(link, committed); });
  refused(link, "is a symbolic link",
          [&] { (void)fsdpx::checkpoint::load_shard_file(tmp.path, link.filename().string(), committed); });
  // An uncommitted file (a foreign folder's, a merge input) may still be reached through one.
  CHECK(fsdpx::checkpoint::load_committed_ivalue(link, std::nullopt).toInt() == 7);
}

TEST_CASE("archives: tensors that share one storage read its record once", "[security][checkpoint][memory]") {
  merge_fixture::TempDir tmp;
  const fs::path& dir = tmp.path;
  const int64_t numel = int64_t{1} << 20;  // 4 MiB of float32, 2048 tensors over it, each naming it again
  std::string p = "\x80\x02](";
  for (int i = 0; i < 2048; ++i) p += tensor_pickle("0", numel, i * 512, {512}, {1});
  p += "e.";
  std::string bytes(static_cast<size_t>(numel) * 4, '\0');
  for (size_t i = 0; i < bytes.size(); i += 4) {
    const float v = static_cast<float>(i / 4);
    std::memcpy(bytes.data() + i, &v, 4);
  }
  const fs::path path = write(dir, "shared.pt", archive(p, {{"0", bytes}}));
  REQUIRE(fsdpx::test::reset_peak());
  const int64_t before = fsdpx::test::status_bytes("VmRSS");
  const c10::IValue v = load(path);
  // the file once in memory, its record once: LibTorch's unpickler read the record per tensor (8 GiB)
  CHECK(fsdpx::test::status_bytes("VmHWM") - before < (int64_t{64} << 20));
  const auto& list = v.toListRef();
  REQUIRE(list.size() == 2048);
  for (size_t i = 0; i < list.size(); ++i) {
    const at::Tensor& t = list[i].toTensor();
    REQUIRE(t.storage().data() == list[0].toTensor().storage().data());
    REQUIRE(t[0].item<float>() == static_cast<float>(i * 512));
  }
}

TEST_CASE("archives: lengths, sharing and shapes that lie are refused before anything is allocated",
          "[security][checkpoint][memory]") {
  merge_fixture::TempDir tmp;
  const fs::path& dir = tmp.path;
  {
    // BINUNICODE8 of 3.5 GiB in a pickle of a few bytes
    std::string p = "\x80\x04\x8d";
    const uint64_t n = uint64_t{7} << 29;
    for (int i = 0; i < 8; ++i) p += static_cast<char>(n >> (8 * i));
    p += "abc.";
    const fs::path path = write(dir, "long_string.pt", archive(p));
    refused(path, "runs past the end of the pickle", [&] { load(path); });
  }
  {
    // one 1 MiB string referenced 4096 times through the memo: 4 GiB as a tree (LibTorch's unpickler and the
    // plain-value reader made a copy per reference)
    std::string p = "\x80\x02](" + binunicode(std::string(1 << 20, 'x')) + "q\x00"s;
    for (int i = 1; i < 4096; ++i) p += "h\x00"s;
    p += "e.";
    const fs::path path = write(dir, "memo.pt", archive(p));
    refused(path, "counted as often as they are referenced", [&] { load(path); });
    refused(path, "counted as often as they are referenced", [&] { fsdpx::dcp::read_plain_file(path); });
  }
  {
    const fs::path path = write(dir, "itself.pt",
                                archive("\x80\x02]q\x00"
                                        "h\x00"
                                        "a."s));
    refused(path, "holds itself", [&] { load(path); });
  }
  const std::string record(64, '\0');  // 16 float32
  const auto one_tensor = [&](const std::string& name, int64_t numel, int64_t offset, std::vector<int64_t> sizes,
                              std::vector<int64_t> strides) {
    return write(dir, name,
                 archive("\x80\x02" + tensor_pickle("0", numel, offset, sizes, strides) + ".", {{"0", record}}));
  };
  CHECK(load(one_tensor("ok.pt", 16, 4, {3, 4}, {4, 1})).toTensor().sizes() == c10::IntArrayRef({3, 4}));
  const fs::path storage_lies = one_tensor("storage.pt", 1 << 28, 0, {4}, {1});
  refused(storage_lies, "claims 268435456 elements of Float, more than its record's 64 bytes hold",
          [&] { load(storage_lies); });
  const fs::path past = one_tensor("past.pt", 16, 8, {3, 4}, {4, 1});
  refused(past, "reaches past its storage of 64 bytes", [&] { load(past); });
  const fs::path negative = one_tensor("negative.pt", 16, 15, {4}, {-1});
  refused(negative, "holds -1, which is negative", [&] { load(negative); });
  const fs::path huge = one_tensor("huge.pt", 16, 0, {1 << 30, 1 << 30}, {1 << 30, 1});
  refused(huge, "reaches past its storage", [&] { load(huge); });
  {
    const fs::path path = write(dir, "no_record.pt", archive("\x80\x02" + tensor_pickle("7", 4, 0, {4}, {1}) + "."));
    refused(path, "it has no record 'data/7'", [&] { load(path); });
  }
  {
    const fs::path path = write(dir, "tensor_in_plain.pt",
                                archive("\x80\x02" + tensor_pickle("0", 16, 0, {4}, {1}) + ".", {{"0", record}}));
    refused(path, "may not name", [&] { fsdpx::dcp::read_plain_file(path); });
  }
}

TEST_CASE("dcp: pieces and tensors are sized from what the files hold, not from what .metadata claims",
          "[security][checkpoint][dcp][memory]") {
  merge_fixture::TempDir tmp;
  const fs::path& dir = tmp.path;
  // one real chunk: a torch.save archive of 4 float32 (LibTorch's writer), about 1 KB
  const auto chunk = fsdpx::checkpoint::detail::save_ivalue(dir / "__0_0.distcp", at::arange(4, at::kFloat));
  const auto folder = [&](std::vector<int64_t> size, std::vector<fsdpx::dcp::Chunk> boxes) {
    fsdpx::dcp::Metadata md;
    for (const auto& box : boxes)
      md.storage[{"w", box.offsets}] = {.relative_path = "__0_0.distcp", .length = chunk.bytes};
    md.entries["w"] =
        fsdpx::dcp::TensorEntry{.dtype = c10::kFloat, .size = std::move(size), .chunks = std::move(boxes)};
    fsdpx::dcp::write_metadata(dir / fsdpx::dcp::metadata_file_name, md);
  };
  // two columns of 2^27 rows: one piece per row (3 GiB of them) before, refused at open now
  const int64_t rows = int64_t{1} << 27;
  folder({rows, 2}, {{{0, 0}, {rows, 1}}, {{0, 1}, {rows, 1}}});
  refused(dir, "is 134217728 elements of Float, more than its record of", [&] { fsdpx::dcp::Reader r(dir); });
  // a tensor of 2^40 elements: allocated whole before its chunk was read, refused at open now
  folder({int64_t{1} << 40}, {{{0}, {int64_t{1} << 40}}});
  refused(dir, "is 1099511627776 elements of Float, more than its record of",
          [&] { fsdpx::dcp::Reader(dir).read("w"); });
  folder({4}, {{{0}, {4}}});
  CHECK(at::equal(fsdpx::dcp::Reader(dir).read("w"), at::arange(4, at::kFloat)));
}

// PyTorch Distributed Checkpoint's .metadata (dcp/metadata.hpp) and the restricted pickle reader beneath
// it (pickle/pickle.hpp): a real file torch wrote, crafted files that name
// other classes, claim more than they hold, end early, nest deeply or hold themselves (each refused with
// an error naming the cause, none crashing), and the writer's round trip.
// (python_dcp_metadata_test.py checks the same against torch itself.)
#include <catch2/catch.hpp>

#include <cstring>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include <fsdpx/dcp/metadata.hpp>
#include <fsdpx/pickle/pickle.hpp>

namespace dcp = fsdpx::dcp;
namespace pickle = fsdpx::pickle;
using Catch::Matchers::Contains;
using namespace std::string_literals;  // literals with NUL bytes in them

namespace {

// What torch 2.13 wrote for dcp.save({"a": torch.zeros(3, 4), "b": torch.tensor(3), "s": {"x": 1}},
// checkpoint_id="/tmp/dcpfix", no_dist=True): protocol 4, one FRAME, MEMOIZE after each new value.
const std::string real_file =
    "\x80\x04\x95!\x04\x00\x00\x00\x00\x00\x00\x8c%torch.distributed.checkpoint.metadata\x94\x8c\x08Metada"
    "ta\x94\x93\x94)\x81\x94}\x94(\x8c\x13state_dict_metadata\x94}\x94(\x8c\x01"
    "a\x94h\x00\x8c\x15Tensor"
    "StorageMetadata\x94\x93\x94)\x81\x94}\x94(\x8c\x0aproperties\x94h\x00\x8c\x10TensorProperties\x94\x93"
    "\x94)\x81\x94(\x8c\x05torch\x94\x8c\x07"
    "float32\x94\x93\x94\x8c\x13torch.serialization\x94\x8c\x0b_"
    "get_layout\x94\x93\x94\x8c\x0dtorch.strided\x94\x85\x94R\x94\x89h\x00\x8c\x14_MEM_FORMAT_ENCODING\x94"
    "\x93\x94K\x00\x85\x94R\x94\x89t\x94"
    "b\x8c\x04size\x94\x8c\x05torch\x94\x8c\x04Size\x94\x93\x94K\x03"
    "K\x04\x86\x94\x85\x94R\x94\x8c\x06"
    "chunks\x94]\x94h\x00\x8c\x14"
    "ChunkStorageMetadata\x94\x93\x94)"
    "\x81\x94}\x94(\x8c\x07offsets\x94h!K\x00K\x00\x86\x94\x85\x94R\x94\x8c\x05sizes\x94h!K\x03K\x04\x86\x94"
    "\x85\x94R\x94ubaub\x8c\x01"
    "b\x94h\x09)\x81\x94}\x94(h\x0ch\x0e)\x81\x94(h\x10\x8c\x05int64\x94\x93\x94"
    "h\x18\x89h\x1c\x89t\x94"
    "bh\x1eh!)\x85\x94R\x94h%]\x94h()\x81\x94}\x94(h+h!)\x85\x94R\x94h/h!)\x85\x94"
    "R\x94ubaub\x8c\x03s.x\x94h\x00\x8c\x14"
    "BytesStorageMetadata\x94\x93\x94)\x81\x94u\x8c\x0cplanner_da"
    "ta\x94}\x94(h\x07h\x07\x85\x94h3h3\x85\x94hC\x8c\x01s\x94\x8c\x01x\x94\x86\x94u\x8c\x0cstorage_data\x94"
    "}\x94(h\x00\x8c\x0dMetadataIndex\x94\x93\x94)\x81\x94}\x94(\x8c\x03"
    "fqn\x94hC\x8c\x05index\x94Nub\x8c"
    "'torch.distributed.checkpoint.filesystem\x94\x8c\x0c_StorageInfo\x94\x93\x94)\x81\x94}\x94(\x8c\x0dre"
    "lative_path\x94\x8c\x0c__0_0.distcp\x94\x8c\x06offset\x94K\x00\x8c\x06length\x94M\xed\x04ubhQ)\x81\x94"
    "}\x94(hTh\x07hUK\x00h]h!K\x00K\x00\x86\x94\x85\x94R\x94ubhX)\x81\x94}\x94(h[h\x5ch]M\xed\x04h^M)\x06u"
    "bhQ)\x81\x94}\x94(hTh3hUK\x00h]h!)\x85\x94R\x94ubhX)\x81\x94}\x94(h[h\x5ch]M\x16\x0bh^M)\x06ubu\x8c\x0c"
    "storage_meta\x94h\x00\x8c\x0bStorageMeta\x94\x93\x94)\x81\x94}\x94(\x8c\x0d"
    "checkpoint_id\x94\x8c\x07"
    "pathlib\x94\x8c\x09PosixPath\x94\x93\x94\x8c\x01/\x94\x8c\x03tmp\x94\x8c\x06"
    "dcpfix\x94\x87\x94R\x94"
    "\x8c\x07save_id\x94\x8c$7c99edae-9ce9-4b67-a4eb-fe81598596b1\x94\x8c\x07load_id\x94N\x8c\x07modules\x94"
    "]\x94ub\x8c\x07version\x94\x8c\x05"
    "1.0.0\x94ub."s;
// The same without its FRAME (bytes 2 to 10), whose length is the one byte count a pickle holds: the
// crafted files below change the lengths of strings in it.
const std::string unframed = real_file.substr(0, 2) + real_file.substr(11);

std::vector<std::byte> bytes(std::string_view s) {
  const auto* b = reinterpret_cast<const std::byte*>(s.data());
  return {b, b + s.size()};
}

std::string text(const std::vector<std::byte>& b) { return {reinterpret_cast<const char*>(b.data()), b.size()}; }

/// `s` with its one occurrence of `from` replaced.
std::string replaced(std::string s, std::string_view from, std::string_view to) {
  const size_t at = s.find(from);
  REQUIRE(at != std::string::npos);
  REQUIRE(s.find(from, at + 1) == std::string::npos);
  return s.replace(at, from.size(), to);
}

/// SHORT_BINUNICODE of s.
std::string short_string(std::string_view s) {
  return std::string("\x8c") + static_cast<char>(s.size()) + std::string(s);
}

dcp::Metadata parse(std::string_view s) { return dcp::parse_metadata(std::as_bytes(std::span(s.data(), s.size()))); }

bool any_global(std::string_view, std::string_view) { return true; }
pickle::Pickle parse_pickle(std::string_view s, const pickle::Limits& limits = {}) {
  return pickle::parse(std::as_bytes(std::span(s.data(), s.size())), "crafted", any_global, limits);
}

/// A checkpoint of two tensors in 2 and 3 chunks over 2 files, a bytes entry, and every optional field.
dcp::Metadata sample() {
  dcp::Metadata md;
  md.entries["model.w"] = dcp::TensorEntry{
      .dtype = c10::kBFloat16, .size = {5, 2}, .chunks = {{{0, 0}, {3, 2}}, {{3, 0}, {2, 2}}}, .requires_grad = true};
  md.entries["model.b"] = dcp::TensorEntry{.dtype = c10::ScalarType::Float8_e4m3fn,
                                           .size = {7},
                                           .chunks = {{{0}, {3}}, {{3}, {3}}, {{6}, {1}}},
                                           .memory_format = dcp::MemoryFormat::channels_last};
  md.entries["optim.state.model.w.step"] = dcp::TensorEntry{.dtype = c10::kLong, .chunks = {{{}, {}}}};
  md.entries["optim.param_groups.0.lr"] = dcp::BytesEntry{};
  md.storage[{"model.w", std::vector<int64_t>{0, 0}}] = {
      .relative_path = "__0_0.distcp", .length = 1577, .chunk_index = 0};
  md.storage[{"model.w", std::vector<int64_t>{3, 0}}] = {
      .relative_path = "__1_0.distcp", .offset = 70000, .length = 1577, .chunk_index = 1};
  md.storage[{"model.b", std::vector<int64_t>{0}}] = {.relative_path = "__0_0.distcp", .offset = 1577, .length = 9};
  md.storage[{"model.b", std::vector<int64_t>{3}}] = {.relative_path = "__1_0.distcp",
                                                      .offset = int64_t{1} << 40,
                                                      .length = 9,
                                                      .transform_descriptors = std::vector<std::string>{"zstd"}};
  md.storage[{"model.b", std::vector<int64_t>{6}}] = {
      .relative_path = "__1_0.distcp", .offset = -1 + (int64_t{1} << 31), .length = 3};
  md.storage[{"optim.state.model.w.step", std::vector<int64_t>{}}] = {.relative_path = "__1_0.distcp", .length = 1};
  md.storage[{"optim.param_groups.0.lr", std::nullopt}] = {
      .relative_path = "__0_0.distcp", .offset = 3000, .length = 1261};
  md.planner_data = {{"model.w", {"model", "w"}},
                     {"optim.param_groups.0.lr", {"optim", "param_groups", int64_t{0}, "lr"}}};
  md.storage_meta = dcp::StorageMeta{
      .checkpoint_id = "/tmp/ckpt/step_5", .checkpoint_id_is_path = true, .save_id = "uuid-1", .modules = {"m1", "m2"}};
  md.version = dcp::current_version;
  return md;
}

}  // namespace

TEST_CASE("dcp metadata: torch's own file reads with every field", "[dcp]") {
  const dcp::Metadata md = parse(real_file);
  REQUIRE(md.entries.size() == 3);
  const auto& a = std::get<dcp::TensorEntry>(md.entries.at("a"));
  CHECK(a.dtype == c10::kFloat);
  CHECK(a.size == std::vector<int64_t>{3, 4});
  CHECK(a.chunks == std::vector<dcp::Chunk>{{{0, 0}, {3, 4}}});
  CHECK(a.memory_format == dcp::MemoryFormat::contiguous);
  CHECK_FALSE(a.requires_grad);
  const auto& b = std::get<dcp::TensorEntry>(md.entries.at("b"));
  CHECK(b.dtype == c10::kLong);
  CHECK(b.size.empty());
  CHECK(b.chunks == std::vector<dcp::Chunk>{{{}, {}}});
  CHECK(std::holds_alternative<dcp::BytesEntry>(md.entries.at("s.x")));

  REQUIRE(md.storage.size() == 3);
  const dcp::StorageInfo& sa = md.storage.at({"a", std::vector<int64_t>{0, 0}});
  CHECK(sa == dcp::StorageInfo{.relative_path = "__0_0.distcp", .offset = 1261, .length = 1577, .chunk_index = 0});
  CHECK(md.storage.at({"b", std::vector<int64_t>{}}).offset == 2838);
  const dcp::StorageInfo& sx = md.storage.at({"s.x", std::nullopt});
  CHECK((sx.offset == 0 && sx.length == 1261 && !sx.chunk_index && !sx.transform_descriptors));

  REQUIRE(md.planner_data);
  CHECK(md.planner_data->at("s.x") == std::vector<dcp::PathStep>{"s", "x"});
  REQUIRE(md.storage_meta);
  CHECK(md.storage_meta->checkpoint_id == "/tmp/dcpfix");
  CHECK(md.storage_meta->checkpoint_id_is_path);
  CHECK(md.storage_meta->save_id == "7c99edae-9ce9-4b67-a4eb-fe81598596b1");
  CHECK_FALSE(md.storage_meta->load_id);
  CHECK(md.storage_meta->modules.empty());
  CHECK(md.version == "1.0.0");
}

TEST_CASE("dcp metadata: written, it reads back the same", "[dcp]") {
  const dcp::Metadata md = sample();
  const std::vector<std::byte> written = dcp::serialize_metadata(md);
  CHECK(dcp::parse_metadata(written) == md);
  // torch's own file, rewritten, is the same metadata
  const dcp::Metadata real = parse(real_file);
  CHECK(dcp::parse_metadata(dcp::serialize_metadata(real)) == real);
  // DCP's shape in protocol 2: the Metadata dataclass NEWOBJ'd and BUILT, the layout REDUCE'd
  const std::string w = text(written);
  CHECK(
      w.starts_with("\x80\x02"
                    "ctorch.distributed.checkpoint.metadata\nMetadata\nq" +
                    std::string(1, '\0') + ")\x81}"));
  CHECK(w.ends_with("b."));
  CHECK_THAT(w, Contains("ctorch.serialization\n_get_layout\nq\x07X\x0d" + std::string(3, '\0') + "torch.strided"));
  // None fields are written as None, absent ones (a storage_meta of None) as None too
  dcp::Metadata bare = md;
  bare.planner_data.reset();
  bare.storage_meta.reset();
  bare.version.reset();
  CHECK(dcp::parse_metadata(dcp::serialize_metadata(bare)) == bare);
}

TEST_CASE("dcp metadata: the writer refuses what the reader would", "[dcp]") {
  dcp::Metadata md = sample();
  std::get<dcp::TensorEntry>(md.entries["model.w"]).chunks[1].sizes = {3, 2};  // rows 3..6 of 5
  CHECK_THROWS_WITH(dcp::serialize_metadata(md), Contains("entry 'model.w'") && Contains("not within it"));
  md = sample();
  md.storage.erase({"model.b", std::vector<int64_t>{6}});
  CHECK_THROWS_AS(dcp::serialize_metadata(md), fsdpx::ConfigError);
  CHECK_THROWS_WITH((dcp::validate_metadata(md, "x")), Contains("entry 'model.b' has no storage record for its chunk"));
  md = sample();
  md.storage[{"model.w", std::vector<int64_t>{0, 0}}].relative_path = "../other/__0_0.distcp";
  CHECK_THROWS_WITH(dcp::serialize_metadata(md), Contains("not a file name in the checkpoint directory"));
  md = sample();
  std::get<dcp::TensorEntry>(md.entries["model.b"]).chunks.pop_back();
  md.storage.erase({"model.b", std::vector<int64_t>{6}});
  CHECK_THROWS_WITH(dcp::serialize_metadata(md), Contains("chunks of 6 elements in all, not its 7"));
  md = sample();
  md.storage[{"ghost", std::nullopt}] = {.relative_path = "__0_0.distcp"};
  CHECK_THROWS_WITH(dcp::serialize_metadata(md), Contains("'ghost', which is no entry"));
  md = sample();
  std::get<dcp::TensorEntry>(md.entries["model.b"]).dtype = c10::ScalarType::QInt8;
  CHECK_THROWS_WITH(dcp::serialize_metadata(md), Contains("has no torch name"));
  md = sample();
  md.entries["bad\xff"] = dcp::BytesEntry{};
  md.storage[{"bad\xff", std::nullopt}] = {.relative_path = "__0_0.distcp"};
  CHECK_THROWS_WITH(dcp::serialize_metadata(md), Contains("not UTF-8"));
}

TEST_CASE("dcp metadata: globals outside the allow-list are refused by name", "[dcp][security]") {
  // GLOBAL os.system, REDUCE'd with a shell command
  CHECK_THROWS_WITH(parse("\x80\x04"
                          "cos\nsystem\n"
                          "\x8c\x05"
                          "echo!\x85R."),
                    Contains("'os.system'") && Contains("GLOBAL = 0x63 at byte 2"));
  // STACK_GLOBAL builtins.eval
  CHECK_THROWS_WITH(parse("\x80\x04\x8c\x08"
                          "builtins\x8c\x04"
                          "eval\x93\x8c\x01x\x85R."),
                    Contains("'builtins.eval'") && Contains("STACK_GLOBAL"));
  // inside a real file: the dtype replaced by os.system
  CHECK_THROWS_WITH(parse(replaced(unframed, short_string("torch") + "\x94" + short_string("float32"),
                                   short_string("posix") + "\x94" + short_string("system"))),
                    Contains("'posix.system'"));
  // torch's own, but not a class DCP uses
  CHECK_THROWS_WITH(parse(replaced(unframed, short_string("Size"), short_string("load"))), Contains("'torch.load'"));
  // a dtype torch has and fsdpx does not map is refused naming it
  CHECK_THROWS_WITH(parse(replaced(unframed, short_string("float32"), short_string("qint8"))),
                    Contains("dtype torch.qint8") && Contains("entry 'a'"));
  // and refused opcodes by name: INST, PERSID, NEWOBJ_EX, EXT1
  for (const std::string& op :
       {std::string("\x80\x04"
                    "i"),
        std::string("\x80\x04P1\n."), std::string("\x80\x04\x92"), std::string("\x80\x04\x82\x01")}) {
    CHECK_THROWS_WITH(parse(op), Contains("not an opcode of the pickles fsdpx reads"));
  }
}

TEST_CASE("dcp metadata: REDUCE and NEWOBJ call nothing and only admitted classes", "[dcp][security]") {
  // REDUCE of a string, a tuple and a list: never callables
  CHECK_THROWS_WITH(parse("\x80\x04\x8c\x06system)R."),
                    Contains("calls a string, not an admitted class") && Contains("REDUCE"));
  CHECK_THROWS_WITH(parse("\x80\x04))R."), Contains("calls a tuple"));
  CHECK_THROWS_WITH(parse("\x80\x04])\x81."), Contains("calls a list") && Contains("NEWOBJ"));
  // an admitted class made by REDUCE where torch makes it by NEWOBJ (a call where torch never calls)
  CHECK_THROWS_WITH(parse(replaced(unframed, "\x93\x94)\x81\x94}\x94(\x8c\x13state_dict_metadata",
                                   "\x93\x94)R\x94}\x94(\x8c\x13state_dict_metadata")),
                    Contains("made by a call"));
  // the state of an object is recorded, never applied: BUILD on a non-object, or twice
  CHECK_THROWS_WITH(parse("\x80\x04}}b."), Contains("builds a dict"));
  const pickle::Pickle p = parse_pickle(
      "\x80\x04\x8c\x01m\x8c\x01"
      "C\x93)\x81}b.");
  CHECK(p[p.root].kind == pickle::Kind::object);
  CHECK(p[p[p.root].items[0]].text == "m");
  CHECK_THROWS_WITH(parse_pickle("\x80\x04\x8c\x01m\x8c\x01"
                                 "C\x93)\x81}b}b."),
                    Contains("builds the same object twice"));
}

TEST_CASE("dcp metadata: huge claims are refused before anything is allocated", "[dcp][security]") {
  // a pickle's list has no count to claim: a list of 2^40 entries needs them all in the file, each a value
  // counted as it comes, refused at the limit (here 1000)
  std::string many = "\x80\x04](";
  for (int i = 0; i < 2000; ++i) many += "K\x01";
  many += "e.";
  pickle::Limits small;
  small.max_values = 1000;
  CHECK_THROWS_WITH((parse_pickle(many, small)), Contains("makes more than 1000 values"));
  // a string of 2^40 bytes, in a file of a few
  CHECK_THROWS_WITH(parse(std::string("\x80\x04\x8d", 3) + std::string("\x00\x00\x00\x00\x00\x01\x00\x00", 8) + "abc."),
                    Contains("a string of 1099511627776 bytes runs past the end") && Contains("BINUNICODE8"));
  CHECK_THROWS_WITH(parse(std::string("\x80\x04\x8e\xff\xff\xff\xff\xff\xff\xff\xff", 11) + "."),
                    Contains("bytes object of 18446744073709551615 bytes"));
  // a memo index of 2^32 - 1: would size the memo to 4 G entries
  CHECK_THROWS_WITH(parse("\x80\x04N\x72\xff\xff\xff\xff."), Contains("makes more than") && Contains("LONG_BINPUT"));
  // a frame claiming 2^40 bytes
  CHECK_THROWS_WITH(parse(std::string("\x80\x04\x95\x00\x00\x00\x00\x00\x01\x00\x00N.", 13)),
                    Contains("a frame of 1099511627776 bytes"));
  // an integer of 200 bytes
  CHECK_THROWS_WITH(parse(std::string("\x80\x04\x8a\xc8", 4) + std::string(200, '\x01') + "."),
                    Contains("an integer of 200 bytes"));
  // a string whose length runs past the end of the file
  CHECK_THROWS_WITH(parse(replaced(unframed, short_string("version"), "\x8c\xc8version")),
                    Contains("a string of 200 bytes runs past the end of the pickle"));
  // the file itself, over the caller's limit
  dcp::MetadataLimits tight;
  tight.max_bytes = 100;
  CHECK_THROWS_WITH((dcp::parse_metadata(bytes(real_file), "x", tight)), Contains("has 1068 bytes"));
  // the values a whole file makes, over the caller's limit
  tight = {};
  tight.max_values = 100;
  CHECK_THROWS_WITH((dcp::parse_metadata(dcp::serialize_metadata(sample()), "x", tight)),
                    Contains("makes more than 100 values"));
}

TEST_CASE("dcp metadata: every truncation of a real file is refused naming where", "[dcp][security]") {
  // torch's file, whose FRAME says how long it is, and the same without the FRAME, which each opcode's
  // own reads find short
  CHECK_NOTHROW(parse(unframed));
  for (const std::string& file : {real_file, unframed}) {
    for (size_t n = 0; n < file.size(); ++n) {
      INFO("the first " << n << " bytes");
      try {
        parse(std::string_view(file).substr(0, n));
        FAIL("a truncated file parsed");
      } catch (const fsdpx::IoError& e) {
        const std::string what = e.what();
        CHECK((what.find("truncated") != std::string::npos || what.find("runs past the end") != std::string::npos));
        CHECK_THAT(what, Contains(" at byte "));
      }
    }
  }
}

TEST_CASE("dcp metadata: every byte of a real file changed parses or is refused, never crashes", "[dcp][security]") {
  int refused = 0;
  for (size_t i = 0; i < real_file.size(); ++i) {
    for (const unsigned char v : {0x00, 0x01, 0x7f, 0x80, 0xff}) {
      std::string s = real_file;
      if (static_cast<unsigned char>(s[i]) == v) continue;
      s[i] = static_cast<char>(v);
      try {
        parse(s);
      } catch (const fsdpx::Error&) {
        ++refused;
      }
    }
  }
  CHECK(refused > 4000);
}

TEST_CASE("dcp metadata: a pickle that holds itself or nests deeply is a graph, refused by the schema",
          "[dcp][security]") {
  // l = []; l.append(l)
  const std::string self_list =
      "\x80\x04]\x94h\x00"
      "a."s;
  const pickle::Pickle p = parse_pickle(self_list);
  CHECK(p[p.root].items == std::vector<pickle::Id>{p.root});
  CHECK_THROWS_WITH(parse(self_list), Contains("the file's value is a list, not an object"));
  // a chunk list that holds itself, in a real file
  CHECK_THROWS_WITH(parse(replaced(unframed,
                                   "\x8c\x06"
                                   "chunks\x94]\x94",
                                   "\x8c\x06"
                                   "chunks\x94]\x94h&a")),
                    Contains("entry 'a''s chunk is a list, not an object"));
  // a dict that holds itself as a value
  CHECK_THROWS_WITH(parse("\x80\x04}\x94\x8c\x01kh\x00s."s), Contains("is a dict, not an object"));
  // 200000 lists each in the one before: no recursion reads or frees them
  std::string deep = "\x80\x04";
  deep += std::string(200000, ']');
  deep += std::string(199999, 'a');
  deep += ".";
  CHECK(parse_pickle(deep).nodes.size() == 200000);
  CHECK_THROWS_WITH(parse(deep), Contains("is a list, not an object"));
  // MARKs nest up to the limit
  CHECK_THROWS_WITH(parse("\x80\x04" + std::string(100, '(')), Contains("opens more than 64 MARKs"));
  CHECK_THROWS_WITH(parse("\x80\x04" + std::string(100000, ')') + "."),
                    Contains("ends with 100000 values on the stack"));
  pickle::Limits stack;
  stack.max_stack = 1000;
  CHECK_THROWS_WITH((parse_pickle("\x80\x04" + std::string(2000, 'N') + ".", stack)),
                    Contains("more than 1000 values on its stack"));
}

TEST_CASE("dcp metadata: malformed programs are refused", "[dcp][security]") {
  CHECK_THROWS_WITH(parse("\x80\x04h\x05."), Contains("reads memo entry 5, which was never stored"));
  CHECK_THROWS_WITH(parse("\x80\x04"
                          "a."),
                    Contains("needs a value on the stack"));
  CHECK_THROWS_WITH(parse("\x80\x04(N"
                          "a."),
                    Contains("needs a value on the stack"));  // APPEND cannot reach below a MARK
  CHECK_THROWS_WITH(parse("\x80\x04N"
                          "t."),
                    Contains("closes a MARK that was never opened"));
  CHECK_THROWS_WITH(parse("\x80\x04}(N"
                          "u."),
                    Contains("keys and values must pair"));
  CHECK_THROWS_WITH(parse("\x80\x04}]Ns."), Contains("a dict key that is a list"));
  CHECK_THROWS_WITH(parse("\x80\x04NN"
                          "a."),
                    Contains("adds to None, not to a list"));
  CHECK_THROWS_WITH(parse("\x80\x09."), Contains("protocol 9"));
  CHECK_THROWS_WITH(parse("\x80\x04N.junk"), Contains("followed by 4 more bytes"));
  CHECK_THROWS_WITH(parse("\x80\x04\x8c\x02\xc3(."), Contains("not UTF-8"));
  CHECK_THROWS_WITH(parse("\x80\x04"
                          "cos"),
                    Contains("no end of line"));
  CHECK_THROWS_WITH(parse(""), Contains("truncated: it ends at byte 0"));
  // integers: BININT is signed, LONG1 sign-extends
  const pickle::Pickle ints = parse_pickle(std::string("\x80\x04J\xfe\xff\xff\xff\x8a\x02\x00\x80\x8a\x00\x87.", 15));
  const auto& items = ints[ints.root].items;
  CHECK(ints[items[0]].integer == -2);
  CHECK(ints[items[1]].integer == -32768);
  CHECK(ints[items[2]].integer == 0);
}

TEST_CASE("dcp metadata: the pickle writer's integers and strings are Python's", "[dcp]") {
  pickle::Writer w;
  const std::vector<int64_t> values = {0,
                                       255,
                                       256,
                                       65535,
                                       65536,
                                       -1,
                                       2147483647,
                                       -2147483648,
                                       2147483648,
                                       -2147483649,
                                       int64_t{1} << 40,
                                       std::numeric_limits<int64_t>::max(),
                                       std::numeric_limits<int64_t>::min()};
  w.list(values.size(), [&](size_t i) { w.integer(values[i]); });
  const std::string out = text(std::move(w).finish());
  CHECK(
      out.starts_with(std::string("\x80\x02](K\x00K\xffM\x00\x01M\xff\xff"
                                  "J\x00\x00\x01\x00"
                                  "J\xff\xff\xff\xff",
                                  24)));
  const pickle::Pickle p = parse_pickle(out);
  REQUIRE(p[p.root].items.size() == values.size());
  for (size_t i = 0; i < values.size(); ++i) CHECK(p[p[p.root].items[i]].integer == values[i]);
}

TEST_CASE("dcp metadata: a string the memo shares is counted at every copy, against a stated total",
          "[dcp][security][memory]") {
  // One entry with a 64 KiB name in 200 chunks: the writer memoizes the name, so the file holds it once and
  // names it 200 times (each storage_data key); the reader copies it each time.
  dcp::Metadata md;
  const std::string fqn(64 << 10, 'n');
  dcp::TensorEntry t{.dtype = c10::kFloat, .size = {200}};
  for (int64_t i = 0; i < 200; ++i) {
    t.chunks.push_back({{i}, {1}});
    md.storage[{fqn, std::vector<int64_t>{i}}] = {.relative_path = "__0_0.distcp", .offset = 4 * i, .length = 4};
  }
  md.entries[fqn] = t;
  const std::vector<std::byte> file = dcp::serialize_metadata(md);
  CHECK(file.size() < (std::size_t{80} << 10));  // the name once, 13 MiB as copies
  CHECK(dcp::parse_metadata(file).storage.size() == 200);
  dcp::MetadataLimits limits;
  limits.max_text_bytes = 1 << 20;
  CHECK_THROWS_WITH(dcp::parse_metadata(file, "shared.metadata", limits),
                    Contains("makes strings of more than 1048576 bytes in all (each copy of a string the pickle shares "
                             "counted)"));
}

TEST_CASE("dcp metadata: an entry named in a lone surrogate is refused where it is read, naming it",
          "[dcp][security]") {
  dcp::Metadata md;
  const std::string name = "model.\xed\xa0\x80.weight";  // U+D800, which Python's pickle writes and JSON refuses
  md.entries[name] = dcp::TensorEntry{.dtype = c10::kFloat, .size = {2}, .chunks = {{{0}, {2}}}};
  md.storage[{name, std::vector<int64_t>{0}}] = {.relative_path = "__0_0.distcp", .length = 8};
  CHECK_THROWS_WITH(dcp::parse_metadata(dcp::serialize_metadata(md)),
                    Contains("an entry's name 'model.\\xed\\xa0\\x80.weight' is not valid UTF-8"));
  CHECK(pickle::valid_utf8("h\xc3\xa9llo \xf0\x9f\x98\x80", true));
  CHECK_FALSE(pickle::valid_utf8("\xe0\x80\xaf", true));  // an overlong '/'
  CHECK(pickle::valid_utf8("\xed\xa0\x80"));              // Python's surrogatepass, for other strings
}

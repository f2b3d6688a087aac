// Python pickles, as far as checkpoints need them: a restricted reader (protocols 2 to 5) and a writer
// (protocol 2). PyTorch Distributed Checkpoint's `.metadata` (dcp/metadata.hpp) and the plain values of
// its bytes entries are pickles; so is every torch.save archive's data.pkl.
//
// The reader never executes anything. A pickle is a program for a small stack machine; here its values
// are inert nodes: GLOBAL names only what the caller's allow-list admits, and REDUCE, NEWOBJ and BUILD
// record a class, its arguments and its state without calling anything. Every count is checked before
// anything is allocated (the input, each string, the stack, the marks, the memo, the values made), so a
// crafted file costs at most its limits; and nothing here recurses, so a pickle that nests deeply or
// holds itself (a list appended into itself through the memo) is a graph of nodes, for the caller's
// fixed schema to refuse. Torch-free (tools/check_layers.py checks it), so that it compiles fast.
#pragma once

#include <fsdpx/detail/config.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fsdpx/error.hpp>

namespace fsdpx::pickle {

enum class Kind : uint8_t {
  none,
  boolean,
  integer,
  floating,
  string,
  bytes,
  tuple,
  list,
  dict,
  global,
  object,
  persistent
};

/// A value's kind in words, for errors ("a tuple").
FSDPX_DECL const char* to_string(Kind k);

/// Python's name of a pickle opcode ("GLOBAL"), also of those the reader refuses, so that an error says
/// what a crafted file tried; nullptr for a byte that is no opcode.
FSDPX_DECL const char* opcode_name(uint8_t code);

/// Whether `s` is UTF-8 as Python decodes a pickle's strings (encoded surrogates pass), or, `strict`, UTF-8
/// as a JSON file or another library reads it (no surrogate, no overlong form): what a name must be.
FSDPX_DECL bool valid_utf8(std::string_view s, bool strict = false);

/// `s` with every byte outside printable ASCII written as \xNN, for an error that names a crafted string.
FSDPX_DECL std::string escaped(std::string_view s);

/// A node's index in its Pickle.
using Id = uint32_t;

/// One value a pickle made. Strings view the parsed bytes, which must outlive the Pickle.
struct Node {
  Kind kind = Kind::none;
  bool reduced = false;  // object: made by REDUCE (a call in Python) rather than NEWOBJ (cls.__new__)
  int64_t offset = 0;    // the byte of the opcode that made it, for errors
  int64_t integer = 0;   // boolean (0 or 1), integer
  double floating = 0;
  std::string_view text;  // string, bytes; global: the module
  std::string_view name;  // global: the name in the module
  // tuple, list: the elements; dict: key, value, key, value, ... in order; object: the class (a global),
  // the arguments (a tuple) and, once BUILD gave it one, the state; persistent: the persistent id
  std::vector<Id> items;
};

/// What a parse may cost, each refused with an IoError before it is allocated, and what it admits.
struct Limits {
  int64_t max_bytes = int64_t{256} << 20;
  /// Nodes, container elements and memo entries together (about 100 bytes each at most).
  int64_t max_values = int64_t{1} << 25;
  /// Values on the stack at once (a pickler batches containers: Python by 1000).
  int64_t max_stack = int64_t{1} << 20;
  /// MARKs open at once.
  int max_marks = 64;
  /// Whether BINPERSID may make a persistent reference (Kind::persistent, resolved by the caller): a
  /// torch.save archive names its storages so.
  bool persistent_ids = false;
};

/// A parsed pickle: its nodes and the one value it returns.
struct Pickle {
  std::vector<Node> nodes;
  Id root = 0;
  const Node& operator[](Id id) const { return nodes[id]; }
};

/// Whether GLOBAL / STACK_GLOBAL may name `module`.`name`.
using AllowGlobal = bool (*)(std::string_view module, std::string_view name);

/// Runs the pickle in `data` (protocol 2 to 5; one pickle, nothing after its STOP). Anything else, a
/// refused global, an opcode outside the set that plain values and dataclasses use, a truncated or
/// malformed program, or a limit passed, is an IoError naming `what`, the opcode and its byte offset. `what` says
/// what the bytes are as a message would (`checkpoint file '/ckpt/x.pt'`), quotes included: it is used as given.
/// `collections.OrderedDict()` (where `allow` admits it) is made as the dict it is, its items set by
/// SETITEMS and its attributes (BUILD: a state dict's `_metadata`) counted and dropped.
FSDPX_DECL Pickle parse(std::span<const std::byte> data, std::string_view what, AllowGlobal allow,
                        const Limits& limits = {});

/// Writes what Python's pickler writes in protocol 2: dataclass instances NEWOBJ'd with an empty tuple
/// then BUILD with their state, strings and globals memoized (the second use is a BINGET), containers
/// batched by 1000. Protocol 2, not the 4 that torch writes: protocol 4 adds only encodings (FRAME,
/// MEMOIZE, STACK_GLOBAL, SHORT_BINUNICODE) that torch's weights_only unpickler does not read, while
/// Python's pickle.load reads protocol 2 as well; so both read what this writes.
class Writer {
 public:
  Writer() { out_ = {std::byte{0x80}, std::byte{2}}; }

  void none() { op('N'); }
  void boolean(bool v) { op(v ? 0x88 : 0x89); }
  FSDPX_DECL void integer(int64_t v);
  FSDPX_DECL void floating(double v);
  FSDPX_DECL void string(std::string_view s);
  /// A class or function by name (GLOBAL), memoized.
  FSDPX_DECL void global(std::string_view module, std::string_view name);
  /// A tuple of n values, each written by each(i): TUPLE1 to TUPLE3 for up to 3, else MARK ... TUPLE.
  template <class Each>
  void tuple(size_t n, Each&& each) {
    if (n > 3) op('(');
    for (size_t i = 0; i < n; ++i) each(i);
    op(n == 0 ? ')' : n == 1 ? 0x85 : n == 2 ? 0x86 : n == 3 ? 0x87 : 't');
  }
  /// A list of n values, each written by each(i).
  template <class Each>
  void list(size_t n, Each&& each) {
    op(']');
    batches(n, each, 'a', 'e');
  }
  /// A dict of n items, each(i) writing a key and its value.
  template <class Each>
  void dict(size_t n, Each&& each) {
    op('}');
    batches(n, each, 's', 'u');
  }
  /// `module.name` instantiated without arguments (a dataclass: copyreg's __newobj__ of an empty tuple);
  /// its state follows, then build().
  void new_object(std::string_view module, std::string_view name) {
    global(module, name);
    op(')');
    op(0x81);
  }
  void build() { op('b'); }
  /// Calls the global below the argument tuple on the stack (what a class's __reduce__ says).
  void reduce() { op('R'); }
  /// The pickle, ended with STOP.
  std::vector<std::byte> finish() && {
    op('.');
    return std::move(out_);
  }

 private:
  void op(int code) { out_.push_back(static_cast<std::byte>(code)); }
  FSDPX_DECL void memo_op(int one_byte, int four_bytes, uint32_t index);
  void memo_get(uint32_t index) { memo_op('h', 'j', index); }
  /// Memoizes the value just written (BINPUT), under the next index.
  uint32_t memo_put() {
    memo_op('q', 'r', memo_size_);
    return memo_size_++;
  }
  FSDPX_DECL void raw(const void* data, size_t n);
  template <class Each>
  void batches(size_t n, Each& each, int one, int many) {
    // Python's batches: a batch of one is APPEND / SETITEM, larger ones MARK ... APPENDS / SETITEMS.
    for (size_t begin = 0; begin < n; begin += batch) {
      const size_t end = std::min(n, begin + batch);
      if (end - begin > 1) op('(');
      for (size_t i = begin; i < end; ++i) each(i);
      op(end - begin > 1 ? many : one);
    }
  }

  static constexpr size_t batch = 1000;
  std::vector<std::byte> out_;
  std::map<std::string, uint32_t, std::less<>> memo_;  // "s" + a string; "g" + module + "\n" + name
  uint32_t memo_size_ = 0;
};

}  // namespace fsdpx::pickle

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/pickle/impl/pickle.ipp>
#endif

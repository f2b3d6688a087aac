// Out-of-line functions of fsdpx/pickle/pickle.hpp: included by it (header-only) or by
// fsdpx/impl/src.hpp (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <fsdpx/pickle/pickle.hpp>

#include <cstdio>
#include <cstring>
#include <limits>

namespace fsdpx::pickle {

FSDPX_DECL const char* to_string(Kind k) {
  switch (k) {
    case Kind::none: return "None";
    case Kind::boolean: return "a bool";
    case Kind::integer: return "an integer";
    case Kind::floating: return "a float";
    case Kind::string: return "a string";
    case Kind::bytes: return "bytes";
    case Kind::tuple: return "a tuple";
    case Kind::list: return "a list";
    case Kind::dict: return "a dict";
    case Kind::global: return "a class or function";
    case Kind::object: return "an object";
    case Kind::persistent: return "a persistent reference";
  }
  return "a value";
}

FSDPX_DECL const char* opcode_name(uint8_t code) {
  switch (code) {
    case 0x80: return "PROTO";
    case 0x95: return "FRAME";
    case 0x94: return "MEMOIZE";
    case 'q': return "BINPUT";
    case 'r': return "LONG_BINPUT";
    case 'h': return "BINGET";
    case 'j': return "LONG_BINGET";
    case 0x8c: return "SHORT_BINUNICODE";
    case 'X': return "BINUNICODE";
    case 0x8d: return "BINUNICODE8";
    case 'C': return "SHORT_BINBYTES";
    case 'B': return "BINBYTES";
    case 0x8e: return "BINBYTES8";
    case 'J': return "BININT";
    case 'K': return "BININT1";
    case 'M': return "BININT2";
    case 0x8a: return "LONG1";
    case 'G': return "BINFLOAT";
    case 'N': return "NONE";
    case 0x88: return "NEWTRUE";
    case 0x89: return "NEWFALSE";
    case ')': return "EMPTY_TUPLE";
    case 0x85: return "TUPLE1";
    case 0x86: return "TUPLE2";
    case 0x87: return "TUPLE3";
    case 't': return "TUPLE";
    case ']': return "EMPTY_LIST";
    case 'a': return "APPEND";
    case 'e': return "APPENDS";
    case '}': return "EMPTY_DICT";
    case 's': return "SETITEM";
    case 'u': return "SETITEMS";
    case '(': return "MARK";
    case 'c': return "GLOBAL";
    case 0x93: return "STACK_GLOBAL";
    case 0x81: return "NEWOBJ";
    case 'R': return "REDUCE";
    case 'b': return "BUILD";
    case '.': return "STOP";
    // refused
    case 'i': return "INST";
    case 'o': return "OBJ";
    case 0x92: return "NEWOBJ_EX";
    case 'P': return "PERSID";
    case 'Q': return "BINPERSID";
    case 0x82: return "EXT1";
    case 0x83: return "EXT2";
    case 0x84: return "EXT4";
    case 0x8b: return "LONG4";
    case 0x8f: return "EMPTY_SET";
    case 0x90: return "ADDITEMS";
    case 0x91: return "FROZENSET";
    case 0x96: return "BYTEARRAY8";
    case 0x97: return "NEXT_BUFFER";
    case 0x98: return "READONLY_BUFFER";
    case '0': return "POP";
    case '1': return "POP_MARK";
    case '2': return "DUP";
    case 'I': return "INT";
    case 'L': return "LONG";
    case 'F': return "FLOAT";
    case 'S': return "STRING";
    case 'T': return "BINSTRING";
    case 'U': return "SHORT_BINSTRING";
    case 'V': return "UNICODE";
    case 'd': return "DICT";
    case 'l': return "LIST";
    case 'p': return "PUT";
    case 'g': return "GET";
    default: return nullptr;
  }
}

FSDPX_DECL bool valid_utf8(std::string_view s, bool strict) {
  // Python decodes with "surrogatepass", so encoded surrogates pass here too, unless `strict`.
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<uint8_t>(s[i]);
    const size_t more = c < 0x80                 ? 0
                        : c >= 0xC2 && c < 0xE0  ? 1
                        : (c & 0xF0) == 0xE0     ? 2
                        : c >= 0xF0 && c <= 0xF4 ? 3
                                                 : 9;
    if (more > s.size() - i - 1) return false;
    for (size_t k = 1; k <= more; ++k) {
      if ((static_cast<uint8_t>(s[i + k]) & 0xC0) != 0x80) return false;
    }
    if (strict && more >= 2) {
      // the second byte's range: no overlong form (E0, F0), no surrogate (ED), nothing past U+10FFFF (F4)
      const auto next = static_cast<uint8_t>(s[i + 1]);
      if ((c == 0xE0 && next < 0xA0) || (c == 0xED && next > 0x9F) || (c == 0xF0 && next < 0x90) ||
          (c == 0xF4 && next > 0x8F))
        return false;
    }
    i += more + 1;
  }
  return true;
}

FSDPX_DECL std::string escaped(std::string_view s) {
  std::string out;
  for (const char ch : s) {
    const auto c = static_cast<uint8_t>(ch);
    if (c >= 0x20 && c < 0x7F) {
      out += ch;
    } else {
      char buf[5];
      std::snprintf(buf, sizeof buf, "\\x%02x", unsigned{c});
      out += buf;
    }
  }
  return out;
}

/// The stack machine of parse(): one pass over the bytes, no recursion.
class Machine {
 public:
  Machine(std::span<const std::byte> data, std::string_view what, AllowGlobal allow, const Limits& limits)
      : p_(reinterpret_cast<const uint8_t*>(data.data())),
        size_(static_cast<int64_t>(data.size())),
        what_(what),
        allow_(allow),
        limits_(limits),
        // Ids are 32 bits: more values than that cannot be counted, whatever the limit says.
        max_values_(std::min<int64_t>(limits.max_values, std::numeric_limits<Id>::max() - 1)) {}

  Pickle run() {
    FSDPX_CHECK_AS(IoError, size_ <= limits_.max_bytes, what_, " has ", size_,
                   " bytes; a pickle fsdpx reads may have at most ", limits_.max_bytes);
    while (true) {
      at_ = pos_;
      FSDPX_CHECK_AS(IoError, pos_ < size_, what_, " is truncated: it ends at byte ", size_,
                     " before the pickle's STOP");
      op_ = p_[pos_++];
      if (op_ == '.') return stop();
      step();
    }
  }

 private:
  static constexpr Id unset = std::numeric_limits<Id>::max();

  template <class... Args>
  [[noreturn]] void fail(const Args&... args) const {
    const char* name = opcode_name(op_);
    char code[8];
    std::snprintf(code, sizeof code, "0x%02x", unsigned{op_});
    throw IoError(::fsdpx::detail::str("fsdpx: ", what_, ": ", args..., " (opcode ", name != nullptr ? name : "",
                                       name != nullptr ? " = " : "", code, " at byte ", at_, ")"));
  }

  const uint8_t* take(uint64_t n) {
    if (n > static_cast<uint64_t>(size_ - pos_)) {
      fail("truncated: ", n, " bytes are needed at byte ", pos_, ", the pickle ends at byte ", size_);
    }
    const uint8_t* at = p_ + pos_;
    pos_ += static_cast<int64_t>(n);
    return at;
  }
  uint64_t little_endian(int n) {
    const uint8_t* b = take(static_cast<uint64_t>(n));
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; --i) v = (v << 8) | b[i];
    return v;
  }

  void spend(uint64_t n) {
    if (n > static_cast<uint64_t>(max_values_ - used_)) {
      fail("makes more than ", max_values_, " values (nodes, container elements and memo entries), the limit");
    }
    used_ += static_cast<int64_t>(n);
  }
  /// A new node of `kind`, made by the current opcode.
  Node& make(Kind kind) {
    spend(1);
    Node& n = nodes_.emplace_back();
    n.kind = kind;
    n.offset = at_;
    return n;
  }
  Id last() const { return static_cast<Id>(nodes_.size() - 1); }
  void push_new(Kind kind) {
    make(kind);
    push(last());
  }
  Node& at(Id id) { return nodes_[id]; }

  void push(Id id) {
    if (static_cast<int64_t>(stack_.size()) >= limits_.max_stack) {
      fail("holds more than ", limits_.max_stack, " values on its stack, the limit");
    }
    stack_.push_back(id);
  }
  size_t floor() const { return marks_.empty() ? 0 : marks_.back(); }
  Id top() {
    if (stack_.size() <= floor()) fail("needs a value on the stack and finds none");
    return stack_.back();
  }
  Id pop() {
    const Id id = top();
    stack_.pop_back();
    return id;
  }
  /// The values since the last MARK, which is closed.
  std::vector<Id> pop_mark() {
    if (marks_.empty()) fail("closes a MARK that was never opened");
    std::vector<Id> items(stack_.begin() + static_cast<std::ptrdiff_t>(marks_.back()), stack_.end());
    stack_.resize(marks_.back());
    marks_.pop_back();
    return items;
  }
  Node& container(Id id, Kind kind) {
    Node& n = at(id);
    if (n.kind != kind) fail("adds to ", to_string(n.kind), ", not to ", to_string(kind));
    return n;
  }

  void memo_put(uint64_t index, Id id) {
    if (index >= memo_.size()) {
      spend(index + 1 - memo_.size());  // before anything grows: a crafted index is refused here
      memo_.resize(static_cast<size_t>(index) + 1, unset);
    }
    memo_[static_cast<size_t>(index)] = id;
  }
  void memo_get(uint64_t index) {
    if (index >= memo_.size() || memo_[static_cast<size_t>(index)] == unset) {
      fail("reads memo entry ", index, ", which was never stored");
    }
    push(memo_[static_cast<size_t>(index)]);
  }

  void text(Kind kind, uint64_t n) {
    if (n > static_cast<uint64_t>(size_ - pos_)) {
      fail("a ", kind == Kind::string ? "string" : "bytes object", " of ", n,
           " bytes runs past the end of the pickle (", size_ - pos_, " bytes are left after its length)");
    }
    const std::string_view s(reinterpret_cast<const char*>(take(n)), static_cast<size_t>(n));
    if (kind == Kind::string && !valid_utf8(s)) fail("a string that is not UTF-8");
    make(kind).text = s;
    push(last());
  }
  void integer(int64_t v) {
    make(Kind::integer).integer = v;
    push(last());
  }

  void global(std::string_view module, std::string_view name) {
    if (!allow_(module, name)) {
      fail("names the global '", module, ".", name, "', which this file may not name (a pickle may name ",
           "only the classes its format uses; fsdpx runs nothing of it)");
    }
    Node& g = make(Kind::global);
    g.text = module;
    g.name = name;
    push(last());
  }
  /// GLOBAL's "module\nname\n".
  std::string_view line() {
    const void* end = std::memchr(p_ + pos_, '\n', static_cast<size_t>(size_ - pos_));
    if (end == nullptr) fail("truncated: its name has no end of line before the end of the pickle");
    const auto n = static_cast<uint64_t>(static_cast<const uint8_t*>(end) - (p_ + pos_));
    const std::string_view s(reinterpret_cast<const char*>(take(n)), static_cast<size_t>(n));
    take(1);
    return s;
  }

  void tuple(std::vector<Id> items) {
    spend(items.size());
    make(Kind::tuple).items = std::move(items);
    push(last());
  }
  /// NEWOBJ or REDUCE: an inert object recording its class and arguments; nothing is called.
  void object(bool reduced) {
    const Id args = pop(), cls = pop();
    if (at(args).kind != Kind::tuple) fail("passes ", to_string(at(args).kind), " as arguments, not a tuple");
    if (at(cls).kind != Kind::global) fail("calls ", to_string(at(cls).kind), ", not an admitted class");
    if (at(cls).text == "collections" && at(cls).name == "OrderedDict") {
      if (!at(args).items.empty()) fail("makes an OrderedDict from arguments; a pickler sets its items after");
      Node& d = make(Kind::dict);
      d.reduced = true;  // so BUILD may give it attributes
      return push(last());
    }
    spend(2);
    Node& obj = make(Kind::object);
    obj.reduced = reduced;
    obj.items = {cls, args};
    push(last());
  }
  void add(Kind kind, const std::vector<Id>& items) {
    if (kind == Kind::dict && items.size() % 2 != 0) fail("sets ", items.size(), " values: keys and values must pair");
    spend(items.size());
    Node& c = container(top(), kind);
    for (size_t i = 0; i < items.size(); i += kind == Kind::dict ? 2 : 1) {
      const Kind key = at(items[i]).kind;
      if (kind == Kind::dict && (key == Kind::list || key == Kind::dict)) fail("a dict key that is ", to_string(key));
    }
    c.items.insert(c.items.end(), items.begin(), items.end());
  }

  void step() {
    switch (op_) {
      case 0x80: {  // PROTO
        const auto v = little_endian(1);
        if (v < 2 || v > 5) fail("protocol ", v, "; fsdpx reads pickles of protocol 2 to 5");
        return;
      }
      case 0x95: {  // FRAME: a hint for buffered reading; its length must lie within the pickle
        const uint64_t n = little_endian(8);
        if (n > static_cast<uint64_t>(size_ - pos_)) fail("a frame of ", n, " bytes runs past the end of the pickle");
        return;
      }
      case 0x94: return memo_put(memo_.size(), top());
      case 'q': return memo_put(little_endian(1), top());
      case 'r': return memo_put(little_endian(4), top());
      case 'h': return memo_get(little_endian(1));
      case 'j': return memo_get(little_endian(4));
      case 0x8c: return text(Kind::string, little_endian(1));
      case 'X': return text(Kind::string, little_endian(4));
      case 0x8d: return text(Kind::string, little_endian(8));
      case 'C': return text(Kind::bytes, little_endian(1));
      case 'B': return text(Kind::bytes, little_endian(4));
      case 0x8e: return text(Kind::bytes, little_endian(8));
      case 'J': return integer(static_cast<int32_t>(little_endian(4)));
      case 'K': return integer(static_cast<int64_t>(little_endian(1)));
      case 'M': return integer(static_cast<int64_t>(little_endian(2)));
      case 0x8a: {  // LONG1: n bytes of two's complement, little-endian
        const auto n = static_cast<int>(little_endian(1));
        if (n > 8) fail("an integer of ", n, " bytes; fsdpx reads integers of up to 8 bytes");
        uint64_t v = n == 0 ? 0 : little_endian(n);
        if (n > 0 && n < 8 && (v >> (8 * n - 1)) != 0) v |= ~uint64_t{0} << (8 * n);  // negative: sign-extend
        return integer(static_cast<int64_t>(v));
      }
      case 'G': {  // BINFLOAT: big-endian
        const uint8_t* b = take(8);
        uint64_t bits = 0;
        for (int i = 0; i < 8; ++i) bits = (bits << 8) | b[i];
        double v = 0;
        std::memcpy(&v, &bits, sizeof v);
        make(Kind::floating).floating = v;
        return push(last());
      }
      case 'N': return push_new(Kind::none);
      case 0x88:
      case 0x89: make(Kind::boolean).integer = op_ == 0x88; return push(last());
      case ')': return tuple({});
      case 0x85:
      case 0x86:
      case 0x87: {
        std::vector<Id> items(op_ - 0x84);
        for (size_t i = items.size(); i-- > 0;) items[i] = pop();
        return tuple(std::move(items));
      }
      case 't': return tuple(pop_mark());
      case ']': return push_new(Kind::list);
      case '}': return push_new(Kind::dict);
      case 'a': {
        const Id v = pop();
        return add(Kind::list, {v});
      }
      case 'e': return add(Kind::list, pop_mark());
      case 's': {
        const Id v = pop(), k = pop();
        return add(Kind::dict, {k, v});
      }
      case 'u': return add(Kind::dict, pop_mark());
      case '(':
        if (static_cast<int>(marks_.size()) >= limits_.max_marks) fail("opens more than ", limits_.max_marks, " MARKs");
        marks_.push_back(stack_.size());
        return;
      case 'c': {
        const std::string_view module = line();
        return global(module, line());
      }
      case 0x93: {
        const Id name = pop(), module = pop();
        if (at(module).kind != Kind::string || at(name).kind != Kind::string) {
          fail("names a global by ", to_string(at(module).kind), " and ", to_string(at(name).kind), ", not strings");
        }
        return global(at(module).text, at(name).text);
      }
      case 'Q': {  // BINPERSID: a reference for the caller to resolve (a torch.save archive's storage)
        if (!limits_.persistent_ids) fail("is not an opcode of the pickles fsdpx reads");
        const Id id = pop();
        spend(1);
        make(Kind::persistent).items = {id};
        return push(last());
      }
      case 0x81: return object(false);
      case 'R': return object(true);
      case 'b': {  // BUILD: the state is recorded, not applied
        const Id state = pop();
        Node& obj = at(top());
        if (obj.kind == Kind::dict && obj.reduced) return;  // an OrderedDict's attributes, dropped
        if (obj.kind != Kind::object) fail("builds ", to_string(obj.kind), ", not an object");
        if (obj.items.size() > 2) fail("builds the same object twice");
        spend(1);
        obj.items.push_back(state);
        return;
      }
      default: fail("is not an opcode of the pickles fsdpx reads");
    }
  }

  Pickle stop() {
    if (!marks_.empty()) fail("ends with a MARK open");
    if (stack_.size() != 1) fail("ends with ", stack_.size(), " values on the stack; a pickle returns one");
    if (pos_ != size_) fail("is followed by ", size_ - pos_, " more bytes; the file must hold one pickle");
    return {std::move(nodes_), stack_.back()};
  }

  const uint8_t* p_;
  int64_t size_;
  int64_t pos_ = 0;
  int64_t at_ = 0;  // the current opcode's byte
  uint8_t op_ = 0;
  std::string_view what_;
  AllowGlobal allow_;
  const Limits& limits_;
  int64_t max_values_;
  int64_t used_ = 0;
  std::vector<Node> nodes_;
  std::vector<Id> stack_;
  std::vector<size_t> marks_;
  std::vector<Id> memo_;
};

FSDPX_DECL Pickle parse(std::span<const std::byte> data, std::string_view what, AllowGlobal allow,
                        const Limits& limits) {
  return Machine(data, what, allow, limits).run();
}

// ---- Writer -------------------------------------------------------------------------------------------

FSDPX_DECL void Writer::raw(const void* data, size_t n) {
  const auto* b = static_cast<const std::byte*>(data);
  out_.insert(out_.end(), b, b + n);
}

FSDPX_DECL void Writer::integer(int64_t v) {
  // Python's choice: the shortest of BININT1, BININT2, BININT, then LONG1 with the fewest bytes.
  uint8_t b[8];
  for (int i = 0; i < 8; ++i) b[i] = static_cast<uint8_t>(static_cast<uint64_t>(v) >> (8 * i));
  if (v >= 0 && v < 256) {
    op('K');
    raw(b, 1);
  } else if (v >= 0 && v < 65536) {
    op('M');
    raw(b, 2);
  } else if (v >= std::numeric_limits<int32_t>::min() && v <= std::numeric_limits<int32_t>::max()) {
    op('J');
    raw(b, 4);
  } else {
    int n = 8;
    while (n > 1 && ((b[n - 1] == 0x00 && (b[n - 2] & 0x80) == 0) || (b[n - 1] == 0xFF && (b[n - 2] & 0x80) != 0))) --n;
    op(0x8a);
    op(n);
    raw(b, static_cast<size_t>(n));
  }
}

FSDPX_DECL void Writer::floating(double v) {
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof bits);
  op('G');
  for (int i = 7; i >= 0; --i) op(static_cast<int>((bits >> (8 * i)) & 0xFF));
}

FSDPX_DECL void Writer::memo_op(int one_byte, int four_bytes, uint32_t index) {
  // BINGET / BINPUT for the first 256 entries, LONG_BINGET / LONG_BINPUT after
  if (index < 256) {
    op(one_byte);
    op(static_cast<int>(index));
  } else {
    op(four_bytes);
    for (int i = 0; i < 4; ++i) op(static_cast<int>((index >> (8 * i)) & 0xFF));
  }
}

FSDPX_DECL void Writer::string(std::string_view s) {
  FSDPX_CHECK(valid_utf8(s), "pickle: the string '", s, "' is not UTF-8, which Python could not read back");
  FSDPX_CHECK(s.size() <= 0xFFFFFFFFu, "pickle: a string of ", s.size(), " bytes; protocol 2 holds up to 4 GiB");
  std::string key = "s";
  key += s;
  if (const auto it = memo_.find(key); it != memo_.end()) return memo_get(it->second);
  uint8_t len[4];
  for (int i = 0; i < 4; ++i) len[i] = static_cast<uint8_t>(s.size() >> (8 * i));
  op('X');
  raw(len, 4);
  raw(s.data(), s.size());
  memo_.emplace(std::move(key), memo_put());
}

FSDPX_DECL void Writer::global(std::string_view module, std::string_view name) {
  FSDPX_CHECK(module.find('\n') == std::string_view::npos && name.find('\n') == std::string_view::npos,
              "pickle: a global's name holds a line break");
  std::string key = "g";
  key.append(module).append("\n").append(name);
  if (const auto it = memo_.find(key); it != memo_.end()) return memo_get(it->second);
  op('c');
  raw(key.data() + 1, key.size() - 1);
  op('\n');
  memo_.emplace(std::move(key), memo_put());
}

}  // namespace fsdpx::pickle

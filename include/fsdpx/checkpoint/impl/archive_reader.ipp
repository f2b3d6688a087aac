// Out-of-line functions of fsdpx/checkpoint/detail/archive_reader.hpp: included by it (header-only) or by
// fsdpx/impl/src.hpp (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <ATen/ATen.h>

#include <fsdpx/checkpoint/detail/archive_reader.hpp>
#include <fsdpx/error.hpp>
#include <fsdpx/policies/dtype_names.hpp>

namespace fsdpx::checkpoint::detail {

/// The dtype of torch's storage class `name` ("BFloat16Storage": torch names them by c10::toString of the
/// dtype, in LibTorch's pickler and Python's torch.save alike; UntypedStorage holds bytes, which Python's
/// _rebuild_tensor_v3 views in the dtype it names); nullopt for any other name.
inline std::optional<c10::ScalarType> storage_class_dtype(std::string_view name) {
  if (name == "UntypedStorage") return c10::kByte;
  constexpr std::string_view suffix = "Storage";
  if (!name.ends_with(suffix)) return std::nullopt;
  name.remove_suffix(suffix.size());
  for (int i = 0; i < static_cast<int>(c10::ScalarType::NumOptions); ++i) {
    const auto t = static_cast<c10::ScalarType>(i);
    if (t == c10::ScalarType::Undefined || c10::isQIntType(t) || c10::isBitsType(t)) continue;
    if (name == c10::toString(t)) return t;
  }
  return std::nullopt;
}

inline bool is_typed_list_builder(std::string_view name) {
  return name == "build_intlist" || name == "build_doublelist" || name == "build_boollist" ||
         name == "build_tensorlist";
}

FSDPX_DECL bool archive_global(std::string_view module, std::string_view name) {
  if (module == "torch._utils") {
    return name == "_rebuild_tensor_v2" || name == "_rebuild_tensor_v3" || name == "_rebuild_parameter";
  }
  if (module == "torch") return storage_class_dtype(name).has_value() || torch_dtype_from_name(name).has_value();
  if (module == "torch.storage") return name == "UntypedStorage";
  if (module == "collections") return name == "OrderedDict";
  if (module == "torch.jit._pickle") return is_typed_list_builder(name);
  return false;
}

FSDPX_DECL ::fsdpx::pickle::Limits archive_limits(int64_t max_bytes) {
  ::fsdpx::pickle::Limits limits;
  limits.max_bytes = std::min(limits.max_bytes, max_bytes);
  // LibTorch's pickler writes a dict's or a list's items between one MARK (Python's batches them by 1000), so a
  // state dict of a million tensors holds two million values on the stack: bounded by the values, not less.
  limits.max_stack = limits.max_values;
  limits.persistent_ids = true;
  return limits;
}

/// The values of one pickle, each node made once, children before parents, with an explicit stack.
class ValueMaker {
  using Id = ::fsdpx::pickle::Id;
  using Kind = ::fsdpx::pickle::Kind;
  using Node = ::fsdpx::pickle::Node;

 public:
  ValueMaker(const ::fsdpx::pickle::Pickle& p, const std::string& what, const StorageRecords* storages)
      : p_(p),
        what_(what),
        records_(storages),
        state_(p.nodes.size(), fresh),
        values_(p.nodes.size()),
        weight_(p.nodes.size(), 0) {}

  c10::IValue make() {
    std::vector<Frame> stack;
    open(p_.root, 0, stack);
    while (!stack.empty()) {
      Frame& f = stack.back();
      if (f.next < f.children.size()) {
        const Id c = f.children[f.next++];
        if (state_[c] == made) continue;
        if (state_[c] == opened) fail(p_[c], "holds itself: a value made inside its own value");
        if (f.depth + 1 > max_value_depth) fail(p_[c], "nests deeper than ", max_value_depth, " levels");
        open(c, f.depth + 1, stack);  // invalidates f
        continue;
      }
      const Id id = f.id;
      stack.pop_back();
      values_[id] = build(id, p_[id]);
      state_[id] = made;
    }
    expect_value(p_.root, "the file's value");
    return values_[p_.root];
  }

 private:
  enum : uint8_t { fresh, opened, made };
  struct Frame {
    Id id;
    int depth;
    std::vector<Id> children;
    size_t next = 0;
  };
  struct Storage {
    c10::Storage storage;
    c10::ScalarType dtype;
  };
  /// Elements and string bytes a node's value holds, counted as often as they are referenced: what walking
  /// it as a tree would visit. Values shared through the memo stay shared, but a walk of them stays bounded.
  static constexpr uint64_t max_weight = uint64_t{1} << 30;

  template <class... Args>
  [[noreturn]] void fail(const Node& at, const Args&... args) const {
    throw IoError(::fsdpx::detail::str("fsdpx: ", what_, " is corrupt or not a checkpoint's: ", args...,
                                       " (the value made at byte ", at.offset, " of its pickle)"));
  }

  /// A node's children as the walk makes them: an object's class and the elements of its argument tuple
  /// (not the tuple, which may hold a storage, no value of its own), a persistent id's elements likewise.
  void open(Id id, int depth, std::vector<Frame>& stack) {
    const Node& n = p_[id];
    Frame f{id, depth, {}};
    if (n.kind == Kind::object || n.kind == Kind::persistent) {
      const Id args = n.items[n.kind == Kind::object ? 1 : 0];
      if (p_[args].kind != Kind::tuple) fail(n, "a persistent id that is ", to_string(p_[args].kind), ", not a tuple");
      if (n.kind == Kind::object) f.children.push_back(n.items[0]);
      f.children.insert(f.children.end(), p_[args].items.begin(), p_[args].items.end());
      if (n.kind == Kind::object && n.items.size() > 2) f.children.push_back(n.items[2]);
    } else {
      f.children = n.items;
    }
    state_[id] = opened;
    stack.push_back(std::move(f));
  }

  /// The child `id` as a value (a class or a storage is not one).
  const c10::IValue& value(Id id, std::string_view where) {
    expect_value(id, where);
    return values_[id];
  }
  void expect_value(Id id, std::string_view where) const {
    const Kind k = p_[id].kind;
    if (k == Kind::global || k == Kind::persistent) fail(p_[id], where, " is ", to_string(k), ", not a value");
  }
  void weigh(Id id, uint64_t w) {
    if (w > max_weight) {
      fail(p_[id], "its values, counted as often as they are referenced, exceed ", max_weight,
           " elements and string bytes (a memo that shares values this much is refused)");
    }
    weight_[id] = w;
  }
  uint64_t weight_of(const std::vector<Id>& ids) const {
    uint64_t w = 1;
    for (const Id c : ids) w = std::min(w + weight_[c], max_weight + 1);
    return w;
  }

  int64_t integer(Id id, std::string_view where) const {
    if (p_[id].kind != Kind::integer) fail(p_[id], where, " is ", to_string(p_[id].kind), ", not an integer");
    return p_[id].integer;
  }
  std::vector<int64_t> integers(Id id, std::string_view where) const {
    if (p_[id].kind != Kind::tuple) fail(p_[id], where, " is ", to_string(p_[id].kind), ", not a tuple");
    std::vector<int64_t> out;
    out.reserve(p_[id].items.size());
    for (const Id c : p_[id].items) {
      out.push_back(integer(c, where));
      if (out.back() < 0) fail(p_[c], where, " holds ", out.back(), ", which is negative");
    }
    return out;
  }
  bool boolean(Id id, std::string_view where) const {
    if (p_[id].kind != Kind::boolean) fail(p_[id], where, " is ", to_string(p_[id].kind), ", not a bool");
    return p_[id].integer != 0;
  }
  void empty_dict(Id id, std::string_view where) const {
    if (p_[id].kind != Kind::dict || !p_[id].items.empty()) {
      fail(p_[id], where, " is ", to_string(p_[id].kind), ", not an empty dict (fsdpx loads no hooks or metadata)");
    }
  }

  c10::IValue build(Id id, const Node& n) {
    switch (n.kind) {
      case Kind::none: weigh(id, 1); return {};
      case Kind::boolean: weigh(id, 1); return n.integer != 0;
      case Kind::integer: weigh(id, 1); return n.integer;
      case Kind::floating: weigh(id, 1); return n.floating;
      case Kind::string: weigh(id, 1 + n.text.size()); return std::string(n.text);
      case Kind::bytes: fail(n, "it holds bytes, which a checkpoint's values never are");
      case Kind::global:
        if (records_ == nullptr) fail(n, "it names the class ", n.text, ".", n.name, "; a plain value names none");
        weigh(id, 1);
        return {};
      case Kind::tuple: {
        weigh(id, weight_of(n.items));
        std::vector<c10::IValue> items;
        items.reserve(n.items.size());
        for (const Id c : n.items) items.push_back(value(c, "a tuple's element"));
        return c10::ivalue::Tuple::create(std::move(items));
      }
      case Kind::list: {
        weigh(id, weight_of(n.items));
        c10::impl::GenericList list(c10::AnyType::get());
        list.reserve(n.items.size());
        for (const Id c : n.items) list.push_back(value(c, "a list's element"));
        return list;
      }
      case Kind::dict: {
        weigh(id, weight_of(n.items));
        c10::impl::GenericDict dict(c10::AnyType::get(), c10::AnyType::get());
        for (size_t i = 0; i + 1 < n.items.size(); i += 2) {
          const c10::IValue& key = value(n.items[i], "a dict's key");
          if (!key.isString() && !key.isInt() && !key.isDouble() && !key.isBool()) {
            fail(p_[n.items[i]], "a dict key that is ", to_string(p_[n.items[i]].kind),
                 "; a checkpoint's dicts have str, int, float or bool keys");
          }
          dict.insert_or_assign(key, value(n.items[i + 1], "a dict's value"));
        }
        return dict;
      }
      case Kind::persistent: return storage(id, n);
      case Kind::object: return object(id, n);
    }
    fail(n, "a value of an unknown kind");
  }

  /// ('storage', torch.<Type>Storage, key, location, numel): the record `key`, read once, onto the CPU.
  c10::IValue storage(Id id, const Node& n) {
    if (records_ == nullptr) fail(n, "it names a storage; a plain value names none");
    const std::vector<Id>& pid = p_[n.items[0]].items;
    if (pid.size() != 5 || p_[pid[0]].kind != Kind::string || p_[pid[0]].text != "storage" ||
        p_[pid[1]].kind != Kind::global || p_[pid[2]].kind != Kind::string || p_[pid[3]].kind != Kind::string) {
      fail(n, "a persistent id that is not ('storage', a storage class, key, location, numel)");
    }
    const auto dtype = storage_class_dtype(p_[pid[1]].name);
    if (!dtype) fail(p_[pid[1]], "the storage class ", p_[pid[1]].name, " names no dtype");
    const int64_t numel = integer(pid[4], "a storage's element count");
    const std::string key(p_[pid[2]].text);
    auto it = by_key_.find(key);
    if (it == by_key_.end()) it = by_key_.emplace(key, (*records_)(key)).first;
    const auto nbytes = static_cast<uint64_t>(it->second.nbytes());
    uint64_t claimed = 0;
    if (numel < 0 || __builtin_mul_overflow(static_cast<uint64_t>(numel), c10::elementSize(*dtype), &claimed) ||
        claimed > nbytes) {
      fail(n, "storage '", key, "' claims ", numel, " elements of ", c10::toString(*dtype), ", more than its record's ",
           nbytes, " bytes hold");
    }
    storages_.emplace(id, Storage{it->second, *dtype});
    weigh(id, 1);
    return {};
  }

  c10::IValue object(Id id, const Node& n) {
    const Node& cls = p_[n.items[0]];
    const std::vector<Id>& args = p_[n.items[1]].items;
    const bool has_state = n.items.size() > 2;
    if (records_ == nullptr || !n.reduced || has_state) {
      fail(n, "it makes an object of ", cls.text, ".", cls.name, has_state ? " with a state" : "",
           "; fsdpx reads tensors and plain values only");
    }
    weigh(id, 1);
    if (cls.text == "torch._utils" && cls.name == "_rebuild_tensor_v2") return tensor(n, args, false);
    if (cls.text == "torch._utils" && cls.name == "_rebuild_tensor_v3") return tensor(n, args, true);
    if (cls.text == "torch._utils" && cls.name == "_rebuild_parameter") {
      // (data, requires_grad, backward_hooks): an nn.Parameter saved by Python, loaded as its tensor.
      if (args.size() != 3) fail(n, "_rebuild_parameter takes 3 arguments, not ", args.size());
      const c10::IValue& data = value(args[0], "a parameter's data");
      if (!data.isTensor()) fail(p_[args[0]], "a parameter's data is not a tensor");
      const bool requires_grad = boolean(args[1], "a parameter's requires_grad");
      empty_dict(args[2], "a parameter's backward hooks");
      at::Tensor t = data.toTensor();
      t.set_requires_grad(requires_grad);
      return t;
    }
    if (cls.text == "torch.jit._pickle" && is_typed_list_builder(cls.name)) return typed_list(id, n, cls.name, args);
    fail(n, "it calls ", cls.text, ".", cls.name, ", which a checkpoint's pickle does not");
  }

  /// torch._utils._rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad, backward_hooks
  /// [, metadata]), or _v3 with the dtype after the hooks (Python's, for the dtypes without a storage class:
  /// float8, uint16 to uint64), checked to lie within its storage before it is made.
  c10::IValue tensor(const Node& n, const std::vector<Id>& args, bool v3) {
    const size_t fixed = v3 ? 7 : 6;
    if (args.size() != fixed && args.size() != fixed + 1) {
      fail(n, v3 ? "_rebuild_tensor_v3" : "_rebuild_tensor_v2", " takes ", fixed, " or ", fixed + 1, " arguments, not ",
           args.size());
    }
    if (p_[args[0]].kind != Kind::persistent) fail(p_[args[0]], "a tensor's storage is not a storage record");
    const c10::Storage& storage = storages_.at(args[0]).storage;
    c10::ScalarType dtype = storages_.at(args[0]).dtype;
    if (v3) {
      const Node& g = p_[args[6]];
      const auto named = g.kind == Kind::global && g.text == "torch" ? torch_dtype_from_name(g.name) : std::nullopt;
      if (!named) fail(g, "a tensor's dtype is not a torch dtype fsdpx maps");
      dtype = *named;
    }
    const int64_t offset = integer(args[1], "a tensor's storage offset");
    const std::vector<int64_t> sizes = integers(args[2], "a tensor's sizes");
    const std::vector<int64_t> strides = integers(args[3], "a tensor's strides");
    const bool requires_grad = boolean(args[4], "a tensor's requires_grad");
    empty_dict(args[5], "a tensor's backward hooks");
    if (args.size() == fixed + 1 && p_[args[fixed]].kind != Kind::none) empty_dict(args[fixed], "a tensor's metadata");
    if (sizes.size() != strides.size()) {
      fail(n, "a tensor of ", sizes.size(), " sizes and ", strides.size(), " strides");
    }
    // The last element's index plus one (or the offset, for an empty tensor), in elements, within storage.
    const auto itemsize = static_cast<int64_t>(c10::elementSize(dtype));
    bool empty = false;
    for (const int64_t size : sizes) empty = empty || size == 0;
    int64_t end = offset, step = 0, reach = 0;
    bool ok = offset >= 0;
    for (size_t d = 0; d < sizes.size() && ok && !empty; ++d) {
      ok = !__builtin_mul_overflow(sizes[d] - 1, strides[d], &step) && !__builtin_add_overflow(end, step, &end);
    }
    ok = ok && !__builtin_add_overflow(end, empty ? 0 : 1, &end) && !__builtin_mul_overflow(end, itemsize, &reach) &&
         static_cast<uint64_t>(reach) <= storage.nbytes();
    if (!ok) {
      fail(n, "a tensor of sizes ", c10::IntArrayRef(sizes), " and strides ", c10::IntArrayRef(strides),
           " at storage offset ", offset, " reaches past its storage of ", storage.nbytes(), " bytes");
    }
    at::Tensor t = at::empty({0}, at::TensorOptions().dtype(dtype));
    t.set_(storage, offset, sizes, strides);
    if (requires_grad) t.set_requires_grad(true);
    return t;
  }

  /// torch.jit._pickle.build_intlist([...]) and the like: LibTorch's typed lists.
  c10::IValue typed_list(Id id, const Node& n, std::string_view builder, const std::vector<Id>& args) {
    if (args.size() != 1 || p_[args[0]].kind != Kind::list) fail(n, builder, " of something other than one list");
    const std::vector<Id>& items = p_[args[0]].items;
    weigh(id, weight_[args[0]]);
    const auto each = [&](auto list, bool (c10::IValue::*is)() const, auto convert) -> c10::IValue {
      list.reserve(items.size());
      for (const Id c : items) {
        const c10::IValue& v = value(c, "a typed list's element");
        if (!(v.*is)()) fail(p_[c], builder, " holds ", to_string(p_[c].kind));
        list.push_back(convert(v));
      }
      return list;
    };
    if (builder == "build_intlist")
      return each(c10::List<int64_t>(), &c10::IValue::isInt, [](const c10::IValue& v) { return v.toInt(); });
    if (builder == "build_doublelist")
      return each(c10::List<double>(), &c10::IValue::isDouble, [](const c10::IValue& v) { return v.toDouble(); });
    if (builder == "build_boollist")
      return each(c10::List<bool>(), &c10::IValue::isBool, [](const c10::IValue& v) { return v.toBool(); });
    return each(c10::List<at::Tensor>(), &c10::IValue::isTensor, [](const c10::IValue& v) { return v.toTensor(); });
  }

  const ::fsdpx::pickle::Pickle& p_;
  const std::string& what_;
  const StorageRecords* records_;
  std::vector<uint8_t> state_;
  std::vector<c10::IValue> values_;
  std::vector<uint64_t> weight_;
  std::map<std::string, c10::Storage, std::less<>> by_key_;
  std::unordered_map<Id, Storage> storages_;
};

FSDPX_DECL c10::IValue pickle_value(const ::fsdpx::pickle::Pickle& p, const std::string& what,
                                    const StorageRecords* storages) {
  return ValueMaker(p, what, storages).make();
}

}  // namespace fsdpx::checkpoint::detail

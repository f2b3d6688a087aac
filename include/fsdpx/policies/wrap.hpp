// Wrap policies: which submodules become sharding units. The model is walked from the root; a module
// the policy picks becomes a unit and is not descended into. Parameters outside every unit belong to
// the root unit.
#pragma once

#include <concepts>
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <torch/nn/module.h>

namespace fsdpx {

/// What a wrap policy may look at for one module.
struct UnitQuery {
  const torch::nn::Module& module;
  int64_t numel;                // parameters of the module and its descendants
  int64_t largest_child_numel;  // the same for its largest child
  std::string_view name;        // its fully qualified name in the model ("layers.3", "lm_head")
};

/// Every module whose implementation is one of `Impls` (e.g. WrapModules<BlockImpl>).
template <class... Impls>
struct WrapModules {
  static_assert(sizeof...(Impls) > 0, "WrapModules<...> needs at least one module implementation type");
  static_assert((std::derived_from<Impls, torch::nn::Module> && ...),
                "WrapModules<Impls...>: each Impl must derive from torch::nn::Module (name BlockImpl, not Block)");
  static bool is_unit(const UnitQuery& q) { return ((dynamic_cast<const Impls*>(&q.module) != nullptr) || ...); }
};

/// Every module for which `Predicate{}(query)` is true.
template <class Predicate>
struct WrapIf {
  static_assert(std::default_initializable<Predicate> && std::predicate<const Predicate&, const UnitQuery&>,
                "WrapIf<Predicate>: Predicate must be default-constructible and callable as bool(const UnitQuery&)");
  static bool is_unit(const UnitQuery& q) { return Predicate{}(q); }
};

/// The smallest modules that hold at least MinParams parameters.
template <int64_t MinParams>
struct WrapBySize {
  static_assert(MinParams > 0, "WrapBySize<N>: N must be positive");
  static bool is_unit(const UnitQuery& q) { return q.numel >= MinParams && q.largest_child_numel < MinParams; }
};

/// A pattern of module names, usable as a template argument: WrapNames<"layers.*", "lm_head">.
template <size_t N>
struct NamePattern {
  char text[N]{};
  constexpr NamePattern(const char (&s)[N]) { std::copy_n(s, N, text); }  // NOLINT: implicit by design
  constexpr std::string_view view() const { return {text, N - 1}; }
};

namespace detail {
/// Glob match of a dotted module name: '*' matches any characters within one name segment (no '.').
constexpr bool name_matches(std::string_view pattern, std::string_view name) {
  if (pattern.empty()) return name.empty();
  if (pattern.front() == '*') {
    for (size_t n = 0;; ++n) {
      if (name_matches(pattern.substr(1), name.substr(n))) return true;
      if (n == name.size() || name[n] == '.') return false;
    }
  }
  return !name.empty() && pattern.front() == name.front() && name_matches(pattern.substr(1), name.substr(1));
}
}  // namespace detail

/// Every module whose fully qualified name matches one of `Patterns` ('*' stands for any characters
/// within one segment: "layers.*" is every layer, "layers.*.mlp" each layer's MLP). A pattern that
/// matches no module is an error at construction, naming it (a typo would otherwise leave the model
/// one unit).
template <NamePattern... Patterns>
struct WrapNames {
  static_assert(sizeof...(Patterns) > 0, "WrapNames<...> needs at least one name pattern");
  static_assert(((Patterns.view().size() > 0) && ...), "WrapNames<...>: a name pattern is empty");
  static bool is_unit(const UnitQuery& q) { return (detail::name_matches(Patterns.view(), q.name) || ...); }
  /// The patterns that none of `units` matches.
  static std::vector<std::string> unmatched(const std::vector<std::string>& units) {
    std::vector<std::string> out;
    const auto check = [&](std::string_view pattern) {
      const bool any = std::any_of(units.begin(), units.end(),
                                   [&](const std::string& u) { return detail::name_matches(pattern, u); });
      if (!any) out.emplace_back(pattern);
    };
    (check(Patterns.view()), ...);
    return out;
  }
};

/// One unit: the whole model.
struct NoWrap {
  static bool is_unit(const UnitQuery&) { return false; }
};

template <class P>
concept WrapPolicy = requires(const UnitQuery& q) {
  { P::is_unit(q) } -> std::convertible_to<bool>;
};

}  // namespace fsdpx

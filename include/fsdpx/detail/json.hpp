// JSON through nlohmann/json (commit records, safetensors headers and indexes, Hugging Face configs),
// with what fsdpx adds on top: parsing that names the document and bounds the nesting, and typed
// field access whose errors name the document, the key and the value found. Integers stay exact
// (int64 / uint64) and are range-checked into the type asked for, never wrapped.
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>

#include <nlohmann/json.hpp>

#include <fsdpx/detail/json_fwd.hpp>
#include <fsdpx/error.hpp>

namespace fsdpx::detail {

/// Deeper nesting is refused: no file fsdpx reads needs more than a few levels, and a crafted one
/// must not cost unbounded memory.
inline constexpr int json_max_depth = 64;

/// Parses `text`; an IoError names `what` (the document) and says where the text is wrong.
inline Json parse_json(std::string_view text, std::string_view what, int max_depth = json_max_depth) {
  const auto depth_limit = [&](int depth, Json::parse_event_t event, Json&) {
    if ((event == Json::parse_event_t::object_start || event == Json::parse_event_t::array_start) &&
        depth >= max_depth) {
      throw IoError(str("fsdpx: '", what, "' nests JSON objects and arrays deeper than ", max_depth, " levels"));
    }
    return true;
  };
  try {
    return Json::parse(text.begin(), text.end(), depth_limit);
  } catch (const Json::parse_error& e) {
    throw IoError(str("fsdpx: '", what, "' is not valid JSON at byte ", e.byte, ": ", e.what()));
  } catch (const Json::exception& e) {  // not a syntax error: a number beyond a double's range (1e400)
    throw IoError(str("fsdpx: '", what, "' is not valid JSON: ", e.what()));
  }
}

/// A JSON value's type in words, for errors.
inline std::string json_kind(const Json& v) {
  if (v.is_number_integer()) return "the integer " + v.dump();
  if (v.is_number_float()) return "the number " + v.dump();
  if (v.is_string()) return "a string";
  if (v.is_boolean()) return v.get<bool>() ? "true" : "false";
  if (v.is_null()) return "null";
  return v.is_array() ? "an array" : "an object";
}

/// `v` as T (an integer type, double, bool or std::string). `what` names the value in errors
/// ("'config.json': \"vocab_size\""); integers must be JSON integers within T's range.
template <class T>
T json_as(const Json& v, std::string_view what) {
  const auto fail = [&](std::string_view expected) -> T {
    throw IoError(str("fsdpx: ", what, " must be ", expected, ", not ", json_kind(v)));
  };
  if constexpr (std::is_same_v<T, bool>) {
    return v.is_boolean() ? v.get<bool>() : fail("true or false");
  } else if constexpr (std::is_integral_v<T>) {
    const auto range = [] {
      return str("an integer in [", +std::numeric_limits<T>::min(), ", ", +std::numeric_limits<T>::max(), "]");
    };
    if (v.is_number_unsigned()) {
      const uint64_t u = v.get<uint64_t>();
      if (u > static_cast<uint64_t>(std::numeric_limits<T>::max())) return fail(range());
      return static_cast<T>(u);
    }
    if (v.is_number_integer()) {
      const int64_t i = v.get<int64_t>();
      if constexpr (std::is_unsigned_v<T>) {
        if (i < 0) return fail(range());
        if (static_cast<uint64_t>(i) > static_cast<uint64_t>(std::numeric_limits<T>::max())) return fail(range());
      } else {
        if (i < static_cast<int64_t>(std::numeric_limits<T>::min()) ||
            i > static_cast<int64_t>(std::numeric_limits<T>::max())) {
          return fail(range());
        }
      }
      return static_cast<T>(i);
    }
    return fail(range());
  } else if constexpr (std::is_floating_point_v<T>) {
    return v.is_number() ? v.get<T>() : fail("a number");
  } else {
    static_assert(std::is_same_v<T, std::string>,
                  "json_as<T>: T must be an integer type, a floating type, bool or std::string");
    return v.is_string() ? v.get<std::string>() : fail("a string");
  }
}

/// The member `key` of the object `obj`; an IoError names `doc` when `obj` is no object or lacks it.
inline const Json& json_at(const Json& obj, std::string_view key, std::string_view doc) {
  if (!obj.is_object())
    throw IoError(str("fsdpx: '", doc, "': expected a JSON object holding \"", key, "\", found ", json_kind(obj)));
  const auto it = obj.find(key);
  if (it == obj.end()) throw IoError(str("fsdpx: '", doc, "' has no \"", key, "\""));
  return *it;
}

/// obj[key] as T: the member must exist and have T's type.
template <class T>
T json_get(const Json& obj, std::string_view key, std::string_view doc) {
  return json_as<T>(json_at(obj, key, doc), str("'", doc, "': \"", key, "\""));
}

/// obj[key] as T, or nullopt when obj has no such member or it is null.
template <class T>
std::optional<T> json_find(const Json& obj, std::string_view key, std::string_view doc) {
  if (!obj.is_object()) return std::nullopt;
  const auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return std::nullopt;
  return json_as<T>(*it, str("'", doc, "': \"", key, "\""));
}

}  // namespace fsdpx::detail

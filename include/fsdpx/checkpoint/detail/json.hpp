// The little JSON fsdpx reads and writes (fsdp_config.json, safetensors headers): objects, arrays,
// strings, numbers, booleans and null. Errors name the document and the byte offset.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include <fsdpx/error.hpp>

namespace fsdpx::checkpoint::detail {

class Json {
 public:
  using Object = std::map<std::string, Json>;
  using Array = std::vector<Json>;

  Json() = default;
  Json(std::nullptr_t) {}
  Json(bool b) : v_(b) {}
  Json(int v) : v_(static_cast<double>(v)) {}
  Json(int64_t v) : v_(static_cast<double>(v)) {}
  Json(uint64_t v) : v_(static_cast<double>(v)) {}
  Json(double v) : v_(v) {}
  Json(const char* s) : v_(std::string(s)) {}
  Json(std::string s) : v_(std::move(s)) {}
  Json(Array a) : v_(std::make_shared<Array>(std::move(a))) {}
  Json(Object o) : v_(std::make_shared<Object>(std::move(o))) {}

  bool is_object() const { return std::holds_alternative<std::shared_ptr<Object>>(v_); }
  bool is_array() const { return std::holds_alternative<std::shared_ptr<Array>>(v_); }
  bool is_string() const { return std::holds_alternative<std::string>(v_); }
  bool is_number() const { return std::holds_alternative<double>(v_); }
  bool is_bool() const { return std::holds_alternative<bool>(v_); }

  const Object& object() const { return *expect<std::shared_ptr<Object>>("an object"); }
  const Array& array() const { return *expect<std::shared_ptr<Array>>("an array"); }
  const std::string& string() const { return expect<std::string>("a string"); }
  double number() const { return expect<double>("a number"); }
  int64_t integer() const { return static_cast<int64_t>(number()); }
  bool boolean() const { return expect<bool>("a boolean"); }

  bool contains(const std::string& key) const { return is_object() && object().count(key) != 0; }
  const Json& operator[](const std::string& key) const {
    const auto& o = object();
    const auto it = o.find(key);
    FSDPX_CHECK_AS(IoError, it != o.end(), "JSON: missing key '", key, "'");
    return it->second;
  }

  std::string dump(int indent = 2) const {
    std::ostringstream os;
    write(os, indent, 0);
    return os.str();
  }

  /// Parses `text`; `what` names the document in errors.
  static Json parse(std::string_view text, const std::string& what) {
    Parser p{text, 0, what};
    Json v = p.value();
    p.skip_ws();
    p.expect(p.pos == text.size(), "unexpected trailing characters");
    return v;
  }

 private:
  template <class T>
  const T& expect(const char* kind) const {
    FSDPX_CHECK_AS(IoError, std::holds_alternative<T>(v_), "JSON: expected ", kind);
    return std::get<T>(v_);
  }

  static void write_string(std::ostream& os, const std::string& s) {
    os << '"';
    for (const char c : s) {
      switch (c) {
        case '"': os << "\\\""; break;
        case '\\': os << "\\\\"; break;
        case '\n': os << "\\n"; break;
        case '\t': os << "\\t"; break;
        default:
          if (static_cast<unsigned char>(c) < 0x20) {
            char buf[8];
            std::snprintf(buf, sizeof buf, "\\u%04x", c);
            os << buf;
          } else {
            os << c;
          }
      }
    }
    os << '"';
  }

  void write(std::ostream& os, int indent, int depth) const {
    const std::string pad(static_cast<size_t>(indent * (depth + 1)), ' '), end_pad(static_cast<size_t>(indent * depth), ' ');
    const char* nl = indent > 0 ? "\n" : "";
    if (std::holds_alternative<std::monostate>(v_)) {
      os << "null";
    } else if (is_bool()) {
      os << (boolean() ? "true" : "false");
    } else if (is_number()) {
      const double d = number();
      if (d == static_cast<double>(static_cast<int64_t>(d)) && std::abs(d) < 9.007199254740992e15) {
        os << static_cast<int64_t>(d);
      } else {
        std::ostringstream num;
        num.precision(17);
        num << d;
        os << num.str();
      }
    } else if (is_string()) {
      write_string(os, string());
    } else if (is_array()) {
      const auto& a = array();
      if (a.empty()) {
        os << "[]";
        return;
      }
      os << '[' << nl;
      for (size_t i = 0; i < a.size(); ++i) {
        os << pad;
        a[i].write(os, indent, depth + 1);
        os << (i + 1 < a.size() ? "," : "") << nl;
      }
      os << end_pad << ']';
    } else {
      const auto& o = object();
      if (o.empty()) {
        os << "{}";
        return;
      }
      os << '{' << nl;
      size_t i = 0;
      for (const auto& [k, v] : o) {
        os << pad;
        write_string(os, k);
        os << (indent > 0 ? ": " : ":");
        v.write(os, indent, depth + 1);
        os << (++i < o.size() ? "," : "") << nl;
      }
      os << end_pad << '}';
    }
  }

  struct Parser {
    std::string_view s;
    size_t pos;
    const std::string& what;

    void expect(bool ok, const char* msg) const {
      FSDPX_CHECK_AS(IoError, ok, "'", what, "' is not valid JSON at byte ", pos, ": ", msg);
    }
    void skip_ws() {
      while (pos < s.size() && (s[pos] == ' ' || s[pos] == '\n' || s[pos] == '\r' || s[pos] == '\t')) ++pos;
    }
    bool eat(char c) {
      skip_ws();
      if (pos < s.size() && s[pos] == c) {
        ++pos;
        return true;
      }
      return false;
    }
    bool literal(std::string_view word) {
      if (s.substr(pos, word.size()) != word) return false;
      pos += word.size();
      return true;
    }
    std::string string_value() {
      expect(eat('"'), "expected a string");
      std::string out;
      while (true) {
        expect(pos < s.size(), "unterminated string");
        const char c = s[pos++];
        if (c == '"') return out;
        if (c != '\\') {
          out += c;
          continue;
        }
        expect(pos < s.size(), "unterminated escape");
        const char e = s[pos++];
        switch (e) {
          case 'n': out += '\n'; break;
          case 't': out += '\t'; break;
          case 'r': out += '\r'; break;
          case 'b': out += '\b'; break;
          case 'f': out += '\f'; break;
          case 'u': {
            expect(pos + 4 <= s.size(), "short \\u escape");
            const unsigned code = static_cast<unsigned>(std::stoul(std::string(s.substr(pos, 4)), nullptr, 16));
            pos += 4;
            if (code < 0x80) {
              out += static_cast<char>(code);
            } else if (code < 0x800) {
              out += static_cast<char>(0xc0 | (code >> 6)), out += static_cast<char>(0x80 | (code & 0x3f));
            } else {
              out += static_cast<char>(0xe0 | (code >> 12)), out += static_cast<char>(0x80 | ((code >> 6) & 0x3f)),
                  out += static_cast<char>(0x80 | (code & 0x3f));
            }
            break;
          }
          default: out += e;
        }
      }
    }
    Json value() {
      skip_ws();
      expect(pos < s.size(), "unexpected end");
      const char c = s[pos];
      if (c == '{') {
        ++pos;
        Object o;
        if (eat('}')) return Json(std::move(o));
        do {
          skip_ws();
          std::string key = string_value();
          expect(eat(':'), "expected ':'");
          o[std::move(key)] = value();
        } while (eat(','));
        expect(eat('}'), "expected '}'");
        return Json(std::move(o));
      }
      if (c == '[') {
        ++pos;
        Array a;
        if (eat(']')) return Json(std::move(a));
        do a.push_back(value());
        while (eat(','));
        expect(eat(']'), "expected ']'");
        return Json(std::move(a));
      }
      if (c == '"') return Json(string_value());
      if (literal("true")) return Json(true);
      if (literal("false")) return Json(false);
      if (literal("null")) return Json();
      size_t used = 0;
      double d = 0;
      try {
        d = std::stod(std::string(s.substr(pos, std::min<size_t>(64, s.size() - pos))), &used);
      } catch (...) {
        expect(false, "expected a value");
      }
      pos += used;
      return Json(d);
    }
  };

  std::variant<std::monostate, bool, double, std::string, std::shared_ptr<Array>, std::shared_ptr<Object>> v_;
};

}  // namespace fsdpx::checkpoint::detail

// CRC-32C (Castagnoli): the checksum of every checkpoint file (fsdp_config.json records it) and of
// every weight-sync frame. SSE 4.2's crc32 instruction where the CPU has it (three streams at once), a table
// otherwise; the same function the Python package computes (python/fsdpx_sync/checksum.py).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

namespace fsdpx::detail {

class Crc32c {
 public:
  /// Castagnoli's polynomial, reflected.
  static constexpr uint32_t polynomial = 0x82f63b78u;
  void update(const void* data, size_t n) {
    const auto* p = static_cast<const unsigned char*>(data);
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    if (has_sse42()) {
      state_ = update_sse42(state_, p, n);
      return;
    }
#endif
    for (size_t i = 0; i < n; ++i) state_ = table()[(state_ ^ p[i]) & 0xffu] ^ (state_ >> 8);
  }
  uint32_t value() const { return ~state_; }

  static uint32_t of(const void* data, size_t n) {
    Crc32c c;
    c.update(data, n);
    return c.value();
  }

  /// The CRC-32C of A followed by B, from crc_a = of(A), crc_b = of(B) and B's length: blocks of one
  /// buffer checksummed on several threads, then joined. (crc_a times x^(8 len_b), modulo the
  /// polynomial, plus crc_b; the pre- and post-inversions cancel.)
  static uint32_t combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
    if (len_b == 0) return crc_a;
    // x^(8 len_b) mod P, by squaring: x^(2^k) for the bits of 8 len_b.
    uint32_t power = 1u << 30;  // x^1
    uint32_t shift = 1u << 31;  // x^0
    for (uint64_t bits = len_b * 8; bits != 0; bits >>= 1) {
      if (bits & 1u) shift = multiply(power, shift);
      power = multiply(power, power);
    }
    return multiply(shift, crc_a) ^ crc_b;
  }

 private:
  /// a * b modulo the polynomial, both reflected (bit 31 is x^0).
  static uint32_t multiply(uint32_t a, uint32_t b) {
    uint32_t product = 0;
    for (uint32_t m = 1u << 31; m != 0; m >>= 1) {
      if (a & m) product ^= b;
      b = (b & 1u) ? (b >> 1) ^ polynomial : b >> 1;
    }
    return product;
  }

  static const uint32_t* table() {
    static const auto t = [] {
      std::vector<uint32_t> v(256);
      for (uint32_t i = 0; i < 256; ++i) {
        uint32_t c = i;
        for (int k = 0; k < 8; ++k) c = (c & 1u) ? polynomial ^ (c >> 1) : c >> 1;
        v[i] = c;
      }
      return v;
    }();
    return t.data();
  }
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  static bool has_sse42() {
    static const bool yes = __builtin_cpu_supports("sse4.2");
    return yes;
  }
  // The instruction takes 3 cycles and one can start every cycle: three streams over adjacent lanes
  // keep it busy (about 3x one stream), joined by multiplying by x^(8 lane) (zlib's crc32_combine).
  static constexpr size_t lane = 4096;
  /// x -> x * x^(8 lane) modulo the polynomial, byte by byte (the product is linear in x).
  static const uint32_t* lane_shift_table() {
    static const auto t = [] {
      uint32_t power = 1u << 30, shift = 1u << 31;  // x^1, x^0
      for (uint64_t bits = lane * 8; bits != 0; bits >>= 1) {
        if (bits & 1u) shift = multiply(power, shift);
        power = multiply(power, power);
      }
      std::vector<uint32_t> v(4 * 256);
      for (uint32_t j = 0; j < 4; ++j) {
        for (uint32_t b = 0; b < 256; ++b) v[j * 256 + b] = multiply(shift, b << (8 * j));
      }
      return v;
    }();
    return t.data();
  }
  static uint32_t shift_lane(uint32_t x, const uint32_t* t) {
    return t[x & 0xffu] ^ t[256 + ((x >> 8) & 0xffu)] ^ t[512 + ((x >> 16) & 0xffu)] ^ t[768 + (x >> 24)];
  }
  __attribute__((target("sse4.2"))) static uint32_t update_sse42(uint32_t crc, const unsigned char* p, size_t n) {
    uint64_t c = crc;
    if (n >= 3 * lane) {
      const uint32_t* t = lane_shift_table();
      for (; n >= 3 * lane; n -= 3 * lane, p += 3 * lane) {
        uint64_t a = c, b = 0, d = 0;
        for (size_t i = 0; i < lane; i += 8) {
          uint64_t wa, wb, wd;
          std::memcpy(&wa, p + i, 8);
          std::memcpy(&wb, p + lane + i, 8);
          std::memcpy(&wd, p + 2 * lane + i, 8);
          a = __builtin_ia32_crc32di(a, wa);
          b = __builtin_ia32_crc32di(b, wb);
          d = __builtin_ia32_crc32di(d, wd);
        }
        c = shift_lane(shift_lane(static_cast<uint32_t>(a), t) ^ static_cast<uint32_t>(b), t) ^
            static_cast<uint32_t>(d);
      }
    }
    for (; n >= 8; n -= 8, p += 8) {
      uint64_t word;
      std::memcpy(&word, p, 8);
      c = __builtin_ia32_crc32di(c, word);
    }
    auto c32 = static_cast<uint32_t>(c);
    for (; n > 0; --n, ++p) c32 = __builtin_ia32_crc32qi(c32, *p);
    return c32;
  }
#endif
  uint32_t state_ = 0xffffffffu;
};

}  // namespace fsdpx::detail

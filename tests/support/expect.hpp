// For the multi-process programs whose point is an expected failure: run `body`, require that it
// throws `E` whose message contains every `needle`, and print it as "EXPECTED-ERROR: <message>".
#pragma once

#include <cstdio>
#include <exception>
#include <initializer_list>
#include <string>
#include <string_view>

namespace fsdpx::test {

template <class E, class Body>
int expect_error(Body&& body, std::initializer_list<std::string_view> needles) {
  try {
    body();
  } catch (const E& e) {
    const std::string msg = e.what();
    for (auto n : needles) {
      if (msg.find(n) == std::string::npos) {
        std::fprintf(stderr, "UNEXPECTED-MESSAGE (missing '%.*s'): %s\n", static_cast<int>(n.size()), n.data(),
                     msg.c_str());
        return 2;
      }
    }
    std::printf("EXPECTED-ERROR: %s\n", msg.c_str());
    std::fflush(stdout);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "WRONG-ERROR-TYPE: %s\n", e.what());
    return 3;
  }
  std::fprintf(stderr, "NO-ERROR: the body completed but an error was expected\n");
  return 4;
}

}  // namespace fsdpx::test

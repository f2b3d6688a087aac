// A synchronizer server driven over stdin, for the Python receiver's security tests
// (tests/sync/python_security_test.py): no MPI, no training, just the real server and publishers.
//
//   sync_server_program <max_handshakes_per_address>
//     prints "port <N>", then reads commands, one per line, answering each with one line:
//       publish <version> <run>   a SynchronizerClient of that run publishes weights_of(version): "ok" or "error
//       <text>"
//       publish_many <version> <count>   the server publishes <count> float32 tensors "t<i>" of 64 elements,
//                                        t<i> = arange(64) + i + version: "ok" or "error <text>"
//       quit
//
// The weights of version v: "w" = arange(1000) * 0.5 + v (float32, 10 x 100), "b" = v (bfloat16, 7).
#include <cstdio>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include <fsdpx/sync/service.hpp>

using namespace fsdpx;

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <max_handshakes_per_address>\n", argv[0]);
    return 2;
  }
  try {
    sync::SynchronizerServer server({.limits = {.max_handshakes_per_address = std::stoi(argv[1]),
                                                .handshake_timeout = std::chrono::milliseconds(5000)}});
    std::cout << "port " << server.port() << std::endl;
    std::string line;
    while (std::getline(std::cin, line)) {
      std::istringstream in(line);
      std::string command, run;
      int64_t version = 0;
      in >> command;
      if (command == "quit") break;
      if (command == "publish_many") {
        int64_t count = 0;
        if (!(in >> version >> count) || count < 1) {
          std::cout << "error usage: publish_many <version> <count>" << std::endl;
          continue;
        }
        std::vector<sync::NamedTensor> weights;
        weights.reserve(static_cast<size_t>(count));
        const at::Tensor row = at::arange(64, at::kFloat).add_(static_cast<double>(version));
        for (int64_t i = 0; i < count; ++i)
          weights.push_back({"t" + std::to_string(i), row.add(static_cast<double>(i))});
        try {
          server.publish(version, weights);
          std::cout << "ok" << std::endl;
        } catch (const std::exception& e) {
          std::cout << "error " << e.what() << std::endl;
        }
        continue;
      }
      if (command != "publish" || !(in >> version >> run)) {
        std::cout << "error unknown command: " << line << std::endl;
        continue;
      }
      try {
        const std::vector<sync::NamedTensor> weights{
            {"w", at::arange(1000, at::kFloat).mul_(0.5).add_(static_cast<double>(version)).view({10, 100})},
            {"b", at::full({7}, static_cast<double>(version), at::kBFloat16)}};
        sync::SynchronizerClient("127.0.0.1", server.port(), {.run = run}).publish(version, weights);
        std::cout << "ok" << std::endl;
      } catch (const std::exception& e) {
        std::cout << "error " << e.what() << std::endl;
      }
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "sync_server_program: %s\n", e.what());
    return 1;
  }
}

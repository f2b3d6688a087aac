// Tests that speak the synchronizer's protocol on a raw socket (a peer that dies mid-publish, one
// that hangs up mid-transfer, a corrupted frame) first pass its handshake, as any client must.
#pragma once

#include <array>
#include <cstdint>

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/write.hpp>

#include <fsdpx/sync/detail/handshake.hpp>
#include <fsdpx/sync/detail/frame.hpp>
#include <fsdpx/sync/service.hpp>

namespace fsdpx::test {

/// The client's side of the handshake on a raw socket, for a server without a secret: read the
/// hello, answer with a zero MAC, read the welcome.
inline void handshake_without_secret(boost::asio::ip::tcp::socket& sock,
                                     ::fsdpx::sync::Role role = ::fsdpx::sync::Role::fetch) {
  namespace sd = ::fsdpx::sync::detail;
  std::array<char, sizeof(sd::FrameHeader) + sd::nonce_bytes> hello{};
  boost::asio::read(sock, boost::asio::buffer(hello));
  std::array<uint8_t, 2 * sd::nonce_bytes> auth{};
  const auto frame = sd::make_frame(sd::FrameKind::auth, ::fsdpx::sync::no_version, static_cast<uint64_t>(role),
                                    auth.data(), auth.size());
  boost::asio::write(sock, boost::asio::buffer(&frame, sizeof(frame)));
  boost::asio::write(sock, boost::asio::buffer(auth));
  std::array<char, sizeof(sd::FrameHeader) + sd::mac_bytes> welcome{};
  boost::asio::read(sock, boost::asio::buffer(welcome));
}

}  // namespace fsdpx::test

// A synchronizer connection's byte stream: plain TCP, or TLS over it (Boost.Asio's SSL stream, with
// OpenSSL). The server and the client write their protocol once, against this. TLS adds what the
// HMAC handshake alone does not give: the frames after it are private and cannot be altered or
// injected by a peer on the path (docs/sync.md, "Threat model").
#pragma once

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/asio/write.hpp>
#include <openssl/err.h>
#include <openssl/ssl.h>

#include <optional>
#include <string>
#include <utility>

#include <fsdpx/error.hpp>

namespace fsdpx::sync::detail {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;

/// TLS 1.2 or newer, nothing older.
inline constexpr auto tls_options = asio::ssl::context::default_workarounds | asio::ssl::context::no_sslv2 |
                                    asio::ssl::context::no_sslv3 | asio::ssl::context::no_tlsv1 |
                                    asio::ssl::context::no_tlsv1_1 | asio::ssl::context::single_dh_use;

/// A server's TLS context: its certificate chain and private key (PEM files). SyncError naming the
/// file when either cannot be used.
inline asio::ssl::context server_tls_context(const std::string& certificate_file, const std::string& private_key_file) {
  asio::ssl::context tls(asio::ssl::context::tls_server);
  tls.set_options(tls_options);
  boost::system::error_code ec;
  tls.use_certificate_chain_file(certificate_file, ec);
  FSDPX_CHECK_AS(SyncError, !ec, "synchronizer server: the TLS certificate '", certificate_file,
                 "' cannot be used: ", ec.message());
  tls.use_private_key_file(private_key_file, asio::ssl::context::pem, ec);
  FSDPX_CHECK_AS(SyncError, !ec, "synchronizer server: the TLS private key '", private_key_file,
                 "' cannot be used: ", ec.message());
  // No session tickets: nothing arrives on an idle connection unless the server closes it (the
  // client takes unasked-for bytes for a hang-up), and no session outlives its connection.
  SSL_CTX_set_num_tickets(tls.native_handle(), 0);
  return tls;
}

/// A client's TLS context: verifies the server's certificate against `ca_file` (PEM; empty: the
/// system's trusted certificates) and its name against `server_name` (a host name or an IP address).
inline asio::ssl::context client_tls_context(const std::string& ca_file, const std::string& server_name) {
  asio::ssl::context tls(asio::ssl::context::tls_client);
  tls.set_options(tls_options);
  boost::system::error_code ec;
  if (ca_file.empty()) {
    tls.set_default_verify_paths(ec);
  } else {
    tls.load_verify_file(ca_file, ec);
  }
  FSDPX_CHECK_AS(SyncError, !ec, "synchronizer client: the TLS certificate authorities '",
                 ca_file.empty() ? "(the system's)" : ca_file, "' cannot be loaded: ", ec.message());
  tls.set_verify_mode(asio::ssl::verify_peer);
  tls.set_verify_callback(asio::ssl::host_name_verification(server_name));
  return tls;
}

/// One connection: a TCP socket, with TLS over it when a context is given (null: plain).
class Stream {
 public:
  Stream(tcp::socket socket, asio::ssl::context* tls) {
    if (tls != nullptr) {
      tls_.emplace(std::move(socket), *tls);
    } else {
      plain_.emplace(std::move(socket));
    }
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  tcp::socket& socket() { return tls_ ? tls_->next_layer() : *plain_; }
  bool is_tls() const { return tls_.has_value(); }
  /// TLS, and no handshake message has arrived yet (the peer sent nothing TLS understands).
  bool tls_not_started() { return tls_ && SSL_get_state(tls_->native_handle()) == TLS_ST_BEFORE; }
  /// Names the server in the TLS hello (SNI), for servers that pick a certificate by name.
  void set_server_name(const std::string& name) {
    if (tls_ && !name.empty()) SSL_set_tlsext_host_name(tls_->native_handle(), name.c_str());
  }

  template <class Buffers, class Handler>
  void async_write(const Buffers& buffers, Handler&& handler) {
    if (tls_) {
      asio::async_write(*tls_, buffers, std::forward<Handler>(handler));
    } else {
      asio::async_write(*plain_, buffers, std::forward<Handler>(handler));
    }
  }
  template <class Buffers, class Handler>
  void async_read(const Buffers& buffers, Handler&& handler) {
    if (tls_) {
      asio::async_read(*tls_, buffers, std::forward<Handler>(handler));
    } else {
      asio::async_read(*plain_, buffers, std::forward<Handler>(handler));
    }
  }
  /// The TLS handshake (a plain stream has none: the handler runs with no error).
  template <class Handler>
  void async_handshake(asio::ssl::stream_base::handshake_type type, Handler&& handler) {
    if (tls_) {
      tls_->async_handshake(type, std::forward<Handler>(handler));
    } else {
      asio::post(socket().get_executor(),
                 [h = std::forward<Handler>(handler)]() mutable { h(boost::system::error_code()); });
    }
  }

 private:
  std::optional<tcp::socket> plain_;
  std::optional<asio::ssl::stream<tcp::socket>> tls_;
};

/// A TLS failure in words a user acts on (OpenSSL's reason, and what it usually means here), told
/// apart by OpenSSL's reason code, not by its message text.
inline std::string tls_failure(const boost::system::error_code& ec) {
  std::string text = ec.message();
  if (ec.category() == asio::error::get_ssl_category()) {
    const auto code = static_cast<unsigned long>(ec.value());
    const int reason = ERR_GET_LIB(code) == ERR_LIB_SSL ? ERR_GET_REASON(code) : 0;
    if (reason == SSL_R_CERTIFICATE_VERIFY_FAILED) {
      text += " (the server's certificate is not signed by the trusted authorities, or does not name this server)";
    } else if (reason == SSL_R_WRONG_VERSION_NUMBER || reason == SSL_R_PACKET_LENGTH_TOO_LONG) {
      text += " (the other side does not speak TLS: is TLS set on both the server and the client?)";
    }
  }
  return text;
}

}  // namespace fsdpx::sync::detail

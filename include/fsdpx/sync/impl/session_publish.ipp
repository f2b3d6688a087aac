// A publish on one connection of the synchronizer server (detail::Session): its begin, buckets and end
// frames, the staging that holds each publisher's buckets until its end frame, and the commit, which runs on
// the committer thread, off the I/O thread that serves handshakes and fetches. Included by
// sync/impl/server.ipp, after sync/impl/server_session.ipp.
#pragma once

#include <fsdpx/sync/detail/server_core.hpp>

namespace fsdpx::sync::detail {
inline void Session::begin_publish() {
  if (pending_) return refuse("a publish inside a publish", &ServerStats::protocol_errors);
  const auto& o = core_->options;
  Pending p;
  p.version = in_.version;
  p.count = in_.aux;
  p.run = run_label(small_text());  // readers see the label, never the identity
  {
    // Said now, so the publisher learns it at its end frame without the server keeping its buckets;
    // checked again at the commit (another publisher may commit meanwhile).
    std::lock_guard lock(core_->runs_mutex);
    p.rejected = core_->admission(p.run, p.version);
  }
  // Every bucket holds at least a header; a count no version could fill is refused at once.
  if (p.count == 0 || p.count > static_cast<uint64_t>(o.limits.max_version_bytes / prefix_bytes)) {
    return refuse(::fsdpx::detail::str("a publish of ", p.count, " buckets"), &ServerStats::protocol_errors);
  }
  is_publisher_ = true;
  said_goodbye_ = false;
  publish_run_ = p.run;
  if (publishes_served_run()) core_->publisher_lost.clear();
  stage(std::move(p));
  read_header();
}

/// Each publishing connection stages its own version: publishers never cancel one another, and a
/// publish's fate (committed, or refused with the reason) is told at its end frame.
inline void Session::stage(Pending p) {
  pending_ = std::move(p);
  core_->staging.push_back(this);
}

inline void Session::unstage() {
  if (!pending_) return;
  core_->staged_bytes -= pending_->staged_bytes;
  std::erase(core_->staging, this);
  pending_.reset();
}

/// The publish will not commit, for `why` (told at its end frame); what it held is freed now.
inline void Session::drop_staged(const std::string& why) {
  Pending& p = *pending_;
  if (p.rejected.empty()) p.rejected = why;
  p.buckets.clear();
  p.coverage = VersionCoverage();
  p.held_bytes = 0;
  core_->staged_bytes -= p.staged_bytes;
  p.staged_bytes = 0;
}

/// Whether this connection publishes the run being served (or would be the first): its loss is the
/// trainer's, which readers waiting for a newer version must hear of. Another publisher's is not.
inline bool Session::publishes_served_run() const {
  std::lock_guard lock(core_->runs_mutex);
  return core_->current_run.empty() || core_->current_run == publish_run_;
}

/// A bucket of the publish: checked (its place in the version, its header, and that its chunks cover
/// elements no other chunk did) and kept; or, once the publish is rejected, counted and dropped.
inline void Session::on_bucket() {
  if (!pending_) return refuse("a bucket outside a publish", &ServerStats::protocol_errors);
  Pending& p = *pending_;
  p.bytes += static_cast<int64_t>(in_.length);
  const uint64_t index = p.received++;
  if (p.rejected.empty()) {
    try {
      const BucketLayout b = check_bucket(payload_, p.version, index, p.count, "publisher " + peer_);
      const int64_t limit = core_->options.limits.max_version_bytes;
      for (const BucketEntry& e : b.entries) {
        if (std::string problem = p.coverage.add(e, b.index); !problem.empty()) {
          p.rejected = ::fsdpx::detail::str("version ", p.version, " is not whole: ", problem);
          break;
        }
        // Many tiny tensors, or scattered chunks, cost bookkeeping beyond their bytes: counted too.
        if (p.coverage.bookkeeping_bytes() > limit - p.bytes) {
          p.rejected = ::fsdpx::detail::str("version ", p.version, " takes more than max_version_bytes (", limit,
                                            ") with the bookkeeping of its ", b.entries.size(), "-entry buckets");
          break;
        }
        p.rejected = bookkeeping_problem(p.coverage.bookkeeping_bytes(), p.bytes, version_bookkeeping_floor,
                                         ::fsdpx::detail::str("version ", p.version));
        if (!p.rejected.empty()) break;
      }
    } catch (const SyncError& e) {
      p.rejected = std::string(unprefixed(e.what()));
    }
  }
  if (!p.rejected.empty()) {
    drop_staged(p.rejected);  // it will not commit: nothing more is held for it
  } else {
    p.held_bytes += static_cast<int64_t>(payload_.nbytes());
    p.buckets.push_back(std::move(payload_));
    const int64_t staged = p.held_bytes + p.coverage.bookkeeping_bytes();
    core_->staged_bytes += staged - p.staged_bytes;
    p.staged_bytes = staged;
    p.last_progress = std::chrono::steady_clock::now();
    make_staging_room();
  }
  payload_ = at::Tensor();
  read_header();
}

/// Keeps all unfinished publishes within max_version_bytes together, with the versions waiting for
/// their commit (this one alone fits: see allowed_payload), by dropping the others that progressed
/// least recently: a publisher that stalled never holds an active one back, and two honest publishers
/// whose versions fit side by side never meet this. The publish of the run being served (the trainer's)
/// is never dropped for another run's: when nothing else can go, this publish is the one dropped.
inline void Session::make_staging_room() {
  const int64_t limit = core_->options.limits.max_version_bytes;
  const bool served_run = publishes_served_run();
  while (core_->staged_bytes + core_->committing_bytes > limit) {
    Session* stalest = nullptr;
    for (Session* s : core_->staging) {
      if (s != this && s->pending_->staged_bytes > 0 && (served_run || !s->publishes_served_run()) &&
          (stalest == nullptr || s->pending_->last_progress < stalest->pending_->last_progress)) {
        stalest = s;
      }
    }
    if (stalest == nullptr) {
      if (served_run) return;  // only the served run's own publishes are staged
      return drop_staged(::fsdpx::detail::str(
          "version ", pending_->version, " was dropped: the server stages at most max_version_bytes (", limit,
          ") of unfinished publishes together, and the rest is the served trainer run's, which is never dropped "
          "for another run's; publish it again"));
    }
    const auto idle = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() -
                                                                            stalest->pending_->last_progress);
    stalest->drop_staged(::fsdpx::detail::str(
        "version ", stalest->pending_->version, " was dropped before its end to make room for version ",
        pending_->version, " from another publisher (", peer_, "): the server stages at most max_version_bytes (",
        limit, ") of unfinished publishes together, and this one's last bucket came ", idle.count(),
        " ms before; publish it again"));
  }
}

inline void Session::end_publish() {
  if (!pending_ || in_.version != pending_->version)
    return refuse("an end frame outside its publish", &ServerStats::protocol_errors);
  auto p = std::make_shared<Pending>(std::move(*pending_));
  unstage();
  if (p->rejected.empty() && p->received != p->count) {
    p->rejected =
        ::fsdpx::detail::str("version ", p->version, " ended after ", p->received, " of ", p->count, " buckets");
  }
  if (p->rejected.empty()) {
    if (std::string missing = p->coverage.missing(); !missing.empty()) {
      p->rejected = ::fsdpx::detail::str("version ", p->version, " is not whole: ", missing);
    }
  }
  if (!p->rejected.empty()) return answer_publish(p->version, {std::move(p->rejected), 0});
  // The publisher waits for its answer (nothing is read meanwhile); its version commits on the committer,
  // its bytes counted with the staged ones until then.
  ++watch_generation_;
  const int64_t held = p->held_bytes + p->coverage.bookkeeping_bytes();
  core_->committing_bytes += held;
  off_io_thread([p, held](Session& self) mutable {
    Outcome outcome = self.commit_publish(*p);
    const int64_t version = p->version;
    p.reset();  // its buckets (unless served) freed now
    return [version, held, outcome = std::move(outcome)](Session& s) {
      s.core_->committing_bytes -= held;
      s.answer_publish(version, outcome);
    };
  });
}

/// The commit of a whole publish, on the committer: its tensors (a copy of its chunks) go to the store,
/// a full version replacing the held one, a delta applied to it, every CRC-32C checked; the buckets as
/// they came are served. Touches the store (under ServerCore::commit's lock), never the I/O thread's state.
inline Session::Outcome Session::commit_publish(Pending& p) const {
  Outcome out;
  try {
    TensorCollector collector(at::kCPU, core_->options.limits.max_version_bytes, /*huge_pages=*/false);  // a peer's
    const std::string where = "publisher " + peer_;
    for (const at::Tensor& bucket : p.buckets) {
      const BucketLayout b = decode_header(bucket.const_data_ptr<uint8_t>(), bucket.numel(), where);
      for (const auto& e : b.entries) collector.accept_from(bucket, e);
    }
    std::vector<NamedTensor> tensors = collector.finish();
    const Manifest manifest = split_manifest(tensors, where).first;
    FSDPX_CHECK_AS(SyncError, manifest.version == p.version, "version ", p.version, " carries the manifest of version ",
                   manifest.version);
    out.rejected = core_->commit(p.run, p.version, [&] {
      if (manifest.is_delta() && !core_->store.holds(manifest.base_version, manifest.base_digest)) {
        out.refusal = refused_base;
        throw SyncError(::fsdpx::detail::str(
            "fsdpx: version ", p.version, " is a delta from version ", manifest.base_version, " (digest ",
            manifest.base_digest, "), which this server does not hold (it holds ",
            core_->store.empty() ? std::string("none") : ::fsdpx::detail::str("version ", core_->store.version()),
            "): send it full"));
      }
      // Frame headers are made anew: a reader gets the server's, never fields a publisher chose. Made
      // before the store changes, so that nothing after it can fail and leave store and slot apart.
      auto snapshot = encode_snapshot(p.version, p.run, std::move(p.buckets));
      auto served = std::make_shared<ServedVersion>();
      served->digest = manifest.digest;
      core_->store.accept(std::move(tensors), VersionStore::Apply::owned, where);
      if (manifest.is_delta()) {
        served->base_version = manifest.base_version;
        served->base_digest = manifest.base_digest;
        served->delta = std::move(snapshot);
      } else {
        served->full = std::move(snapshot);
      }
      return served;
    });
  } catch (const SyncError& e) {
    out.rejected = std::string(unprefixed(e.what()));
  } catch (const std::exception& e) {
    out.rejected = ::fsdpx::detail::str("the server could not commit it: ", e.what());
  } catch (...) {
    out.rejected = "the server could not commit it";  // never thrown on: the committed bytes are counted back
  }
  return out;
}

/// The publisher's answer, on the I/O thread: readers waiting for a newer version are woken by a commit.
inline void Session::answer_publish(int64_t version, const Outcome& outcome) {
  if (!outcome.rejected.empty()) return send(make_frame(FrameKind::error, version, outcome.refusal), outcome.rejected);
  last_published_ = version;
  core_->wake_waiters();
  send(make_frame(FrameKind::ack, version));
}

}  // namespace fsdpx::sync::detail

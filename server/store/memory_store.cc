#include "server/store/memory_store.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "core/mutex.h"
#include "core/status_macros.h"
#include "server/metrics/metrics.h"

namespace kvrelay {

namespace {
// Closed sessions remembered at most (each a few dozen bytes).
constexpr size_t kMaxClosedSessions = 1 << 20;
}  // namespace

MemoryStore::MemoryStore(const StoreLimits& limits, Metrics* metrics, TimeSource* time)
    : limits_(limits), metrics_(metrics), time_(time) {
  timer_ = std::thread([this] { TimerLoop(); });
}

MemoryStore::~MemoryStore() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
  }
  cv_.SignalAll();
  timer_.join();
}

Clock::duration MemoryStore::Ttl() const {
  return std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(limits_.session_ttl_seconds));
}

namespace {

// What a refusal adds when the request alone is over the limit: waiting for
// room cannot help, so a client should not retry.
absl::Status NoSession(const std::string& session) {
  return absl::NotFoundError(absl::StrCat("session_id: '", session, "': no such session (closed or expired?)"));
}

absl::Status NoMessage(const std::string& session, const std::string& message_id) {
  return absl::NotFoundError(
      absl::StrCat("message_id: '", message_id, "': no such message in session '", session, "'"));
}

std::string AloneOver(uint64_t bytes, uint64_t limit) {
  return bytes > limit ? "; the request alone is over the limit, so retrying cannot succeed" : "";
}

}  // namespace

absl::Status MemoryStore::ReserveInflight(uint64_t bytes, absl::string_view what) {
  uint64_t cur = inflight_.load();
  do {
    if (cur + bytes > limits_.max_inflight_bytes || cur + bytes < cur) {
      return absl::ResourceExhaustedError(absl::StrCat(
          what, ": ", bytes, " bytes would put uploads in progress at ", cur + bytes,
          " bytes, expected at most --max-inflight-bytes=", limits_.max_inflight_bytes,
          AloneOver(bytes, limits_.max_inflight_bytes)));
    }
  } while (!inflight_.compare_exchange_weak(cur, cur + bytes));
  PublishInflight();
  return absl::OkStatus();
}

void MemoryStore::AddInflight(uint64_t bytes) {
  inflight_.fetch_add(bytes);
  PublishInflight();
}

void MemoryStore::ReleaseInflight(uint64_t bytes) {
  inflight_.fetch_sub(bytes);
  PublishInflight();
}

void MemoryStore::PublishInflight() {
  // Every update is followed by a set, under one lock, from the counter's
  // value at that time: the last set reflects every update before it.
  if (!metrics_) return;
  MutexLock lock(&gauge_mu_);
  metrics_->SetInflight(static_cast<double>(inflight_.load()));
}

absl::Status MemoryStore::CheckBytesLocked(const std::string& session, const Session* s,
                                     const std::vector<std::string>& recipients, uint64_t bytes,
                                     absl::string_view what) const {
  if (s) {
    for (const std::string& r : recipients) {
      auto mb = s->mailboxes.find(r);
      const uint64_t held = mb == s->mailboxes.end() ? 0 : mb->second.bytes;
      if (held + bytes > limits_.max_mailbox_bytes) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "mailbox of '", r, "' in session '", session, "': ", held, " bytes unacked + ", bytes, " bytes of ",
            what, ", expected at most --max-mailbox-bytes=", limits_.max_mailbox_bytes,
            AloneOver(bytes, limits_.max_mailbox_bytes)));
      }
    }
  } else if (bytes > limits_.max_mailbox_bytes && !recipients.empty()) {
    return absl::ResourceExhaustedError(absl::StrCat("mailbox of '", recipients[0], "' in session '", session,
                                                     "': 0 bytes unacked + ", bytes, " bytes of ", what,
                                                     ", expected at most --max-mailbox-bytes=",
                                                     limits_.max_mailbox_bytes,
                                                     AloneOver(bytes, limits_.max_mailbox_bytes)));
  }
  const uint64_t session_bytes = s ? s->bytes : 0;
  if (session_bytes + bytes > limits_.max_session_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "session '", session, "': ", session_bytes, " bytes retained + ", bytes, " bytes of ", what,
        ", expected at most --max-session-bytes=", limits_.max_session_bytes,
        " (acked messages count until the session closes or expires)", AloneOver(bytes, limits_.max_session_bytes)));
  }
  if (store_bytes_ + bytes > limits_.max_store_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "store: ", store_bytes_, " bytes retained in all sessions + ", bytes, " bytes of ", what,
        ", expected at most --max-store-bytes=", limits_.max_store_bytes,
        " (acked messages count until their session closes or expires)", AloneOver(bytes, limits_.max_store_bytes)));
  }
  return absl::OkStatus();
}

MessagePtr MemoryStore::Find(const std::string& session, const std::string& message_id) const {
  MutexLock lock(&mu_);
  auto s = sessions_.find(session);
  if (s == sessions_.end()) return nullptr;
  auto m = s->second.messages.find(message_id);
  return m == s->second.messages.end() ? nullptr : m->second;
}

absl::StatusOr<MessagePtr> MemoryStore::LookupParent(const std::string& session, const std::string& parent_id,
                                               const std::string& sender) const {
  MutexLock lock(&mu_);
  auto s = sessions_.find(session);
  const MessagePtr* m = nullptr;
  if (s != sessions_.end()) {
    auto it = s->second.messages.find(parent_id);
    if (it != s->second.messages.end()) m = &it->second;
  }
  if (!m || !MaySee(**m, sender)) return NotVisibleError("header.parent_id", session, parent_id, sender);
  if (!s->second.delivered.count({parent_id, sender})) {
    return absl::FailedPreconditionError(absl::StrCat("header.parent_id: '", parent_id,
                                                      "': expected a message delivered to the sender '",
                                                      sender, "'"));
  }
  return *m;
}

absl::Status MemoryStore::CheckCanPublish(const std::string& session, const std::vector<std::string>& recipients,
                                    uint64_t bytes) const {
  MutexLock lock(&mu_);
  auto s = sessions_.find(session);
  const Session* sp = s == sessions_.end() ? nullptr : &s->second;
  if (sp && sp->messages.size() >= limits_.max_session_messages) {
    return absl::ResourceExhaustedError(absl::StrCat("session '", session, "': ", sp->messages.size(),
                                                     " messages, expected at most --max-session-messages=",
                                                     limits_.max_session_messages));
  }
  return CheckBytesLocked(session, sp, recipients, bytes, "the message (at least)");
}

MemoryStore::PublishTicket MemoryStore::BeginPublish(const std::string& session) {
  MutexLock lock(&mu_);
  ++publishing_[session].in_progress;
  return PublishTicket{session, close_seq_};
}

void MemoryStore::EndPublish(const PublishTicket& t) {
  MutexLock lock(&mu_);
  auto it = publishing_.find(t.session);
  // A close only matters to the session's publishes in progress: with none
  // left the entry goes, its last close with it.
  if (it != publishing_.end() && --it->second.in_progress == 0) publishing_.erase(it);
}

absl::StatusOr<MemoryStore::CommitResult> MemoryStore::Commit(std::shared_ptr<StoredMessage> m, const PublishTicket& t) {
  return CommitWithHook(std::move(m), t, nullptr);
}

absl::StatusOr<MemoryStore::CommitResult> MemoryStore::CommitWithHook(std::shared_ptr<StoredMessage> m,
                                                                      const PublishTicket& t, const CommitHook& hook) {
  std::vector<WakeFn> wakes;
  CommitResult result;
  {
    MutexLock lock(&mu_);
    KVRELAY_RETURN_IF_ERROR(CheckNotClosedSinceLocked(t, "publish"));
    Session& s = sessions_[m->session_id];
    const bool fresh = s.messages.empty() && s.mailboxes.empty();
    auto drop_if_fresh = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      if (fresh) sessions_.erase(m->session_id);
    };
    if (auto it = s.messages.find(m->message_id); it != s.messages.end()) {
      result.msg = it->second;
      result.duplicate = true;
      return result;
    }
    if (s.messages.size() >= limits_.max_session_messages) {
      drop_if_fresh();
      return absl::ResourceExhaustedError(absl::StrCat("session '", m->session_id, "': ", limits_.max_session_messages,
                                                       " messages, expected at most --max-session-messages=",
                                                       limits_.max_session_messages));
    }
    std::vector<std::string> local;
    for (const std::string& r : m->recipients) {
      if (!m->remote.count(r)) local.push_back(r);
    }
    if (absl::Status st = CheckBytesLocked(m->session_id, &s, local, m->bytes, "this message");
        !st.ok()) {
      drop_if_fresh();
      return st;
    }
    MessagePtr msg = std::move(m);
    if (hook) hook(msg, local);
    s.messages[msg->message_id] = msg;
    s.bytes += msg->bytes;
    store_bytes_ += msg->bytes;
    s.last_active = time_->Now();
    for (const std::string& r : local) AddToMailboxLocked(s, msg, r, &wakes);
    ++committed_;
    full_ += msg->msg.full_bytes;
    sent_ += msg->msg.sent_bytes;
    closed_.erase(msg->session_id);  // a publish here reopens a closed session
    PublishGaugesLocked();
    result.msg = std::move(msg);
  }
  for (WakeFn& w : wakes) w(Wake::kMessage);
  return result;
}

std::optional<MemoryStore::Delivery> MemoryStore::FetchOrWait(const std::string& session, const std::string& agent,
                                                  Clock::time_point deadline, WakeFn wake, uint64_t* waiter) {
  MutexLock lock(&mu_);
  auto s = sessions_.find(session);
  if (s != sessions_.end()) {
    auto mb = s->second.mailboxes.find(agent);
    if (mb != s->second.mailboxes.end() && !mb->second.entries.empty()) {
      Entry& e = mb->second.entries.front();
      ++e.attempts;
      s->second.last_active = time_->Now();
      return Delivery{e.msg, e.attempts};
    }
  }
  if (shutting_down_) {
    *waiter = 0;
    return std::nullopt;
  }
  const uint64_t id = next_waiter_++;
  waiters_[id] = Waiter{session, agent, deadline, std::move(wake)};
  PublishWaitersLocked();
  *waiter = id;
  cv_.SignalAll();  // the timer may need an earlier wakeup
  return std::nullopt;
}

bool MemoryStore::MarkDelivered(const std::string& session, const std::string& agent, const std::string& message_id) {
  MutexLock lock(&mu_);
  ++delivered_;
  auto s = sessions_.find(session);
  if (s == sessions_.end() || !s->second.messages.count(message_id)) return false;  // closed or expired meanwhile
  s->second.last_active = time_->Now();
  return s->second.delivered.insert({message_id, agent}).second;
}

bool MemoryStore::CancelWaiter(uint64_t waiter) {
  MutexLock lock(&mu_);
  auto it = waiters_.find(waiter);
  if (it == waiters_.end()) return false;
  TouchLocked(it->second.session);  // waited on until now
  waiters_.erase(it);
  PublishWaitersLocked();
  return true;
}

absl::Status MemoryStore::Ack(const std::string& session, const std::string& agent, const std::string& message_id) {
  MutexLock lock(&mu_);
  auto s = sessions_.find(session);
  if (s == sessions_.end()) {
    return NoSession(session);
  }
  // A message the agent is no recipient of reads as missing: an ack tells
  // no one whether an id exists.
  auto here = s->second.local.find(message_id);
  if (!s->second.messages.count(message_id) || here == s->second.local.end() || !here->second.count(agent)) {
    return NotVisibleError("message_id", session, message_id, agent);
  }
  if (!s->second.delivered.count({message_id, agent})) {
    return absl::FailedPreconditionError(absl::StrCat("message_id: '", message_id, "': not delivered to '", agent,
                                                      "' yet, expected a message it fetched (Fetch first)"));
  }
  s->second.last_active = time_->Now();
  auto mb = s->second.mailboxes.find(agent);
  if (mb == s->second.mailboxes.end()) return absl::OkStatus();
  auto& entries = mb->second.entries;
  for (auto it = entries.begin(); it != entries.end(); ++it) {
    if (it->msg->message_id == message_id) {
      mb->second.bytes -= it->msg->bytes;
      mailbox_bytes_ -= it->msg->bytes;
      --mailbox_messages_;
      entries.erase(it);
      ++acked_;
      if (metrics_) metrics_->AddOutcome("acked");
      PublishGaugesLocked();
      break;
    }
  }
  return absl::OkStatus();
}

void MemoryStore::EraseSessionLocked(std::map<std::string, Session>::iterator it, bool expired) {
  store_bytes_ -= it->second.bytes;
  uint64_t n = 0;
  for (auto& [agent, mb] : it->second.mailboxes) {
    n += mb.entries.size();
    mailbox_messages_ -= mb.entries.size();
    mailbox_bytes_ -= mb.bytes;
  }
  if (metrics_ && n) metrics_->AddOutcome(expired ? "expired" : "closed", static_cast<double>(n));
  if (erase_listener_) erase_listener_(it->first, expired);
  sessions_.erase(it);
  PublishGaugesLocked();
}

uint32_t MemoryStore::CloseSession(const std::string& session) { return CloseSessionAndPeers(session).messages_freed; }

Store::CloseResult MemoryStore::CloseSessionAndPeers(const std::string& session) {
  std::vector<WakeFn> wakes;
  CloseResult r;
  {
    MutexLock lock(&mu_);
    // Waiters may wait on a session that holds nothing yet: wake them too.
    TakeWaitersLocked([&](const Waiter& w) { return w.session == session; }, &wakes);
    auto s = sessions_.find(session);
    if (s != sessions_.end()) {
      r.messages_freed = static_cast<uint32_t>(s->second.messages.size());
      r.peers.assign(s->second.peers.begin(), s->second.peers.end());
      EraseSessionLocked(s, /*expired=*/false);
    }
    if (auto p = publishing_.find(session); p != publishing_.end()) p->second.last_close = ++close_seq_;
    const Clock::time_point now = time_->Now();
    r.first = closed_.emplace(session, now).second;
    if (r.first) {
      closed_order_.emplace_back(now, session);
      while (closed_order_.size() > kMaxClosedSessions) {
        auto it = closed_.find(closed_order_.front().second);
        if (it != closed_.end() && it->second == closed_order_.front().first) closed_.erase(it);
        closed_order_.pop_front();
      }
    }
  }
  for (WakeFn& w : wakes) w(Wake::kClosed);
  return r;
}

void MemoryStore::Shutdown() {
  std::vector<WakeFn> wakes;
  {
    MutexLock lock(&mu_);
    shutting_down_ = true;
    TakeWaitersLocked([](const Waiter&) { return true; }, &wakes);
  }
  for (WakeFn& w : wakes) w(Wake::kShutdown);
}

bool MemoryStore::shutting_down() const {
  MutexLock lock(&mu_);
  return shutting_down_;
}

void MemoryStore::SweepExpired() {
  MutexLock lock(&mu_);
  const Clock::time_point cutoff = time_->Now() - Ttl();
  std::set<std::string> waited_on;
  for (const auto& [id, w] : waiters_) waited_on.insert(w.session);
  for (auto it = sessions_.begin(); it != sessions_.end();) {
    auto next = std::next(it);
    if (it->second.last_active < cutoff && !publishing_.count(it->first) && !waited_on.count(it->first)) {
      EraseSessionLocked(it, /*expired=*/true);
    }
    it = next;
  }
  while (!closed_order_.empty() && closed_order_.front().first < cutoff) {
    auto it = closed_.find(closed_order_.front().second);
    if (it != closed_.end() && it->second == closed_order_.front().first) closed_.erase(it);
    closed_order_.pop_front();
  }
}

void MemoryStore::TouchLocked(const std::string& session) {
  if (auto s = sessions_.find(session); s != sessions_.end()) s->second.last_active = time_->Now();
}

void MemoryStore::PublishWaitersLocked() {
  if (metrics_) metrics_->SetFetchesWaiting(static_cast<double>(waiters_.size()));
}

void MemoryStore::TakeWaitersLocked(absl::FunctionRef<bool(const Waiter&)> take, std::vector<WakeFn>* wakes) {
  const size_t before = waiters_.size();
  for (auto it = waiters_.begin(); it != waiters_.end();) {
    if (take(it->second)) {
      wakes->push_back(std::move(it->second.wake));
      it = waiters_.erase(it);
    } else {
      ++it;
    }
  }
  if (waiters_.size() != before) PublishWaitersLocked();
}

void MemoryStore::PublishGaugesLocked() {
  if (!metrics_) return;
  metrics_->SetMailbox(static_cast<double>(mailbox_messages_), static_cast<double>(mailbox_bytes_));
  metrics_->SetStoreBytes(static_cast<double>(store_bytes_));
}

StoreStats MemoryStore::Stats() const {
  StoreStats st;
  MutexLock lock(&mu_);
  st.committed = committed_;
  st.failed = failed_;
  st.delivered = delivered_;
  st.acked = acked_;
  st.received_bytes = received_;
  st.full_bytes = full_;
  st.sent_bytes = sent_;
  st.sessions = sessions_.size();
  st.mailbox_messages = mailbox_messages_;
  st.mailbox_bytes = mailbox_bytes_;
  st.inflight_bytes = inflight_;
  st.store_bytes = store_bytes_;
  st.fetch_waiters = waiters_.size();
  return st;
}

void MemoryStore::TimerLoop() {
  // Sweeps a few times per TTL (10 ms .. 1 s) and fires waiter deadlines.
  const auto sweep_every = std::clamp<Clock::duration>(Ttl() / 4, std::chrono::milliseconds(10),
                                                       std::chrono::seconds(1));
  Clock::time_point next_sweep = time_->Now() + sweep_every;
  MutexLock lock(&mu_);
  while (!stop_) {
    Clock::time_point wake_at = next_sweep;
    for (const auto& [id, w] : waiters_) wake_at = std::min(wake_at, w.deadline);
    time_->WaitUntil(&cv_, &mu_, wake_at);
    if (stop_) break;
    const Clock::time_point now = time_->Now();
    std::vector<WakeFn> expired;
    TakeWaitersLocked(
        [&](const Waiter& w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {  // called by TakeWaitersLocked
          if (w.deadline > now) return false;
          TouchLocked(w.session);  // waited on until now
          return true;
        },
        &expired);
    const bool sweep = now >= next_sweep;
    mu_.Unlock();
    for (WakeFn& w : expired) w(Wake::kTimeout);
    if (sweep) {
      SweepExpired();
      next_sweep = time_->Now() + sweep_every;
    }
    mu_.Lock();
  }
}

absl::Status MemoryStore::CheckNotClosedSinceLocked(const PublishTicket& t, absl::string_view what) const {
  auto p = publishing_.find(t.session);
  if (p == publishing_.end() || p->second.last_close <= t.close_seq) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("session '", t.session, "': closed while this ", what, " was in progress; nothing was stored"));
}

void MemoryStore::AddToMailboxLocked(Session& s, const MessagePtr& msg, const std::string& agent,
                                     std::vector<WakeFn>* wakes) {
  Mailbox& mb = s.mailboxes[agent];
  mb.entries.push_back({msg, 0});
  mb.bytes += msg->bytes;
  ++mailbox_messages_;
  mailbox_bytes_ += msg->bytes;
  s.local[msg->message_id].insert(agent);
  TakeWaitersLocked([&](const Waiter& w) { return w.session == msg->session_id && w.agent == agent; }, wakes);
}

absl::StatusOr<Store::ForwardCommitResult> MemoryStore::CommitForward(std::shared_ptr<StoredMessage> m,
                                                                     const std::vector<std::string>& recipients,
                                                                     const PublishTicket& t) {
  return CommitForwardWithHook(std::move(m), recipients, t, nullptr);
}

absl::StatusOr<Store::ForwardCommitResult> MemoryStore::CommitForwardWithHook(
    std::shared_ptr<StoredMessage> m, const std::vector<std::string>& recipients, const PublishTicket& t,
    const CommitHook& hook) {
  std::vector<WakeFn> wakes;
  ForwardCommitResult result;
  {
    MutexLock lock(&mu_);
    KVRELAY_RETURN_IF_ERROR(CheckNotClosedSinceLocked(t, "forward"));
    if (closed_.count(m->session_id)) {
      return absl::FailedPreconditionError(
          absl::StrCat("session '", m->session_id, "': closed on this relay; a close is not undone by a forward"));
    }
    Session& s = sessions_[m->session_id];
    const bool fresh = s.messages.empty() && s.mailboxes.empty();
    MessagePtr msg;
    if (auto it = s.messages.find(m->message_id); it != s.messages.end()) {
      msg = it->second;
      result.duplicate = true;
    } else {
      absl::Status st;
      if (s.messages.size() >= limits_.max_session_messages) {
        st = absl::ResourceExhaustedError(absl::StrCat("session '", m->session_id, "': ",
                                                       limits_.max_session_messages,
                                                       " messages, expected at most --max-session-messages=",
                                                       limits_.max_session_messages));
      } else {
        st = CheckBytesLocked(m->session_id, &s, {}, m->bytes, "this forwarded message");
      }
      if (!st.ok()) {
        if (fresh) sessions_.erase(m->session_id);
        return st;
      }
      msg = std::move(m);
      s.messages[msg->message_id] = msg;
      s.bytes += msg->bytes;
      store_bytes_ += msg->bytes;
    }
    s.last_active = time_->Now();
    if (!msg->origin.empty()) {  // before anyone here can see it: a base for elision back there
      s.peers.insert(msg->origin);
      s.peer_holds.emplace(msg->message_id, msg->origin);
    }
    std::set<std::string>& here = s.local[msg->message_id];
    std::vector<std::string> added;
    for (const std::string& agent : recipients) {
      RecipientResult r;
      r.agent = agent;
      if (here.count(agent) || std::find(added.begin(), added.end(), agent) != added.end()) {
        r.duplicate = true;
      } else {
        auto mb = s.mailboxes.find(agent);
        const uint64_t held = mb == s.mailboxes.end() ? 0 : mb->second.bytes;
        if (held + msg->bytes > limits_.max_mailbox_bytes) {
          r.status = absl::ResourceExhaustedError(absl::StrCat(
              "mailbox of '", agent, "' in session '", msg->session_id, "': ", held, " bytes unacked + ",
              msg->bytes, " bytes of this message, expected at most --max-mailbox-bytes=",
              limits_.max_mailbox_bytes));
        } else {
          added.push_back(agent);
        }
      }
      result.recipients.push_back(std::move(r));
    }
    if (hook && (!result.duplicate || !added.empty())) hook(msg, added);
    for (const std::string& agent : added) AddToMailboxLocked(s, msg, agent, &wakes);
    PublishGaugesLocked();
    result.msg = std::move(msg);
  }
  for (WakeFn& w : wakes) w(Wake::kMessage);
  return result;
}

bool MemoryStore::IsClosed(const std::string& session) const {
  MutexLock lock(&mu_);
  return closed_.count(session) > 0;
}

absl::Status MemoryStore::ReserveOutbox(const std::string& target, uint64_t bytes) {
  MutexLock lock(&mu_);
  uint64_t& dest = outbox_bytes_[target];
  if (dest + bytes > limits_.max_outbox_bytes_per_destination) {
    const uint64_t held = dest;
    if (held == 0) outbox_bytes_.erase(target);
    return absl::ResourceExhaustedError(absl::StrCat(
        "outbox to '", target, "': ", held, " bytes waiting + ", bytes, " bytes of this message, expected at most "
        "--max-outbox-bytes-per-destination=", limits_.max_outbox_bytes_per_destination,
        AloneOver(bytes, limits_.max_outbox_bytes_per_destination)));
  }
  if (outbox_total_ + bytes > limits_.max_outbox_bytes) {
    if (dest == 0) outbox_bytes_.erase(target);
    return absl::ResourceExhaustedError(absl::StrCat(
        "outbox: ", outbox_total_, " bytes waiting for all destinations + ", bytes,
        " bytes of this message, expected at most --max-outbox-bytes=", limits_.max_outbox_bytes,
        AloneOver(bytes, limits_.max_outbox_bytes)));
  }
  dest += bytes;
  outbox_total_ += bytes;
  ++outbox_messages_;
  if (metrics_) metrics_->SetOutbox(static_cast<double>(outbox_messages_), static_cast<double>(outbox_total_));
  return absl::OkStatus();
}

void MemoryStore::ReleaseOutbox(const std::string& target, uint64_t bytes) {
  MutexLock lock(&mu_);
  auto it = outbox_bytes_.find(target);
  if (it == outbox_bytes_.end()) return;
  it->second -= std::min(it->second, bytes);
  if (it->second == 0) outbox_bytes_.erase(it);
  outbox_total_ -= std::min(outbox_total_, bytes);
  if (outbox_messages_) --outbox_messages_;
  if (metrics_) metrics_->SetOutbox(static_cast<double>(outbox_messages_), static_cast<double>(outbox_total_));
}

void MemoryStore::TrackRecipient(const std::string& session, const std::string& message_id,
                                 const std::string& agent, const RecipientTrack& track) {
  MutexLock lock(&mu_);
  auto s = sessions_.find(session);
  if (s == sessions_.end()) return;
  auto& tracks = s->second.tracks[message_id];
  auto it = tracks.find(agent);
  if (it == tracks.end()) {
    tracks.emplace(agent, track);
    return;
  }
  MergeTrack(&it->second, track);
}

absl::StatusOr<Store::MessageReport> MemoryStore::MessageStatus(const std::string& session,
                                                               const std::string& message_id) const {
  MutexLock lock(&mu_);
  auto s = sessions_.find(session);
  if (s == sessions_.end()) {
    return NoSession(session);
  }
  auto m = s->second.messages.find(message_id);
  if (m == s->second.messages.end()) {
    return NoMessage(session, message_id);
  }
  const StoredMessage& msg = *m->second;
  MessageReport resp;
  resp.sender = msg.sender;
  resp.forwarded_by = msg.forwarded_by;
  auto tracks = s->second.tracks.find(message_id);
  auto here = s->second.local.find(message_id);
  // The publish's order; at a relay a message was forwarded to, its
  // recipients here (those a later forward added after them).
  std::vector<std::string> order = msg.recipients;
  if (msg.forwarded && here != s->second.local.end()) {
    for (const std::string& a : here->second) {
      if (std::find(order.begin(), order.end(), a) == order.end()) order.push_back(a);
    }
  }
  for (const std::string& agent : order) {
    RecipientReport* r = &resp.recipients.emplace_back();
    r->agent = agent;
    if (tracks != s->second.tracks.end()) {
      if (auto t = tracks->second.find(agent); t != tracks->second.end()) {
        r->state = t->second.state;
        r->relay = t->second.relay;
        r->reason = t->second.reason;
        r->attempts = t->second.attempts;
        continue;
      }
    }
    if (auto rt = msg.remote.find(agent); rt != msg.remote.end()) {
      r->state = TrackState::kQueued;
      r->relay = rt->second;
      continue;
    }
    bool in_mailbox = false;
    if (auto mb = s->second.mailboxes.find(agent); mb != s->second.mailboxes.end()) {
      for (const Entry& e : mb->second.entries) in_mailbox |= e.msg->message_id == message_id;
    }
    const bool delivered = s->second.delivered.count({message_id, agent}) > 0;
    r->state = in_mailbox ? (delivered ? TrackState::kDelivered : TrackState::kCommitted)
                          : (delivered ? TrackState::kAcked : TrackState::kUnspecified);
  }
  return resp;
}

bool MemoryStore::AddPeer(const std::string& session, const std::string& target) {
  MutexLock lock(&mu_);
  auto s = sessions_.find(session);
  if (s == sessions_.end()) return false;
  s->second.peers.insert(target);
  return true;
}

void MemoryStore::NotePeerHolds(const std::string& session, const std::string& message_id,
                                const std::string& target) {
  MutexLock lock(&mu_);
  auto s = sessions_.find(session);
  if (s == sessions_.end()) return;
  s->second.peers.insert(target);
  s->second.peer_holds.emplace(message_id, target);
}

bool MemoryStore::PeerHolds(const std::string& session, const std::string& message_id,
                            const std::string& target) const {
  MutexLock lock(&mu_);
  auto s = sessions_.find(session);
  return s != sessions_.end() && s->second.peer_holds.count({message_id, target}) > 0;
}

bool MemoryStore::IsParticipant(const std::string& session, const std::string& agent) const {
  MutexLock lock(&mu_);
  auto s = sessions_.find(session);
  if (s == sessions_.end()) return false;
  for (const auto& [id, m] : s->second.messages) {
    if (m->sender == agent || std::find(m->recipients.begin(), m->recipients.end(), agent) != m->recipients.end()) {
      return true;
    }
  }
  return false;
}

std::vector<std::string> MemoryStore::Peers(const std::string& session) const {
  MutexLock lock(&mu_);
  auto s = sessions_.find(session);
  if (s == sessions_.end()) return {};
  return std::vector<std::string>(s->second.peers.begin(), s->second.peers.end());
}

MemoryStore::State MemoryStore::Export() const {
  State st;
  MutexLock lock(&mu_);
  for (const auto& [name, s] : sessions_) {
    SessionState& out = st.sessions[name];
    for (const auto& [id, msg] : s.messages) {
      SessionState::Held h;
      h.msg = msg;
      if (auto l = s.local.find(id); l != s.local.end()) h.local = l->second;
      for (const std::string& agent : h.local) {
        bool held = false;
        if (auto mb = s.mailboxes.find(agent); mb != s.mailboxes.end()) {
          for (const Entry& e : mb->second.entries) held |= e.msg->message_id == id;
        }
        if (!held) h.acked.insert(agent);
      }
      out.messages.push_back(std::move(h));
    }
    for (const auto& [id, agent] : s.delivered) {
      for (SessionState::Held& h : out.messages) {
        if (h.msg->message_id == id) h.delivered.insert(agent);
      }
    }
    std::sort(out.messages.begin(), out.messages.end(),
              [](const SessionState::Held& a, const SessionState::Held& b) {
                return a.msg->spool_seq < b.msg->spool_seq;
              });
    out.tracks = s.tracks;
    out.peers = s.peers;
    out.peer_holds = s.peer_holds;
  }
  for (const auto& [name, at] : closed_) st.closed.push_back(name);
  return st;
}

void MemoryStore::Restore(const State& state) {
  MutexLock lock(&mu_);
  const Clock::time_point now = time_->Now();
  for (const auto& [name, in] : state.sessions) {
    Session& s = sessions_[name];
    s.last_active = now;
    for (const SessionState::Held& h : in.messages) {
      const MessagePtr& msg = h.msg;
      s.messages[msg->message_id] = msg;
      s.bytes += msg->bytes;
      store_bytes_ += msg->bytes;
      for (const std::string& agent : h.local) {
        s.local[msg->message_id].insert(agent);
        if (h.acked.count(agent)) continue;
        Mailbox& mb = s.mailboxes[agent];
        mb.entries.push_back({msg, 0});
        mb.bytes += msg->bytes;
        ++mailbox_messages_;
        mailbox_bytes_ += msg->bytes;
      }
      for (const std::string& agent : h.delivered) s.delivered.insert({msg->message_id, agent});
    }
    s.tracks = in.tracks;
    s.peers = in.peers;
    s.peer_holds = in.peer_holds;
  }
  for (const std::string& name : state.closed) {
    if (closed_.emplace(name, now).second) closed_order_.emplace_back(now, name);
  }
  PublishGaugesLocked();
}

}  // namespace kvrelay

#include "server/store/spool_store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/match.h"
#include "core/mutex.h"
#include "core/status_macros.h"
#include "proto/stream_codec.h"
#include "proto/wire.h"
#include "server/metrics/metrics.h"
#include "server/store/spool/crash_point.h"
#include "server/store/spool/spool_format.h"
#include "spdlog/spdlog.h"

namespace kvrelay {

namespace {

using Record = spool::v1::Record;

double Since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

spool::v1::MessageMeta MetaOf(const StoredMessage& m) {
  spool::v1::MessageMeta meta;
  meta.set_session_id(m.session_id);
  meta.set_message_id(m.message_id);
  meta.set_sender(m.sender);
  meta.set_role(m.role);
  meta.set_parent_id(m.parent_id);
  for (const std::string& r : m.recipients) meta.add_recipients(r);
  meta.set_requested_policy(m.requested_policy);
  if (m.layout) *meta.mutable_geometry() = ToProto(*m.layout);
  *meta.mutable_accounting() = ToProto(m.accounting);
  for (const auto& [agent, target] : m.remote) (*meta.mutable_remote())[agent] = target;
  meta.set_forwarded(m.forwarded);
  meta.set_origin(m.origin);
  meta.set_forwarded_by(m.forwarded_by);
  meta.set_family(m.family);
  return meta;
}

std::shared_ptr<StoredMessage> StoredOf(SpoolMessage sm, uint64_t seq) {
  auto m = std::make_shared<StoredMessage>();
  const spool::v1::MessageMeta& meta = sm.meta;
  m->session_id = meta.session_id();
  m->message_id = meta.message_id();
  m->sender = meta.sender();
  m->role = meta.role();
  m->parent_id = meta.parent_id();
  m->recipients.assign(meta.recipients().begin(), meta.recipients().end());
  m->requested_policy = meta.requested_policy();
  if (meta.has_geometry()) {
    // Checked again as the publish or forward checked it; a file whose
    // geometry no longer passes keeps its message, without the geometry
    // (a retry then compares against an empty one).
    absl::StatusOr<UploadShape> layout =
        CheckGeometry(meta.geometry(), "geometry", /*with_parent=*/!meta.parent_id().empty());
    if (layout.ok()) {
      m->layout = *std::move(layout);
    } else {
      spdlog::warn("spool: msg/{}.kvm session={} message={}: geometry dropped: {}", seq, meta.session_id(),
                   meta.message_id(), layout.status().ToString());
    }
  }
  m->accounting = AccountingFromProto(meta.accounting());
  m->remote.insert(meta.remote().begin(), meta.remote().end());
  m->forwarded = meta.forwarded();
  m->origin = meta.origin();
  m->forwarded_by = meta.forwarded_by();
  m->msg = std::move(sm.msg);
  m->family = meta.family().empty() ? PolicyFamily(m->msg.policy) : meta.family();
  m->bytes = RetainedBytes(m->msg);
  m->started = Clock::now();
  m->spool_seq = seq;
  return m;
}

Record AgentRecord(bool acked, const std::string& session, const std::string& id, const std::string& agent) {
  Record r;
  spool::v1::AgentEvent* e = acked ? r.mutable_acked() : r.mutable_delivered();
  e->set_session_id(session);
  e->set_message_id(id);
  e->set_agent(agent);
  return r;
}

Record SessionRecord(bool expired, const std::string& session) {
  Record r;
  (expired ? r.mutable_expired() : r.mutable_closed())->set_session_id(session);
  return r;
}

Record TrackRecord(const std::string& session, const std::string& id, const std::string& agent,
                   const Store::RecipientTrack& t) {
  Record r;
  spool::v1::Track* x = r.mutable_track();
  x->set_session_id(session);
  x->set_message_id(id);
  x->set_agent(agent);
  x->set_state(static_cast<int32_t>(t.state));
  x->set_relay(t.relay);
  x->set_reason(t.reason);
  x->set_attempts(t.attempts);
  return r;
}

Record PeerRecord(const std::string& session, const std::string& target, const std::string& id) {
  Record r;
  spool::v1::Peer* p = r.mutable_peer();
  p->set_session_id(session);
  p->set_target(target);
  p->set_message_id(id);
  return r;
}

// "0000000000000001.kvm" -> 1, temp = false; ".tmp" -> temp = true.
bool ParseFileName(const std::string& name, uint64_t* seq, bool* temp) {
  if (name.size() != 20 || name[16] != '.') return false;
  const std::string ext = name.substr(17);
  if (ext != "kvm" && ext != "tmp") return false;
  *temp = ext == "tmp";
  return absl::SimpleHexAtoi(name.substr(0, 16), seq);
}

// A message file this relay does not read: it refuses to start.
absl::Status RefuseToStart(const std::string& path, absl::string_view why) {
  return absl::FailedPreconditionError(
      absl::StrCat(path, ": ", why, "; refusing to start (use the relay that wrote it, or move the spool away)"));
}

}  // namespace

// What the journal says each session holds, replayed record by record
// (SpoolStore::Recover).
struct SpoolReplay {
  struct Held {
    uint64_t seq = 0;
    std::set<std::string> local, delivered, acked;
  };
  struct Session {
    std::map<std::string, Held> messages;
    std::map<std::string, std::map<std::string, Store::RecipientTrack>> tracks;
    std::set<std::string> peers;
    std::set<std::pair<std::string, std::string>> holds;
  };
  std::map<std::string, Session> sessions;
  std::set<std::string> closed;
  uint64_t max_seq = 0;

  Held* Find(const std::string& session, const std::string& id) {
    auto s = sessions.find(session);
    if (s == sessions.end()) return nullptr;
    auto m = s->second.messages.find(id);
    return m == s->second.messages.end() ? nullptr : &m->second;
  }
};

namespace {

SpoolReplay Replay(const std::vector<Record>& records) {
  SpoolReplay model;
  for (const Record& r : records) {
    switch (r.kind_case()) {
      case Record::kCommit: {
        const spool::v1::Commit& c = r.commit();
        model.closed.erase(c.session_id());  // a publish reopens a closed session
        SpoolReplay::Held& h = model.sessions[c.session_id()].messages[c.message_id()];
        if (h.seq == 0) h.seq = c.seq();
        h.local.insert(c.agents().begin(), c.agents().end());
        model.max_seq = std::max(model.max_seq, c.seq());
        break;
      }
      case Record::kDelivered:
        if (SpoolReplay::Held* h = model.Find(r.delivered().session_id(), r.delivered().message_id())) {
          h->delivered.insert(r.delivered().agent());
        }
        break;
      case Record::kAcked:
        if (SpoolReplay::Held* h = model.Find(r.acked().session_id(), r.acked().message_id())) {
          h->acked.insert(r.acked().agent());
        }
        break;
      case Record::kClosed:
        model.sessions.erase(r.closed().session_id());
        model.closed.insert(r.closed().session_id());
        break;
      case Record::kExpired:
        model.sessions.erase(r.expired().session_id());
        break;
      case Record::kTrack: {
        const spool::v1::Track& t = r.track();
        auto s = model.sessions.find(t.session_id());
        if (s == model.sessions.end()) break;
        Store::RecipientTrack next;
        next.state = static_cast<TrackState>(t.state());
        next.relay = t.relay();
        next.reason = t.reason();
        next.attempts = t.attempts();
        auto& tracks = s->second.tracks[t.message_id()];
        auto it = tracks.find(t.agent());
        if (it == tracks.end()) {
          tracks.emplace(t.agent(), next);
        } else {
          Store::MergeTrack(&it->second, next);
        }
        break;
      }
      case Record::kPeer: {
        auto s = model.sessions.find(r.peer().session_id());
        if (s == model.sessions.end()) break;
        s->second.peers.insert(r.peer().target());
        if (!r.peer().message_id().empty()) s->second.holds.emplace(r.peer().message_id(), r.peer().target());
        break;
      }
      case Record::KIND_NOT_SET:
        break;
    }
  }
  return model;
}

}  // namespace

SpoolStore::SpoolStore(const StoreLimits& limits, const SpoolOptions& options, Metrics* metrics, TimeSource* time)
    : options_(options),
      max_message_bytes_(limits.max_store_bytes),
      fs_(options.fs ? options.fs : PosixSpoolFs()),
      metrics_(metrics),
      msg_dir_(options.dir + "/msg"),
      mem_(std::make_unique<MemoryStore>(limits, metrics, time)) {}

SpoolStore::~SpoolStore() {
  if (journal_) journal_->StopCompaction();  // a compaction reads mem_
  mem_.reset();                              // its timer may still free a session (and record it)
  journal_.reset();                          // writes what is queued
  deleter_.reset();                          // removes what the journal freed
  if (lock_fd_ >= 0) ::close(lock_fd_);
}

absl::StatusOr<std::unique_ptr<SpoolStore>> SpoolStore::Open(const StoreLimits& limits, const SpoolOptions& options,
                                                             Metrics* metrics, TimeSource* time) {
  if (options.dir.empty()) return absl::InvalidArgumentError("--spool-dir: expected a directory");
  std::unique_ptr<SpoolStore> s(new SpoolStore(limits, options, metrics, time));
  if (absl::Status st = s->Recover(); !st.ok()) {
    return absl::Status(st.code(), absl::StrCat("--spool-dir=", options.dir, ": ", st.message()));
  }
  return s;
}

std::string SpoolStore::MessagePath(uint64_t seq, bool temp) const {
  return absl::StrFormat("%s/%016x.%s", msg_dir_, seq, temp ? "tmp" : "kvm");
}

absl::Status SpoolStore::Recover() {
  const Clock::time_point start = Clock::now();
  KVRELAY_RETURN_IF_ERROR(OpenDirectories());
  KVRELAY_ASSIGN_OR_RETURN(std::vector<Record> records, OpenJournal());
  SpoolReplay model = Replay(records);
  MemoryStore::State state;
  KVRELAY_RETURN_IF_ERROR(LoadMessageFiles(&model, &state));
  RestoreSessions(model, &state);
  // A new file never takes the name of a quarantined one.
  KVRELAY_ASSIGN_OR_RETURN(std::vector<std::string> quarantined, fs_->List(options_.dir + "/quarantine"));
  for (const std::string& name : quarantined) {
    uint64_t seq;
    bool temp;
    if (ParseFileName(name, &seq, &temp)) model.max_seq = std::max(model.max_seq, seq);
  }
  if (recovery_.orphans > 0 && options_.fsync && options_.sync_dir) KVRELAY_RETURN_IF_ERROR(fs_->SyncDir(msg_dir_));

  mem_->SetEraseListener([this](const std::string& session, bool expired) {
    if (!expired) return;  // CloseSessionAndPeers records its own
    // Under the store's lock: no publish reopens the session before its
    // files are taken.
    journal_->Append(SessionRecord(true, session), [this, seqs = TakeSessionFiles(session)](const absl::Status& s) {
      if (s.ok()) deleter_->Schedule([this, seqs] { RemoveMessageFiles(seqs); });
    });
  });
  mem_->Restore(state);
  next_seq_ = model.max_seq + 1;
  for (const auto& [session, ss] : state.sessions) recovery_.messages += ss.messages.size();
  recovery_.sessions = state.sessions.size();
  recovery_.closed = state.closed.size();
  recovery_.outbox = outbox_.size();
  recovery_.bytes = static_cast<uint64_t>(file_bytes_total_) + journal_->bytes();
  recovery_.seconds = Since(start);
  ReportRecovery();
  journal_->Start([this] { return Snapshot(); },
                  [this](const absl::Status& s) {
                    failed_ = true;
                    if (metrics_) metrics_->SetSpoolFailed(true);
                    if (on_failure_) on_failure_(s);
                  });
  return absl::OkStatus();
}

absl::Status SpoolStore::OpenDirectories() {
  KVRELAY_RETURN_IF_ERROR(fs_->CreateDir(options_.dir));
  if (!options_.fs) {
    const std::string lock = options_.dir + "/LOCK";
    lock_fd_ = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (lock_fd_ < 0) return ErrnoStatus("open", lock, errno);
    if (::flock(lock_fd_, LOCK_EX | LOCK_NB) != 0) {
      return absl::FailedPreconditionError("held by another process (flock on LOCK); one relay per spool");
    }
  }
  KVRELAY_RETURN_IF_ERROR(fs_->CreateDir(msg_dir_));
  return fs_->CreateDir(options_.dir + "/quarantine");
}

absl::StatusOr<std::vector<Record>> SpoolStore::OpenJournal() {
  // Message files without a journal: only the journal proves them
  // committed, so a missing one is not a new spool.
  bool any_message_file = false;
  {
    KVRELAY_ASSIGN_OR_RETURN(std::vector<std::string> names, fs_->List(msg_dir_));
    for (const std::string& name : names) {
      uint64_t seq;
      bool temp;
      if (ParseFileName(name, &seq, &temp) && !temp) any_message_file = true;
    }
  }
  JournalOptions jo;
  jo.sync = options_.fsync;
  jo.sync_dir = options_.sync_dir;
  jo.compact_bytes = options_.compact_bytes;
  jo.salvage = options_.salvage;
  jo.create = options_.salvage || !any_message_file;
  jo.before_repair = [this](const std::vector<Record>& intact) { return QuarantineUnproven(intact); };
  if (metrics_) jo.on_sync = [m = metrics_](double seconds) { m->ObserveSpoolFsync(seconds); };
  JournalRecovery jr;
  KVRELAY_ASSIGN_OR_RETURN(journal_, Journal::Open(fs_, options_.dir, jo, &jr));
  recovery_.torn_bytes = jr.torn_bytes;
  recovery_.torn_why = jr.torn_why;
  recovery_.salvaged = jr.salvaged;
  if (!jr.quarantined.empty() && metrics_) metrics_->AddSpoolQuarantined("journal");
  const std::string kept_as =
      jr.quarantined.empty() ? "" : absl::StrCat("; the damaged journal is kept as ", jr.quarantined);
  if (jr.salvaged) {
    spdlog::error("spool: salvaged a damaged journal ({}; {} bytes cut): kept its {} intact records, moved {} "
                  "message files they do not name to quarantine/{}; deliveries, acks and closes recorded after "
                  "the damage are lost",
                  jr.torn_why, jr.torn_bytes, jr.records.size(), recovery_.unproven, kept_as);
  } else if (jr.created && recovery_.unproven > 0) {
    spdlog::error("spool: no journal: started a new one and moved {} message files to quarantine/", recovery_.unproven);
  } else if (jr.torn_bytes > 0) {
    spdlog::warn("spool: cut {} bytes off the journal's end ({}){}{}", jr.torn_bytes, jr.torn_why, kept_as,
                 recovery_.unproven == 0
                     ? ""
                     : absl::StrCat("; moved ", recovery_.unproven,
                                    " message files no intact record names to quarantine/"));
  }
  return std::move(jr.records);
}

absl::StatusOr<std::set<uint64_t>> SpoolStore::SweepMessageDir(
    const std::map<uint64_t, std::pair<std::string, std::string>>& wanted, SpoolReplay* model) {
  KVRELAY_ASSIGN_OR_RETURN(std::vector<std::string> names, fs_->List(msg_dir_));
  std::set<uint64_t> present;
  for (const std::string& name : names) {
    uint64_t seq;
    bool temp;
    if (!ParseFileName(name, &seq, &temp)) {
      spdlog::warn("spool: {}/{}: not a spool file name, left alone", msg_dir_, name);
      continue;
    }
    model->max_seq = std::max(model->max_seq, seq);
    if (temp || !wanted.count(seq)) {
      // Written but never committed, or of a session freed since.
      if (fs_->Remove(absl::StrCat(msg_dir_, "/", name)).ok()) ++recovery_.orphans;
      continue;
    }
    present.insert(seq);
  }
  return present;
}

absl::StatusOr<std::optional<SpoolMessage>> SpoolStore::ReadMessageFile(uint64_t seq, const std::string& session,
                                                                        const std::string& id, uint64_t* size) {
  const std::string path = MessagePath(seq, false);
  KVRELAY_ASSIGN_OR_RETURN(std::string bytes, fs_->ReadFile(path));
  *size = bytes.size();
  if (absl::Status v = CheckMessageFileVersion(bytes); !v.ok()) return RefuseToStart(path, v.message());
  const Clock::time_point crc_start = Clock::now();
  const bool crc_ok = MessageFileCrcOk(bytes);
  recovery_.crc_seconds += Since(crc_start);
  absl::StatusOr<SpoolMessage> sm =
      crc_ok ? DecodeMessageFile(bytes, /*check_crc=*/false, max_message_bytes_)
             : absl::DataLossError("message file: CRC32C does not match (or the file is cut short)");
  if (absl::IsFailedPrecondition(sm.status())) return RefuseToStart(path, sm.status().message());
  if (sm.ok() && (sm->meta.session_id() != session || sm->meta.message_id() != id)) {
    sm = absl::DataLossError(absl::StrCat("message file: holds ", sm->meta.session_id(), "/", sm->meta.message_id(),
                                          ", the journal says ", session, "/", id));
  }
  if (sm.ok()) return std::optional<SpoolMessage>(std::move(*sm));
  const std::string q = absl::StrCat(options_.dir, "/quarantine/", absl::StrFormat("%016x.kvm", seq));
  absl::Status moved = fs_->Rename(path, q);
  ++recovery_.quarantined;
  if (metrics_) metrics_->AddSpoolQuarantined("message_file");
  spdlog::error("spool: message {} of session {}: {}: {}; {} and never served", id, session, path,
                std::string(sm.status().message()),
                moved.ok() ? absl::StrCat("moved to ", q) : absl::StrCat("could not move it: ", moved.message()));
  return std::optional<SpoolMessage>();
}

absl::Status SpoolStore::LoadMessageFiles(SpoolReplay* model, MemoryStore::State* state) {
  // Load the files the journal committed; remove the rest.
  std::map<uint64_t, std::pair<std::string, std::string>> wanted;  // seq -> (session, id)
  for (const auto& [session, s] : model->sessions) {
    for (const auto& [id, h] : s.messages) wanted[h.seq] = {session, id};
  }
  KVRELAY_ASSIGN_OR_RETURN(const std::set<uint64_t> present, SweepMessageDir(wanted, model));
  std::map<std::string, std::set<uint64_t>> files;
  std::map<uint64_t, uint64_t> file_sizes;
  uint64_t file_bytes = 0;
  for (const auto& [seq, key] : wanted) {
    const auto& [session, id] = key;
    SpoolReplay::Held& h = model->sessions[session].messages[id];
    if (!present.count(seq)) {
      ++recovery_.missing;
      if (metrics_) metrics_->AddSpoolQuarantined("missing");
      spdlog::error("spool: message {} of session {}: its file {} is missing; it is lost", id, session,
                    MessagePath(seq, false));
      model->sessions[session].messages.erase(id);
      continue;
    }
    uint64_t size = 0;
    KVRELAY_ASSIGN_OR_RETURN(std::optional<SpoolMessage> sm, ReadMessageFile(seq, session, id, &size));
    if (!sm) {
      model->sessions[session].messages.erase(id);
      continue;
    }
    MemoryStore::SessionState::Held out;
    out.msg = StoredOf(std::move(*sm), seq);
    out.local = h.local;
    out.delivered = h.delivered;
    for (const std::string& a : h.acked) {
      if (h.local.count(a)) out.acked.insert(a);
    }
    state->sessions[session].messages.push_back(std::move(out));
    files[session].insert(seq);
    file_sizes[seq] = size;
    file_bytes += size;
  }
  state->closed.assign(model->closed.begin(), model->closed.end());
  file_bytes_total_ = static_cast<int64_t>(file_bytes);
  MutexLock lock(&files_mu_);  // before the erase listener that reads them is installed
  files_ = std::move(files);
  file_bytes_ = std::move(file_sizes);
  return absl::OkStatus();
}

void SpoolStore::RestoreSessions(const SpoolReplay& model, MemoryStore::State* state) {
  for (auto& [session, ss] : state->sessions) {
    const SpoolReplay::Session& s = model.sessions.at(session);
    std::sort(ss.messages.begin(), ss.messages.end(),
              [](const auto& a, const auto& b) { return a.msg->spool_seq < b.msg->spool_seq; });
    for (const auto& [id, tracks] : s.tracks) {
      if (s.messages.count(id)) ss.tracks[id] = tracks;
    }
    ss.peers = s.peers;
    ss.peer_holds = s.holds;
    for (const auto& h : ss.messages) {  // a forward makes its origin a peer (CommitForward)
      if (h.msg->forwarded && !h.msg->origin.empty()) {
        ss.peers.insert(h.msg->origin);
        ss.peer_holds.emplace(h.msg->message_id, h.msg->origin);
      }
    }
    // The outbox: recipients on other relays without an answer yet.
    for (const auto& h : ss.messages) {
      const StoredMessage& m = *h.msg;
      if (m.forwarded || m.remote.empty()) continue;
      std::map<std::string, std::vector<std::string>> pending;
      auto tracks = ss.tracks.find(m.message_id);
      for (const auto& [agent, target] : m.remote) {
        if (tracks != ss.tracks.end()) {
          auto t = tracks->second.find(agent);
          if (t != tracks->second.end() && t->second.state != TrackState::kQueued) continue;
        }
        pending[target].push_back(agent);
      }
      for (auto& [target, agents] : pending) outbox_.push_back(PendingForward{h.msg, target, std::move(agents)});
    }
  }
}

void SpoolStore::ReportRecovery() {
  if (metrics_) {
    metrics_->SetSpoolRecovery(recovery_.seconds, recovery_.crc_seconds);
    metrics_->SetSpoolRecovered("messages", static_cast<double>(recovery_.messages));
    metrics_->SetSpoolRecovered("sessions", static_cast<double>(recovery_.sessions));
    metrics_->SetSpoolRecovered("closed", static_cast<double>(recovery_.closed));
    metrics_->SetSpoolRecovered("outbox", static_cast<double>(recovery_.outbox));
    metrics_->SetSpoolRecovered("orphans", static_cast<double>(recovery_.orphans));
    metrics_->SetSpoolRecovered("torn_bytes", static_cast<double>(recovery_.torn_bytes));
    metrics_->SetSpoolBytes(static_cast<double>(recovery_.bytes));
  }
  spdlog::info("spool: recovered {} in {:.3f} s (CRC32C checks {:.3f} s, eager): {} messages in {} sessions, {} "
               "closed sessions, {} forwards to resume, {} bytes; removed {} orphaned files, quarantined {} "
               "(+{} unproven), missing {}, cut {} journal bytes; fsync={}",
               options_.dir, recovery_.seconds, recovery_.crc_seconds, recovery_.messages, recovery_.sessions,
               recovery_.closed, recovery_.outbox, recovery_.bytes, recovery_.orphans, recovery_.quarantined,
               recovery_.unproven, recovery_.missing, recovery_.torn_bytes, options_.fsync ? "always" : "never");
}

absl::Status SpoolStore::QuarantineUnproven(const std::vector<Record>& intact) {
  std::set<uint64_t> named;
  for (const Record& r : intact) {
    if (r.kind_case() == Record::kCommit) named.insert(r.commit().seq());
  }
  const std::string quarantine_dir = options_.dir + "/quarantine";
  KVRELAY_ASSIGN_OR_RETURN(std::vector<std::string> names, fs_->List(msg_dir_));
  KVRELAY_ASSIGN_OR_RETURN(std::vector<std::string> held, fs_->List(quarantine_dir));
  std::set<std::string> taken(held.begin(), held.end());
  uint64_t moved = 0;
  for (const std::string& name : names) {
    uint64_t seq;
    bool temp;
    if (!ParseFileName(name, &seq, &temp) || temp || named.count(seq)) continue;
    std::string to = name;
    for (int n = 1; taken.count(to); ++n) to = absl::StrCat(name, ".", n);
    const std::string from = absl::StrCat(msg_dir_, "/", name);
    const std::string q = absl::StrCat(quarantine_dir, "/", to);
    if (absl::Status s = fs_->Rename(from, q); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("moving ", from, ", which the damaged journal may have committed, "
                                                 "to quarantine/: ", s.message(), "; the journal is left as it was"));
    }
    taken.insert(to);
    ++moved;
    spdlog::error("spool: {}: no intact journal record names it, yet its commit may have been acknowledged; moved to "
                  "{} unchanged, never served",
                  from, q);
  }
  recovery_.unproven += moved;
  if (moved == 0) return absl::OkStatus();
  if (metrics_) metrics_->AddSpoolQuarantined("unproven", static_cast<double>(moved));
  if (options_.fsync && options_.sync_dir) {
    KVRELAY_RETURN_IF_ERROR(fs_->SyncDir(quarantine_dir));
    KVRELAY_RETURN_IF_ERROR(fs_->SyncDir(msg_dir_));
  }
  return absl::OkStatus();
}

absl::Status SpoolStore::health() const { return Writable(); }

absl::Status SpoolStore::Writable() const {
  if (failed_) {
    MutexLock lock(&files_mu_);
    if (!dir_failure_.ok()) return dir_failure_;
  }
  return journal_->health();
}

uint64_t SpoolStore::SpoolBytes() const {
  return static_cast<uint64_t>(std::max<int64_t>(0, file_bytes_total_.load())) + journal_->bytes();
}

void SpoolStore::AddSpoolBytes(int64_t delta) {
  file_bytes_total_.fetch_add(delta);
  if (metrics_) metrics_->SetSpoolBytes(static_cast<double>(SpoolBytes()));
}

absl::Status SpoolStore::SyncTimed(SpoolFile* f) {
  const Clock::time_point t = Clock::now();
  absl::Status s = f->Sync();
  if (metrics_) metrics_->ObserveSpoolFsync(Since(t));
  return s;
}

absl::Status SpoolStore::CheckSpoolRoom(uint64_t bytes, absl::string_view what) const {
  const uint64_t held = SpoolBytes();
  if (!options_.max_spool_bytes || held + bytes <= options_.max_spool_bytes) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat("spool: ", held, " bytes on disk + ", bytes, " bytes of ", what,
                                                   "; expected at most --max-spool-bytes=", options_.max_spool_bytes));
}

absl::Status SpoolStore::CheckCanPublish(const std::string& session, const std::vector<std::string>& recipients,
                                         uint64_t bytes) const {
  KVRELAY_RETURN_IF_ERROR(Writable());
  // A plain file holds the message's bytes at least. A coded one may hold
  // fewer, so only a full spool is refused here; WriteTemp checks the
  // file's size once it is coded.
  if (options_.message_body == MessageBody::kPlain) {
    KVRELAY_RETURN_IF_ERROR(CheckSpoolRoom(bytes, "the message (at least)"));
  } else {
    KVRELAY_RETURN_IF_ERROR(CheckSpoolRoom(1, "a coded message file (at least)"));
  }
  return mem_->CheckCanPublish(session, recipients, bytes);
}

absl::StatusOr<uint64_t> SpoolStore::WriteTemp(const StoredMessage& m) {
  // Written tensor by tensor from the message itself: no serialized copy.
  absl::StatusOr<MessageFileWriter> w = MessageFileWriter::Make(MetaOf(m), m.msg, options_.message_body);
  if (!w.ok()) return absl::InternalError(absl::StrCat("spool: message file: ", w.status().message()));
  const uint64_t size = w->size();
  KVRELAY_RETURN_IF_ERROR(CheckSpoolRoom(size, "this message"));
  const uint64_t seq = next_seq_++;
  const std::string tmp = MessagePath(seq, true);
  absl::StatusOr<std::unique_ptr<SpoolFile>> f = fs_->NewFile(tmp);
  absl::Status s = f.status();
  if (s.ok()) s = w->WriteTo([&f](absl::string_view piece) { return (*f)->Append(piece); });
  if (s.ok() && options_.fsync) s = SyncTimed(f->get());
  if (s.ok()) s = (*f)->Close();
  if (!s.ok()) {
    if (f.ok()) f->reset();
    (void)fs_->Remove(tmp);
    return absl::Status(s.code(), absl::StrCat("spool: writing the message file: ", s.message(),
                                               "; nothing was stored"));
  }
  {
    MutexLock lock(&files_mu_);
    file_bytes_[seq] = size;
  }
  AddSpoolBytes(static_cast<int64_t>(size));
  CrashPoint("spool.message.after_temp_write");
  return seq;
}

absl::Status SpoolStore::Publish(uint64_t seq) {
  CrashPoint("spool.message.before_rename");
  if (absl::Status s = fs_->Rename(MessagePath(seq, true), MessagePath(seq, false)); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("spool: ", s.message(), "; nothing was stored"));
  }
  CrashPoint("spool.message.after_rename");
  if (!options_.fsync || !options_.sync_dir) return absl::OkStatus();
  const Clock::time_point t = Clock::now();
  absl::Status s = fs_->SyncDir(msg_dir_);
  if (metrics_) metrics_->ObserveSpoolFsync(Since(t));
  if (s.ok()) return s;
  // What the directory holds is unknown now: no more writes.
  const absl::Status f = absl::UnavailableError(absl::StrCat(
      "spool: ", s.message(), "; the spool takes no more writes until the relay restarts"));
  bool first = false;
  {
    MutexLock lock(&files_mu_);
    if (dir_failure_.ok()) {
      dir_failure_ = f;
      first = true;
    }
  }
  failed_ = true;
  if (first) {
    spdlog::error("{}", std::string(f.message()));
    if (metrics_) metrics_->SetSpoolFailed(true);
    if (on_failure_) on_failure_(f);
  }
  return f;
}

void SpoolStore::RemoveMessageFile(uint64_t seq, bool temp) {
  (void)fs_->Remove(MessagePath(seq, temp));
  uint64_t bytes = 0;
  {
    MutexLock lock(&files_mu_);
    if (auto it = file_bytes_.find(seq); it != file_bytes_.end()) {
      bytes = it->second;
      file_bytes_.erase(it);
    }
  }
  AddSpoolBytes(-static_cast<int64_t>(bytes));
}

std::set<uint64_t> SpoolStore::TakeSessionFiles(const std::string& session) {
  MutexLock lock(&files_mu_);
  auto it = files_.find(session);
  if (it == files_.end()) return {};
  std::set<uint64_t> seqs = std::move(it->second);
  files_.erase(it);
  return seqs;
}

void SpoolStore::RemoveMessageFiles(const std::set<uint64_t>& seqs) {
  for (uint64_t seq : seqs) RemoveMessageFile(seq, false);
}

std::shared_ptr<std::promise<absl::Status>> SpoolStore::Durable(spool::v1::Record r) {
  auto p = std::make_shared<std::promise<absl::Status>>();
  journal_->Append(std::move(r), [p](const absl::Status& s) { p->set_value(s); });
  return p;
}

MemoryStore::CommitHook SpoolStore::CommitHook(std::shared_ptr<std::promise<absl::Status>>* durable) {
  // Under the memory store's lock, before anyone can see the message: its
  // commit record precedes every record of a fetch or ack of it.
  return [this, durable](const MessagePtr& msg, const std::vector<std::string>& agents) {
    {
      MutexLock files_lock(&files_mu_);
      files_[msg->session_id].insert(msg->spool_seq);
    }
    *durable = Durable(CommitRecord(msg->session_id, msg->message_id, msg->spool_seq, agents));
  };
}

absl::StatusOr<Store::CommitResult> SpoolStore::Commit(std::shared_ptr<StoredMessage> m, const PublishTicket& t) {
  KVRELAY_RETURN_IF_ERROR(Writable());
  if (mem_->Find(m->session_id, m->message_id)) return mem_->Commit(std::move(m), t);  // a duplicate
  KVRELAY_ASSIGN_OR_RETURN(const uint64_t seq, WriteTemp(*m));
  m->spool_seq = seq;
  std::shared_ptr<std::promise<absl::Status>> durable;
  absl::StatusOr<CommitResult> r;
  {
    MutexLock lock(&commit_mu_);
    if (absl::Status s = Publish(seq); !s.ok()) {
      RemoveMessageFile(seq, true);
      (void)fs_->Remove(MessagePath(seq, false));
      return s;
    }
    r = mem_->CommitWithHook(m, t, CommitHook(&durable));
    if (!r.ok() || r->duplicate) {
      RemoveMessageFile(seq, false);  // never recorded: an orphan even if this unlink is lost
      return r;
    }
  }
  KVRELAY_RETURN_IF_ERROR(durable->get_future().get());
  return r;
}

absl::StatusOr<Store::ForwardCommitResult> SpoolStore::CommitForward(std::shared_ptr<StoredMessage> m,
                                                                     const std::vector<std::string>& recipients,
                                                                     const PublishTicket& t) {
  KVRELAY_RETURN_IF_ERROR(Writable());
  uint64_t seq = 0;
  if (!mem_->Find(m->session_id, m->message_id)) {
    KVRELAY_ASSIGN_OR_RETURN(seq, WriteTemp(*m));
    m->spool_seq = seq;
  }
  std::shared_ptr<std::promise<absl::Status>> durable;
  absl::StatusOr<ForwardCommitResult> r;
  {
    MutexLock lock(&commit_mu_);
    if (seq) {
      if (absl::Status s = Publish(seq); !s.ok()) {
        RemoveMessageFile(seq, true);
        (void)fs_->Remove(MessagePath(seq, false));
        return s;
      }
    }
    r = mem_->CommitForwardWithHook(m, recipients, t, CommitHook(&durable));
    if (seq && (!r.ok() || r->duplicate)) RemoveMessageFile(seq, false);
    if (!r.ok()) return r;
  }
  if (durable) KVRELAY_RETURN_IF_ERROR(durable->get_future().get());
  return r;
}

bool SpoolStore::MarkDelivered(const std::string& session, const std::string& agent, const std::string& message_id) {
  const bool first = mem_->MarkDelivered(session, agent, message_id);
  if (first) journal_->Append(AgentRecord(false, session, message_id, agent));
  return first;
}

void SpoolStore::BeforeDelivered(const std::string& session, const std::string& agent,
                                 const std::string& message_id, std::function<void(const absl::Status&)> ready) {
  if (absl::Status s = Writable(); !s.ok()) return ready(s);
  journal_->Append(AgentRecord(false, session, message_id, agent), std::move(ready));
}

absl::Status SpoolStore::Ack(const std::string& session, const std::string& agent, const std::string& message_id) {
  KVRELAY_RETURN_IF_ERROR(Writable());
  KVRELAY_RETURN_IF_ERROR(mem_->Ack(session, agent, message_id));
  return Durable(AgentRecord(true, session, message_id, agent))->get_future().get();
}

void SpoolStore::AckAsync(const std::string& session, const std::string& agent, const std::string& message_id,
                          std::function<void(const absl::Status&)> done) {
  absl::Status s = Writable();
  if (s.ok()) s = mem_->Ack(session, agent, message_id);
  if (!s.ok()) return done(s);
  journal_->Append(AgentRecord(true, session, message_id, agent), std::move(done));
}

Store::CloseResult SpoolStore::CloseSessionAndPeers(const std::string& session) {
  auto result = std::make_shared<std::promise<CloseResult>>();
  std::future<CloseResult> f = result->get_future();
  CloseSessionAndPeersAsync(session, [result](CloseResult r) { result->set_value(std::move(r)); });
  return f.get();
}

void SpoolStore::CloseSessionAndPeersAsync(const std::string& session, std::function<void(CloseResult)> done) {
  CloseResult first;
  if (first.status = Writable(); !first.status.ok()) return done(std::move(first));
  // Answered by whichever comes last: the journal's verdict, or this call
  // leaving commit_mu_ (a failed journal answers at once, inside it).
  struct Close {
    CloseResult r;
    std::function<void(CloseResult)> done;
    std::atomic<int> parties{2};
    void Arrive() {
      if (parties.fetch_sub(1, std::memory_order_acq_rel) == 1) done(std::move(r));
    }
  };
  auto op = std::make_shared<Close>();
  op->done = std::move(done);
  {
    MutexLock lock(&commit_mu_);
    op->r = mem_->CloseSessionAndPeers(session);
    // The files are taken now: a publish that reopens the session adds files
    // of its own. Not durable: the files stay (recovery removes what the
    // journal freed).
    journal_->Append(SessionRecord(false, session),
                     [this, op, freed = TakeSessionFiles(session)](const absl::Status& s) {
                       op->r.status = s;
                       if (!s.ok()) return op->Arrive();
                       // Answered once the files are gone, as a close always was.
                       deleter_->Schedule([this, op, freed] {
                         RemoveMessageFiles(freed);
                         op->Arrive();
                       });
                     });
  }
  op->Arrive();
}

void SpoolStore::TrackRecipient(const std::string& session, const std::string& message_id, const std::string& agent,
                                const RecipientTrack& track) {
  mem_->TrackRecipient(session, message_id, agent, track);
  if (!mem_->Find(session, message_id)) return;  // nothing held here to track
  if (track.state == TrackState::kDeadLettered) {
    // Reported (logged, counted) once durable.
    if (absl::Status s = Durable(TrackRecord(session, message_id, agent, track))->get_future().get(); !s.ok()) {
      spdlog::error("spool: dead letter of session={} message={} to={} not recorded: {}", session, message_id, agent,
                    std::string(s.message()));
    }
    return;
  }
  journal_->Append(TrackRecord(session, message_id, agent, track));
}

bool SpoolStore::AddPeer(const std::string& session, const std::string& target) {
  const bool added = mem_->AddPeer(session, target);
  if (added) journal_->Append(PeerRecord(session, target, ""));
  return added;
}

void SpoolStore::NotePeerHolds(const std::string& session, const std::string& message_id,
                               const std::string& target) {
  mem_->NotePeerHolds(session, message_id, target);
  journal_->Append(PeerRecord(session, target, message_id));
}

std::vector<spool::v1::Record> SpoolStore::Snapshot() const {
  const MemoryStore::State st = mem_->Export();
  std::vector<Record> out;
  for (const std::string& s : st.closed) out.push_back(SessionRecord(false, s));
  for (const auto& [session, ss] : st.sessions) {
    for (const auto& h : ss.messages) {
      const StoredMessage& m = *h.msg;
      out.push_back(CommitRecord(session, m.message_id, m.spool_seq,
                                 std::vector<std::string>(h.local.begin(), h.local.end())));
      for (const std::string& a : h.delivered) out.push_back(AgentRecord(false, session, m.message_id, a));
      for (const std::string& a : h.acked) out.push_back(AgentRecord(true, session, m.message_id, a));
    }
    for (const auto& [id, tracks] : ss.tracks) {
      for (const auto& [agent, t] : tracks) out.push_back(TrackRecord(session, id, agent, t));
    }
    for (const std::string& p : ss.peers) out.push_back(PeerRecord(session, p, ""));
    for (const auto& [id, p] : ss.peer_holds) out.push_back(PeerRecord(session, p, id));
  }
  return out;
}

}  // namespace kvrelay

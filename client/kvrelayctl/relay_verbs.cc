// The relay verbs: publish, fetch, ack, close, health, stats and status,
// each one or two calls to the running kvrelay-server at --addr.
#include <cinttypes>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "client/kvrelayctl/flags.h"
#include "client/kvrelayctl/internal/common.h"
#include "client/kvrelayctl/internal/relay.h"
#include "client/kvrelayctl/verbs.h"
#include "client/relay_client.h"
#include "core/format/safetensors.h"
#include "core/format/turn_file.h"
#include "core/message.h"
#include "core/status_macros.h"

namespace kvrelay::ctl {
namespace {

// The table of a relay verb: --addr, `rows`, then the connection flags.
VerbSpec RelayVerbSpec(std::vector<FlagSpec> rows) {
  std::vector<FlagSpec> flags = {RequiredFlag("addr", "HOST:PORT|unix:PATH", "the relay")};
  AppendFlags(&flags, std::move(rows));
  AppendFlags(&flags, ConnectFlagSpecs());
  return {"", std::move(flags)};
}

FlagSpec SessionFlag() { return RequiredFlag("session", "S", "the session"); }

std::string AccountingLine(const Accounting& a) {
  return absl::StrFormat(
      "policy=%s received_bytes=%d full_bytes=%d sent_bytes=%d ratio=%s compress_ms=%.3f commit_ms=%.3f", a.policy,
      a.received_bytes, a.full_bytes, a.sent_bytes, Ratio(a.full_bytes, a.sent_bytes), a.compress_seconds * 1e3,
      a.commit_seconds * 1e3);
}

// Writes a fetched message: the message file of docs/FORMAT.md, with the
// delivery in its metadata (message_id, session, from, role, parent_id,
// delivery_attempt and the accounting).
absl::Status WriteFetchedMessage(const FetchedMessage& m, const std::string& path) {
  std::string buf;
  KVRELAY_RETURN_IF_ERROR(WriteMessage(m.message, &buf));
  KVRELAY_ASSIGN_OR_RETURN(SafetensorsReader file, SafetensorsReader::ParseView(AsBytes(buf)));
  StMetadata meta = file.metadata();
  meta["message_id"] = m.message_id;
  meta["session"] = m.session_id;
  meta["from"] = m.sender;
  if (!m.role.empty()) meta["role"] = m.role;
  if (!m.parent_id.empty()) meta["parent_id"] = m.parent_id;
  meta["delivery_attempt"] = absl::StrCat(m.delivery_attempt);
  meta["received_bytes"] = absl::StrCat(m.accounting.received_bytes);
  meta["ratio"] = absl::StrFormat("%.6f", m.accounting.ratio);
  meta["compress_seconds"] = absl::StrFormat("%.6f", m.accounting.compress_seconds);
  meta["commit_seconds"] = absl::StrFormat("%.6f", m.accounting.commit_seconds);
  return WriteSafetensorsFile(path, file.tensors(), meta);
}

// `s` in double quotes, with backslash, double quote, newline, carriage
// return and tab escaped by a backslash: one parseable token on one line.
std::string Quoted(absl::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default: out += c;
    }
  }
  return out + "\"";
}

}  // namespace

VerbSpec PublishSpec() {
  return RelayVerbSpec({
      SessionFlag(),
      RequiredFlag("from", "AGENT", "the sending agent"),
      RepeatedFlag("to", "AGENT", "a recipient", true),
      RequiredFlag("in", "TURN.safetensors", "the turn to upload"),
      ValueFlag("id", "MSGID", "the message id; empty: the client makes one"),
      ValueFlag("policy", "SPEC", "pipeline spec; empty: the relay's default for the role"),
      ValueFlag("role", "R", "the sender's role"),
      ValueFlag("parent", "MSGID", "a message the relay delivered to --from: the relay supplies the history"),
      ValueFlag("timeout", "SECONDS", "deadline of the whole publish", "120"),
      ValueFlag("retries", "N", "retries on UNAVAILABLE/ABORTED only, with the same id", "3"),
  });
}

Outcome Publish(const Flags& flags) {
  if (Outcome f = NoPositional(flags)) return f;
  PublishOptions o;
  KVRELAYCTL_FLAG(const std::string addr, AddrFlag(flags));
  KVRELAYCTL_FLAG(o.session, flags.Required("session"));
  KVRELAYCTL_FLAG(o.sender, flags.Required("from"));
  KVRELAYCTL_FLAG(const std::string in, flags.Required("in"));
  KVRELAYCTL_FLAG(o.deadline, flags.Seconds("timeout", 0.001, 86400));
  KVRELAYCTL_FLAG(o.retries, flags.Int("retries", 0, 100));
  o.recipients = flags.GetAll("to");
  if (o.recipients.empty()) return Usage("publish: missing required flag --to");
  o.message_id = flags.Get("id").value_or("");
  o.policy = flags.Get("policy").value_or("");
  o.role = flags.Get("role").value_or("");
  o.parent_id = flags.Get("parent").value_or("");

  KVRELAYCTL_DIAL(client, flags, addr);
  TurnFileOptions read;
  read.on_parent = !o.parent_id.empty();
  absl::StatusOr<Turn> turn = ReadTurnFile(in, read);
  if (!turn.ok()) return Runtime(turn.status());
  ProgressLine line("publish");
  o.progress = line.Callback();
  // Shared, so the upload sends the tensors without copying them.
  absl::StatusOr<PublishResult> r = client->Publish(std::make_shared<const Turn>(*std::move(turn)), o);
  line.Clear();
  if (!r.ok()) return RelayError("publish", r.status());
  std::printf("message_id=%s duplicate=%s attempts=%d %s\n", r->message_id.c_str(), r->duplicate ? "true" : "false",
              r->attempts, AccountingLine(r->accounting).c_str());
  return std::nullopt;
}

VerbSpec FetchSpec() {
  return RelayVerbSpec({
      SessionFlag(),
      RequiredFlag("agent", "AGENT", "the recipient"),
      RequiredFlag("out", "MSG.safetensors", "where the message goes"),
      ValueFlag("wait", "SECONDS", "how long to wait for a complete message (the transfer included)", "30"),
      BoolFlag("no-ack", "leaves the message unacknowledged"),
  });
}

Outcome Fetch(const Flags& flags) {
  if (Outcome f = NoPositional(flags)) return f;
  FetchOptions o;
  KVRELAYCTL_FLAG(const std::string addr, AddrFlag(flags));
  KVRELAYCTL_FLAG(o.session, flags.Required("session"));
  KVRELAYCTL_FLAG(o.agent, flags.Required("agent"));
  KVRELAYCTL_FLAG(const std::string out, flags.Required("out"));
  KVRELAYCTL_FLAG(o.wait, flags.Seconds("wait", 0.001, 86400));
  const bool ack = !flags.Has("no-ack");
  KVRELAYCTL_DIAL(client, flags, addr);
  ProgressLine line("fetch");
  o.progress = line.Callback();
  absl::StatusOr<FetchedMessage> m = client->Fetch(o);
  line.Clear();
  if (!m.ok() && m.status().code() == absl::StatusCode::kDeadlineExceeded) {
    return RelayError("fetch", absl::DeadlineExceededError(absl::StrCat(
                                   "no complete message for agent '", o.agent, "' in session '", o.session,
                                   "' within ", absl::FormatDuration(absl::Milliseconds(o.wait.count())),
                                   " (--wait bounds the transfer too; ", m.status().message(), ")")));
  }
  if (!m.ok()) return RelayError("fetch", m.status());
  // Acknowledge only once the message is safely on disk.
  if (absl::Status s = WriteFetchedMessage(*m, out); !s.ok()) return Runtime(s);
  if (ack) {
    if (absl::Status s = client->Ack(o.session, o.agent, m->message_id); !s.ok()) return RelayError("ack", s);
  }
  const Message& msg = m->message;
  std::printf("message_id=%s from=%s parent=%s delivery_attempt=%u acked=%s layers=%zu "
              "history=%d anchor=%d kept=%d gen=%d next_pos=%" PRId64 " %s out=%s\n",
              m->message_id.c_str(), m->sender.c_str(), m->parent_id.empty() ? "-" : m->parent_id.c_str(),
              m->delivery_attempt, ack ? "true" : "false", msg.layers.size(), msg.n_history, msg.n_anchor,
              msg.n_kept, msg.n_gen, msg.next_pos, AccountingLine(m->accounting).c_str(), out.c_str());
  return std::nullopt;
}

VerbSpec AckSpec() {
  return RelayVerbSpec({
      SessionFlag(),
      RequiredFlag("agent", "AGENT", "the recipient"),
      RequiredFlag("id", "MSGID", "the message to acknowledge"),
  });
}

Outcome Ack(const Flags& flags) {
  if (Outcome f = NoPositional(flags)) return f;
  KVRELAYCTL_FLAG(const std::string addr, AddrFlag(flags));
  KVRELAYCTL_FLAG(const std::string session, flags.Required("session"));
  KVRELAYCTL_FLAG(const std::string agent, flags.Required("agent"));
  KVRELAYCTL_FLAG(const std::string id, flags.Required("id"));
  KVRELAYCTL_DIAL(client, flags, addr);
  if (absl::Status s = client->Ack(session, agent, id); !s.ok()) return RelayError("ack", s);
  std::printf("acked message_id=%s\n", id.c_str());
  return std::nullopt;
}

VerbSpec CloseSpec() { return RelayVerbSpec({SessionFlag()}); }

Outcome Close(const Flags& flags) {
  if (Outcome f = NoPositional(flags)) return f;
  KVRELAYCTL_FLAG(const std::string addr, AddrFlag(flags));
  KVRELAYCTL_FLAG(const std::string session, flags.Required("session"));
  KVRELAYCTL_DIAL(client, flags, addr);
  absl::StatusOr<uint32_t> n = client->CloseSession(session);
  if (!n.ok()) return RelayError("close", n.status());
  std::printf("closed session=%s messages_freed=%u\n", session.c_str(), *n);
  return std::nullopt;
}

VerbSpec HealthSpec() {
  return RelayVerbSpec({
      ValueFlag("service", "NAME", "the grpc.health.v1 service name; empty: the whole server"),
      ValueFlag("timeout", "SECONDS", "deadline of the call", "5"),
  });
}

Outcome Health(const Flags& flags) {
  if (Outcome f = NoPositional(flags)) return f;
  KVRELAYCTL_FLAG(const std::string addr, AddrFlag(flags));
  KVRELAYCTL_FLAG(const auto timeout, flags.Seconds("timeout", 0.001, 3600));
  KVRELAYCTL_DIAL(client, flags, addr);
  absl::StatusOr<HealthStatus> h = client->Health(flags.Get("service").value_or(""), timeout);
  if (!h.ok()) return RelayError("health", h.status());
  std::printf("%s\n", HealthStatusName(*h));
  if (*h != HealthStatus::kServing) return Failure{kRuntimeError, absl::StrCat("health: ", HealthStatusName(*h))};
  return std::nullopt;
}

VerbSpec StatsSpec() { return RelayVerbSpec({}); }

Outcome Stats(const Flags& flags) {
  if (Outcome f = NoPositional(flags)) return f;
  KVRELAYCTL_FLAG(const std::string addr, AddrFlag(flags));
  KVRELAYCTL_DIAL(client, flags, addr);
  absl::StatusOr<RelayStats> s = client->Stats();
  if (!s.ok()) return RelayError("stats", s.status());
  std::printf(
      "version: %s\nmessages_committed: %" PRIu64 "\nmessages_failed: %" PRIu64 "\nmessages_delivered: %" PRIu64
      "\nmessages_acked: %" PRIu64 "\nreceived_bytes: %" PRIu64 "\nfull_bytes: %" PRIu64 "\nsent_bytes: %" PRIu64
      "\nratio: %s\nsessions: %" PRIu64 "\nmailbox_messages: %" PRIu64 "\nmailbox_bytes: %" PRIu64
      "\ninflight_bytes: %" PRIu64 "\nstore_bytes: %" PRIu64 "\n",
      s->version.c_str(), s->messages_committed, s->messages_failed, s->messages_delivered, s->messages_acked,
      s->received_bytes, s->full_bytes, s->sent_bytes, Ratio(s->full_bytes, s->sent_bytes).c_str(), s->sessions,
      s->mailbox_messages, s->mailbox_bytes, s->inflight_bytes, s->store_bytes);
  return std::nullopt;
}

VerbSpec StatusSpec() {
  return RelayVerbSpec({
      SessionFlag(),
      RequiredFlag("id", "MSGID", "the message"),
      ValueFlag("timeout", "SECONDS", "deadline of the call", "10"),
  });
}

Outcome Status(const Flags& flags) {
  if (Outcome f = NoPositional(flags)) return f;
  KVRELAYCTL_FLAG(const std::string addr, AddrFlag(flags));
  KVRELAYCTL_FLAG(const std::string session, flags.Required("session"));
  KVRELAYCTL_FLAG(const std::string id, flags.Required("id"));
  KVRELAYCTL_FLAG(const auto timeout, flags.Seconds("timeout", 0.001, 3600));
  KVRELAYCTL_DIAL(client, flags, addr);
  absl::StatusOr<MessageStatusResult> m = client->MessageStatus(session, id, timeout);
  if (!m.ok()) return RelayError("status", m.status());
  if (m->forwarded_by.empty()) {
    std::printf("sender=%s\n", m->sender.c_str());
  } else {
    std::printf("sender=%s forwarded_by=%s\n", m->sender.c_str(), m->forwarded_by.c_str());
  }
  for (const RecipientStatus& r : m->recipients) {
    std::printf("agent=%s state=%s relay=%s attempts=%u reason=%s\n", r.agent.c_str(), RecipientStateName(r.state),
                r.relay.c_str(), r.attempts, Quoted(r.reason).c_str());
  }
  return std::nullopt;
}

}  // namespace kvrelay::ctl

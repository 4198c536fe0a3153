// The store, the outbox, PendingCompression on the worker pool and the route
// file under concurrent callers, each run checked against invariants:
// every committed message fetched and acked once per recipient, the
// counters reconciling, outbox reservations within their bounds and back
// to 0, tracked states never going back, route tables never going back to
// an older file. Written for ThreadSanitizer: scripts/tsan.sh builds them,
// with the store's own tests, into store_tsan_test; the normal build runs
// them as store_concurrency_test.
//
// No gRPC server or channel is started (Debian's gRPC is not instrumented):
// the only threads are the tests', the store's timer, the pool's workers
// and the route file's poller. A forward's transport is a fake that reads
// the layers as a Forward stream would. Every loop is bounded in count and
// every wait by a deadline.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/pipeline.h"
#include "core/thread_pool.h"
#include "gtest/gtest.h"
#include "proto/stream_codec.h"
#include "server/mesh/forwarder.h"
#include "server/store/memory_store.h"
#include "server/metrics/metrics.h"
#include "server/rpc/pending.h"
#include "server/mesh/routing.h"
#include "spdlog/spdlog.h"
#include "tests/server/store/store_test_util.h"
#include "tests/core/test_util.h"

namespace kvrelay {
namespace {

using namespace kvrelay::testing;
using std::chrono::milliseconds;

// How long any one wait may take before the test gives up: generous, so
// that a sanitized build on a loaded machine does not fail a correct run.
constexpr std::chrono::seconds kWaitLimit(60);

double GaugeValue(Metrics& m, const std::string& name) {
  for (const auto& fam : m.registry()->Collect()) {
    if (fam.name == name && !fam.metric.empty()) return fam.metric[0].gauge.value;
  }
  ADD_FAILURE() << "no gauge " << name;
  return -1;
}

// kvrelay_messages_total{outcome}; 0 before its first increment.
double Outcome(Metrics& m, const std::string& outcome) {
  for (const auto& fam : m.registry()->Collect()) {
    if (fam.name != "kvrelay_messages_total") continue;
    for (const auto& metric : fam.metric) {
      for (const auto& l : metric.label) {
        if (l.name == "outcome" && l.value == outcome) return metric.counter.value;
      }
    }
  }
  return 0;
}

// A Fetch as its reactor drives the store: the oldest delivery, or a
// waiter registered with a deadline `wait` ahead (so the timer thread wakes
// it at the latest) that is then waited for or cancelled. Every waiter is
// kept, to check at the end that each was woken exactly once, or cancelled
// and never woken.
class Fetcher {
 public:
  Fetcher(Store* store, std::string session, std::string agent)
      : store_(store), session_(std::move(session)), agent_(std::move(agent)) {}

  // The next delivery, or nullopt after a wake, a cancel, or (Shutdown) no
  // waiter at all.
  std::optional<Store::Delivery> Next(bool cancel, milliseconds wait = milliseconds(20)) {
    auto slot = std::make_shared<Slot>();
    uint64_t id = 0;
    std::optional<Store::Delivery> d = store_->FetchOrWait(
        session_, agent_, Clock::now() + wait,
        [slot](Store::Wake why) {
          std::lock_guard<std::mutex> lock(slot->mu);
          ++slot->wakes;
          slot->why = why;
          slot->cv.notify_all();
        },
        &id);
    if (d || id == 0) return d;
    slots_.push_back(slot);
    if (cancel && store_->CancelWaiter(id)) {
      slot->cancelled = true;
      return std::nullopt;
    }
    std::unique_lock<std::mutex> lock(slot->mu);
    EXPECT_TRUE(slot->cv.wait_for(lock, kWaitLimit, [&] { return slot->wakes > 0; }))
        << session_ << "/" << agent_ << ": a waiter was never woken";
    return std::nullopt;
  }

  // REQUIRES: every call of Next returned.
  void CheckEveryWaiterWokenOnce() const {
    for (const auto& s : slots_) {
      std::lock_guard<std::mutex> lock(s->mu);
      EXPECT_EQ(s->wakes, s->cancelled ? 0 : 1) << session_ << "/" << agent_;
    }
  }
  size_t waiters() const { return slots_.size(); }

 private:
  struct Slot {
    std::mutex mu;
    std::condition_variable cv;
    int wakes = 0;
    Store::Wake why = Store::Wake::kMessage;
    bool cancelled = false;  // written before any other thread can see it
  };
  Store* const store_;
  const std::string session_, agent_;
  std::vector<std::shared_ptr<Slot>> slots_;
};

// Publishers, a consumer per mailbox, closes, sweeps and Stats readers on
// one store at once. Two sessions are never closed: each of their messages
// reaches each recipient once, in its publisher's order, and is acked once.
// A third is closed over and over while it is published to and fetched
// from. At the end the counters reconcile: committed x recipients = acked +
// dropped by a close.
TEST(StoreConcurrencyTest, PublishersConsumersClosesAndSweepsAtOnce) {
  constexpr int kPublishers = 4, kPerPublisher = 200, kChurnMessages = 200, kCloses = 150;
  const std::vector<std::string> kSessions = {"s0", "s1"}, kAgents = {"b", "c"};
  Metrics metrics;
  MemoryStore impl(StoreLimits{}, &metrics);
  Store& s = impl;
  const Clock::time_point give_up = Clock::now() + kWaitLimit;

  std::atomic<int> stable_commits{0}, churn_commits{0}, churn_fenced{0}, mark_calls{0};
  std::vector<std::thread> threads;
  for (int p = 0; p < kPublishers; ++p) {
    threads.emplace_back([&, p] {
      const std::string& session = kSessions[p % kSessions.size()];
      for (int i = 0; i < kPerPublisher; ++i) {
        auto r = Commit(s, Msg(session, absl::StrCat("p", p, "-", i), kAgents));
        ASSERT_TRUE(r.ok()) << r.status();
        ASSERT_FALSE(r->duplicate);
        ++stable_commits;
      }
    });
  }
  // One consumer per (session, agent): everything arrives once, in order.
  const int per_session = kPerPublisher * kPublishers / static_cast<int>(kSessions.size());
  std::vector<std::unique_ptr<Fetcher>> fetchers;
  for (const std::string& session : kSessions) {
    for (const std::string& agent : kAgents) {
      fetchers.push_back(std::make_unique<Fetcher>(&s, session, agent));
      Fetcher* f = fetchers.back().get();
      threads.emplace_back([&, f, session, agent] {
        std::map<int, int> last;  // publisher -> last index seen
        std::set<std::string> seen;
        for (int n = 0; static_cast<int>(seen.size()) < per_session && Clock::now() < give_up; ++n) {
          std::optional<Store::Delivery> d = f->Next(/*cancel=*/n % 5 == 0);
          if (!d) continue;
          const std::string& id = d->msg->message_id;
          ASSERT_TRUE(seen.insert(id).second) << session << "/" << agent << ": " << id << " delivered again";
          EXPECT_EQ(d->attempt, 1u) << id;
          int p = 0, i = 0;
          ASSERT_EQ(std::sscanf(id.c_str(), "p%d-%d", &p, &i), 2) << id;
          auto it = last.find(p);
          EXPECT_TRUE(it == last.end() ? i == 0 : i == it->second + 1) << session << "/" << agent << ": " << id;
          last[p] = i;
          ++mark_calls;
          EXPECT_TRUE(s.MarkDelivered(session, agent, id)) << id;
          ASSERT_TRUE(s.Ack(session, agent, id).ok()) << id;
        }
        EXPECT_EQ(static_cast<int>(seen.size()), per_session) << session << "/" << agent;
      });
    }
  }
  // The churned session: published to, fetched from and closed at once.
  std::atomic<bool> churn_stop{false};
  threads.emplace_back([&] {
    for (int i = 0; i < kChurnMessages; ++i) {
      auto r = Commit(s, Msg("churn", absl::StrCat("c", i), {"b"}));
      if (r.ok()) {
        ++churn_commits;
      } else {
        // Fenced by a close that came between BeginPublish and Commit.
        ASSERT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
        ++churn_fenced;
      }
    }
  });
  threads.emplace_back([&] {
    for (int i = 0; i < kCloses; ++i) {
      s.CloseSession("churn");
      (void)s.IsClosed("churn");
      // Pacing, not synchronization: spreads the closes over the commits.
      std::this_thread::sleep_for(milliseconds(1));
    }
  });
  fetchers.push_back(std::make_unique<Fetcher>(&s, "churn", "b"));
  Fetcher* churn_fetcher = fetchers.back().get();
  std::thread churn_consumer([&] {
    for (int n = 0; !churn_stop.load() && Clock::now() < give_up; ++n) {
      std::optional<Store::Delivery> d = churn_fetcher->Next(/*cancel=*/n % 3 == 0);
      if (!d) continue;
      ++mark_calls;
      s.MarkDelivered("churn", "b", d->msg->message_id);  // false when closed meanwhile
      absl::Status st = s.Ack("churn", "b", d->msg->message_id);
      EXPECT_TRUE(st.ok() || st.code() == absl::StatusCode::kNotFound) << st;
    }
  });
  // Sweeps (nothing expires: the TTL is an hour) and Stats readers. What
  // holds at every instant: the mailbox counters move together, and the
  // totals never go back.
  std::atomic<bool> observers_stop{false};
  std::thread sweeper([&] {
    for (int i = 0; i < 400 && !observers_stop.load(); ++i) {
      s.SweepExpired();
      // Pacing, not synchronization: spreads the sweeps over the run.
      std::this_thread::sleep_for(milliseconds(1));
    }
  });
  std::thread stats_reader([&] {
    StoreStats prev;
    for (int i = 0; i < 2000 && !observers_stop.load(); ++i) {
      const StoreStats st = s.Stats();
      EXPECT_EQ(st.mailbox_bytes, 100 * st.mailbox_messages);
      EXPECT_LE(st.acked, st.delivered);
      EXPECT_LE(st.acked, 2 * st.committed);
      EXPECT_GE(st.committed, prev.committed);
      EXPECT_GE(st.acked, prev.acked);
      EXPECT_GE(st.delivered, prev.delivered);
      prev = st;
      std::this_thread::yield();
    }
  });
  for (auto& t : threads) t.join();
  churn_stop = true;
  churn_consumer.join();
  observers_stop = true;
  sweeper.join();
  stats_reader.join();

  EXPECT_EQ(stable_commits.load(), kPublishers * kPerPublisher);
  EXPECT_EQ(churn_commits.load() + churn_fenced.load(), kChurnMessages);
  StoreStats st = s.Stats();
  EXPECT_EQ(st.committed, static_cast<uint64_t>(stable_commits + churn_commits));
  EXPECT_EQ(st.delivered, static_cast<uint64_t>(mark_calls.load()));
  const uint64_t stable_deliveries = 2ull * kPublishers * kPerPublisher;
  EXPECT_GE(st.acked, stable_deliveries);
  EXPECT_LE(st.acked, stable_deliveries + churn_commits);
  for (const std::string& session : kSessions) EXPECT_EQ(s.CloseSession(session), static_cast<uint32_t>(per_session));
  s.CloseSession("churn");
  st = s.Stats();
  EXPECT_EQ(st.sessions, 0u);
  EXPECT_EQ(st.mailbox_messages, 0u);
  EXPECT_EQ(st.mailbox_bytes, 0u);
  EXPECT_EQ(st.store_bytes, 0u);
  EXPECT_EQ(st.inflight_bytes, 0u);
  // Every delivery of a committed message was acked or dropped by a close.
  EXPECT_EQ(Outcome(metrics, "acked"), static_cast<double>(st.acked));
  EXPECT_EQ(Outcome(metrics, "acked") + Outcome(metrics, "closed"),
            static_cast<double>(stable_deliveries + churn_commits));
  EXPECT_EQ(GaugeValue(metrics, "kvrelay_mailbox_messages"), 0.0);
  EXPECT_EQ(GaugeValue(metrics, "kvrelay_store_bytes"), 0.0);
  // Whatever still waits is woken by Shutdown; then every waiter was woken
  // exactly once or cancelled.
  s.Shutdown();
  size_t waiters = 0;
  for (const auto& f : fetchers) {
    f->CheckEveryWaiterWokenOnce();
    waiters += f->waiters();
  }
  EXPECT_GT(waiters, 0u);
}

// Outbox reservations and releases from many threads, as forwards (and
// their retries, which keep their reservation) come and go: what is held
// never exceeds the bounds, and once everything is released the outbox is
// empty again, its gauges too.
TEST(StoreConcurrencyTest, OutboxReservationsStayInBoundsAndReturnToZero) {
  constexpr uint64_t kPerDestination = 3000, kTotal = 7000;
  constexpr int kThreads = 6, kJobs = 300, kTargets = 4;
  StoreLimits lim;
  lim.max_outbox_bytes = kTotal;
  lim.max_outbox_bytes_per_destination = kPerDestination;
  Metrics metrics;
  MemoryStore impl(lim, &metrics);
  Store& s = impl;
  auto target = [](int t) { return absl::StrCat("relay-", t, ":1"); };
  // Held as the test sees it: raised after a reservation, lowered before
  // its release, so never above what the store holds.
  std::atomic<uint64_t> held[kTargets] = {}, held_total{0};
  std::atomic<int> granted{0}, refused{0};
  std::vector<std::thread> threads;
  for (int th = 0; th < kThreads; ++th) {
    threads.emplace_back([&, th] {
      std::mt19937 rng(th);
      struct Job {
        int target;
        uint64_t bytes;
        int attempts_left;  // retries before the forward ends
      };
      std::vector<Job> jobs;
      auto release = [&](const Job& j) {
        held[j.target] -= j.bytes;
        held_total -= j.bytes;
        s.ReleaseOutbox(target(j.target), j.bytes);
      };
      for (int i = 0; i < kJobs; ++i) {
        Job j{static_cast<int>(rng() % kTargets), 1 + rng() % 1500, static_cast<int>(rng() % 4)};
        absl::Status st = s.ReserveOutbox(target(j.target), j.bytes);
        if (st.ok()) {
          ++granted;
          EXPECT_LE(held[j.target] += j.bytes, kPerDestination);
          EXPECT_LE(held_total += j.bytes, kTotal);
          jobs.push_back(j);
        } else {
          ++refused;
          ASSERT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
          EXPECT_TRUE(absl::StrContains(st.message(), "--max-outbox-bytes")) << st;
        }
        // One attempt of every forward held; those out of attempts end.
        for (auto it = jobs.begin(); it != jobs.end();) {
          if (it->attempts_left-- == 0) {
            release(*it);
            it = jobs.erase(it);
          } else {
            ++it;
          }
        }
      }
      for (const Job& j : jobs) release(j);
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(granted + refused, kThreads * kJobs);
  EXPECT_GT(granted.load(), 0);
  EXPECT_EQ(GaugeValue(metrics, "kvrelay_outbox_bytes"), 0.0);
  EXPECT_EQ(GaugeValue(metrics, "kvrelay_outbox_messages"), 0.0);
  // Empty indeed: the bounds admit exactly their sizes again.
  ASSERT_TRUE(s.ReserveOutbox(target(0), kPerDestination).ok());
  ASSERT_TRUE(s.ReserveOutbox(target(1), kPerDestination).ok());
  EXPECT_EQ(s.ReserveOutbox(target(1), 1).code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(s.ReserveOutbox(target(2), kTotal - 2 * kPerDestination).ok());
  EXPECT_EQ(s.ReserveOutbox(target(3), 1).code(), absl::StatusCode::kResourceExhausted);
  s.ReleaseOutbox(target(0), kPerDestination);
  s.ReleaseOutbox(target(1), kPerDestination);
  s.ReleaseOutbox(target(2), kTotal - 2 * kPerDestination);
  EXPECT_EQ(GaugeValue(metrics, "kvrelay_outbox_bytes"), 0.0);
}

int Rank(TrackState s) {
  switch (s) {
    case TrackState::kQueued: return 1;
    case TrackState::kCommitted: return 2;
    case TrackState::kDelivered: return 3;
    case TrackState::kAcked: return 4;
    default: return 0;
  }
}

// Forward attempts and reports move remote recipients' tracked states
// while a local recipient fetches and acks, and MessageStatus is read all
// along: no reader ever sees a state go back, a dead letter replace
// anything but queued, a dead letter end, or attempts decrease.
TEST(StoreConcurrencyTest, TrackedStatesNeverGoBackUnderConcurrentReaders) {
  constexpr int kRemote = 4, kWritersPerAgent = 2, kWrites = 150, kReaders = 3, kReads = 300;
  MemoryStore impl(StoreLimits{}, nullptr);
  Store& s = impl;
  auto m = Msg("s", "m", {"b"});
  for (int r = 0; r < kRemote; ++r) {
    const std::string agent = absl::StrCat("r", r);
    m->recipients.push_back(agent);
    m->remote[agent] = absl::StrCat("relay-", r, ":1");
  }
  ASSERT_TRUE(Commit(s, m).ok());

  std::vector<std::thread> threads;
  for (int r = 0; r < kRemote; ++r) {
    for (int w = 0; w < kWritersPerAgent; ++w) {
      threads.emplace_back([&s, r, w] {
        std::mt19937 rng(r * 16 + w);
        for (int i = 0; i < kWrites; ++i) {
          Store::RecipientTrack t;
          t.relay = absl::StrCat("relay-", r, ":1");
          t.attempts = static_cast<uint32_t>(i / 4);
          switch (rng() % 16) {
            case 0: t.state = TrackState::kDeadLettered; t.reason = "DEADLINE_EXCEEDED: gave up"; break;
            case 1: case 2: t.state = TrackState::kCommitted; break;
            case 3: t.state = TrackState::kDelivered; break;
            case 4: t.state = TrackState::kAcked; break;
            default: t.state = TrackState::kQueued; t.reason = "UNAVAILABLE: retrying"; break;
          }
          s.TrackRecipient("s", "m", absl::StrCat("r", r), t);
        }
      });
    }
  }
  threads.emplace_back([&s] {
    const Clock::time_point give_up = Clock::now() + kWaitLimit;
    std::optional<Store::Delivery> d;
    while (!(d = TryFetch(s, "s", "b")) && Clock::now() < give_up) std::this_thread::yield();
    ASSERT_TRUE(d);
    ASSERT_TRUE(s.Ack("s", "b", "m").ok());
  });
  for (int rd = 0; rd < kReaders; ++rd) {
    threads.emplace_back([&s] {
      std::map<std::string, Store::RecipientReport> prev;
      for (int i = 0; i < kReads; ++i) {
        absl::StatusOr<Store::MessageReport> resp = s.MessageStatus("s", "m");
        ASSERT_TRUE(resp.ok()) << resp.status();
        ASSERT_EQ(resp->recipients.size(), 1 + kRemote);
        for (const Store::RecipientReport& now : resp->recipients) {
          const bool local = now.agent == "b";
          EXPECT_NE(now.state, TrackState::kUnspecified) << now.agent;
          if (local) {
            EXPECT_NE(now.state, TrackState::kQueued);
            EXPECT_NE(now.state, TrackState::kDeadLettered);
          } else {
            EXPECT_EQ(now.relay, absl::StrCat("relay-", now.agent.substr(1), ":1"));
          }
          auto p = prev.find(now.agent);
          if (p != prev.end()) {
            const Store::RecipientReport& was = p->second;
            EXPECT_GE(now.attempts, was.attempts) << now.agent;
            if (was.state == TrackState::kDeadLettered) {
              EXPECT_EQ(now.state, TrackState::kDeadLettered) << now.agent << ": a dead letter is final";
            } else if (now.state == TrackState::kDeadLettered) {
              EXPECT_EQ(was.state, TrackState::kQueued) << now.agent << ": dead-lettered after "
                                                                 << TrackStateName(was.state);
            } else {
              EXPECT_GE(Rank(now.state), Rank(was.state))
                  << now.agent << ": " << TrackStateName(was.state) << " -> "
                  << TrackStateName(now.state);
            }
          }
          prev[now.agent] = now;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  absl::StatusOr<Store::MessageReport> resp = s.MessageStatus("s", "m");
  ASSERT_TRUE(resp.ok()) << resp.status();
  EXPECT_EQ(resp->recipients[0].state, TrackState::kAcked);
}

// The wire bytes of one layer in delivery order.
std::string WireBytes(const std::vector<TensorRef>& refs) {
  std::string out;
  for (const TensorRef& r : refs) out.append(reinterpret_cast<const char*>(r.data.data()), r.data.size());
  return out;
}

// A forward's transport, faked: one attempt reads every layer as it
// appears (what a Forward stream would send) and then waits for the
// publish's outcome. Returns the layers' bytes, or nullopt when the
// publish failed before all were there.
std::optional<std::vector<std::string>> FakeForwardAttempt(ForwardSource& src, MessagePtr* outcome) {
  const Clock::time_point deadline = Clock::now() + kWaitLimit;
  std::vector<std::string> layers;
  for (int l = 0; l < src.layers(); ++l) {
    ForwardSource::LayerView v;
    if (!src.WaitLayer(l, &v, deadline)) {
      *outcome = src.WaitOutcome(deadline);
      return std::nullopt;
    }
    layers.push_back(WireBytes(v.wire));
  }
  *outcome = src.WaitOutcome(deadline);
  return layers;
}

// Uploads compressed on one worker pool at once, as publishes with
// forwards run them: the reader submits layers under backpressure (at most
// kBound unfinished), every finished layer goes to the outbox's source,
// and fake forward attempts (a first one during the upload, a retry after
// the commit) read it. One upload is cancelled half way. The committed
// messages equal an offline compression bit for bit, the forwards read
// exactly those bytes, the bound held, and every in-flight reservation came
// back.
TEST(PendingConcurrencyTest, UploadsUnderBackpressureAndCancelFeedTheirForwards) {
  constexpr int kUploads = 3, kBound = 2, kCancelled = 2;
  auto pipeline = Pipeline::Create("h2o-head:k=16+int4:group=32");
  ASSERT_TRUE(pipeline.ok()) << pipeline.status();
  std::shared_ptr<const Pipeline> p = std::move(*pipeline);
  MemoryStore store(StoreLimits{}, nullptr);
  auto pool = std::make_unique<ThreadPool>(2);
  TurnShape shape;
  shape.layers = 6;
  shape.head_dim = 32;
  shape.n_prompt = 48;
  shape.dtype = DType::kBF16;

  std::vector<std::thread> uploads;
  for (int u = 0; u < kUploads; ++u) {
    uploads.emplace_back([&, u] {
      const Turn turn = RandomTurn(shape, 1000 + u);
      absl::StatusOr<Message> offline = p->Compress(turn);
      ASSERT_TRUE(offline.ok()) << offline.status();
      absl::StatusOr<TurnGeometry> geo = GeometryOf(turn);
      ASSERT_TRUE(geo.ok()) << geo.status();
      UploadShape us;
      us.layers = shape.layers;
      us.geo = *geo;
      us.first_agent = turn.first_agent;
      const uint64_t reserved = 4096;
      ASSERT_TRUE(store.ReserveInflight(reserved, "upload").ok());
      auto pending = std::make_shared<PendingCompression>(p, us, nullptr, turn.PromptPos0(), pool.get(), &store, reserved);
      auto source = std::make_shared<ForwardSource>(shape.layers, nullptr);
      std::weak_ptr<ForwardSource> weak = source;
      pending->ObserveLayers([weak](int l, const MessageLayer& layer) {
        if (auto src = weak.lock()) src->SetLayer(l, layer);
      });
      source->AddOwner(pending);

      std::optional<std::vector<std::string>> first_read;
      MessagePtr first_outcome;
      std::thread first_attempt([&] { first_read = FakeForwardAttempt(*source, &first_outcome); });
      // On a failed assertion below: end the attempt before the thread goes.
      struct Joiner {
        std::thread& t;
        ForwardSource& src;
        ~Joiner() {
          if (!t.joinable()) return;
          src.Resolve(nullptr);
          t.join();
        }
      } joiner{first_attempt, *source};

      // The reader: submits, and stops reading while kBound layers are unfinished.
      struct Gate {
        std::mutex mu;
        std::condition_variable cv;
        bool open = true;
      };
      auto gate = std::make_shared<Gate>();
      for (int l = 0; l < shape.layers; ++l) {
        if (u == kCancelled && l == shape.layers / 2) pending->Cancel();
        pending->Submit(l, turn.layers[l]);
        {
          std::lock_guard<std::mutex> lock(gate->mu);
          gate->open = false;
        }
        const bool paused = pending->PauseIfBusy(kBound, [gate] {
          std::lock_guard<std::mutex> lock(gate->mu);
          gate->open = true;
          gate->cv.notify_all();
        });
        if (paused) {
          std::unique_lock<std::mutex> lock(gate->mu);
          ASSERT_TRUE(gate->cv.wait_for(lock, kWaitLimit, [&] { return gate->open; })) << "never resumed";
        }
      }
      struct Done {
        std::mutex mu;
        std::condition_variable cv;
        int calls = 0;
      };
      auto done = std::make_shared<Done>();
      pending->WhenDone([done] {
        std::lock_guard<std::mutex> lock(done->mu);
        ++done->calls;
        done->cv.notify_all();
      });
      {
        std::unique_lock<std::mutex> lock(done->mu);
        ASSERT_TRUE(done->cv.wait_for(lock, kWaitLimit, [&] { return done->calls > 0; }));
      }
      EXPECT_LE(pending->max_outstanding(), kBound);

      const absl::Status st = pending->status();
      MessagePtr committed;
      if (u == kCancelled) {
        EXPECT_EQ(st.code(), absl::StatusCode::kCancelled) << st;
        source->Resolve(nullptr);
      } else {
        ASSERT_TRUE(st.ok()) << st;
        auto m = std::make_shared<StoredMessage>();
        m->session_id = absl::StrCat("u", u);
        m->message_id = "m";
        m->sender = "a";
        m->recipients = {"b"};
        m->msg = pending->TakeMessage();
        source->AddOwner(m);  // the layers' buffers moved into m
        m->bytes = RetainedBytes(m->msg);
        auto r = Commit(store, m);
        ASSERT_TRUE(r.ok()) << r.status();
        committed = r->msg;
        source->Resolve(committed);
      }
      first_attempt.join();
      pending.reset();  // the source (or the message) holds it now

      if (u == kCancelled) {
        EXPECT_FALSE(first_read.has_value());
        EXPECT_EQ(first_outcome, nullptr);
      } else {
        // The message as committed equals the offline compression, and every
        // attempt (the first during the upload, a retry after it) read it.
        ASSERT_EQ(committed->msg.layers.size(), offline->layers.size());
        std::vector<std::string> want;
        for (size_t l = 0; l < offline->layers.size(); ++l) {
          // A forward carries the acc too.
          want.push_back(WireBytes(LayerDeliveryOrder(offline->layers[l], static_cast<uint32_t>(l), true)));
          EXPECT_EQ(WireBytes(LayerDeliveryOrder(committed->msg.layers[l], static_cast<uint32_t>(l), true)), want[l])
              << "layer " << l;
        }
        EXPECT_EQ(committed->msg.sent_bytes, offline->sent_bytes);
        EXPECT_EQ(first_outcome, committed);
        ASSERT_TRUE(first_read.has_value());
        EXPECT_TRUE(*first_read == want) << "the first attempt read other bytes";
        MessagePtr retry_outcome;
        std::optional<std::vector<std::string>> retry = FakeForwardAttempt(*source, &retry_outcome);
        ASSERT_TRUE(retry.has_value());
        EXPECT_TRUE(*retry == want) << "the retry read other bytes";
        EXPECT_EQ(retry_outcome, committed);
        EXPECT_EQ(store.CloseSession(absl::StrCat("u", u)), 1u);
      }
      {
        std::lock_guard<std::mutex> lock(done->mu);
        EXPECT_EQ(done->calls, 1);
      }
    });
  }
  for (auto& t : uploads) t.join();
  // A worker may hold a compression a moment after its last layer: the
  // pool's threads end first. Then every upload's reservation is back.
  pool.reset();
  EXPECT_EQ(store.inflight_bytes(), 0u);
}

// Route file reloads (the poller every millisecond, and ReloadNow from
// other threads) while the file is replaced by rename, now and then with a
// bad content, and readers resolve: a reader never sees an older file's
// table after a newer one, and the last file wins.
TEST(RouteConcurrencyTest, ReloadsWhileResolvingNeverGoBack) {
  constexpr int kVersions = 100, kReloaders = 2, kReaders = 3;
  spdlog::set_level(spdlog::level::err);  // a reload is logged at info, a bad file at warn
  // The pid keeps two builds' runs at once (this one and store_tsan_test) apart.
  const std::string path = absl::StrCat(::testing::TempDir(), "kvrelay_route_concurrency_", getpid(), ".json");
  auto write = [&path](const std::string& content) {
    const std::string tmp = path + ".tmp";
    {
      std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
      ASSERT_TRUE(out) << tmp;
      out << content;
    }
    ASSERT_EQ(std::rename(tmp.c_str(), path.c_str()), 0) << tmp;
  };
  auto table_of = [](int v) {
    return absl::StrCat("{\"b\": \"relay-", v, ":1\", \"c\": \"relay-", v, ":1\"}");
  };
  write(table_of(0));
  RouteOptions o;
  o.route_file = path;
  o.poll_interval = milliseconds(1);
  auto created = RouteTable::Create(o);
  ASSERT_TRUE(created.ok()) << created.status();
  const RouteTable& table = **created;
  RouteTable* mutable_table = created->get();

  std::atomic<bool> writing{true};
  std::vector<std::thread> threads;
  threads.emplace_back([&] {
    for (int v = 1; v <= kVersions; ++v) {
      if (v % 10 == 0) write("{\"b\": ");  // a bad file keeps the last good table
      write(table_of(v));
      // Pacing, not synchronization: lets the reloads and polls see each
      // version of the file.
      std::this_thread::sleep_for(milliseconds(1));
    }
    writing = false;
  });
  for (int r = 0; r < kReloaders; ++r) {
    threads.emplace_back([&] {
      for (int i = 0; i < 2000 && writing.load(); ++i) {
        absl::Status st = mutable_table->ReloadNow();
        EXPECT_TRUE(st.ok() || st.code() == absl::StatusCode::kInvalidArgument) << st;
      }
    });
  }
  for (int r = 0; r < kReaders; ++r) {
    threads.emplace_back([&] {
      int last = 0;
      uint64_t loads = 0;
      for (int i = 0; i < 3000 && writing.load(); ++i) {
        for (const char* agent : {"b", "c"}) {
          absl::StatusOr<std::optional<std::string>> got = table.Resolve(agent);
          ASSERT_TRUE(got.ok()) << got.status();
          ASSERT_TRUE(got->has_value()) << agent;
          int v = -1;
          ASSERT_EQ(std::sscanf((*got)->c_str(), "relay-%d:1", &v), 1) << **got;
          EXPECT_GE(v, last) << agent << ": the table went back";
          last = v;
        }
        const uint64_t n = table.file_loads();
        EXPECT_GE(n, loads);
        loads = n;
      }
    });
  }
  for (auto& t : threads) t.join();
  ASSERT_TRUE(mutable_table->ReloadNow().ok());
  absl::StatusOr<std::optional<std::string>> last = table.Resolve("b");
  ASSERT_TRUE(last.ok() && last->has_value());
  EXPECT_EQ(**last, absl::StrCat("relay-", kVersions, ":1"));
  created->reset();  // stops the poller before the file goes
  std::remove(path.c_str());
  spdlog::set_level(spdlog::level::info);
}

}  // namespace
}  // namespace kvrelay

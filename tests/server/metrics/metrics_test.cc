#include "server/metrics/metrics.h"

#include <map>
#include <set>
#include <string>

#include "gtest/gtest.h"
#include "prometheus/text_serializer.h"

namespace kvrelay {
namespace {

const prometheus::MetricFamily* Family(const std::vector<prometheus::MetricFamily>& fams, const std::string& name) {
  for (const auto& f : fams) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

// {label value: counter value} of a family with one label `label`.
std::map<std::string, double> ByLabel(Metrics& m, const std::string& name, const std::string& label) {
  std::map<std::string, double> out;
  const auto fams = m.registry()->Collect();
  const prometheus::MetricFamily* f = Family(fams, name);
  EXPECT_NE(f, nullptr) << name;
  if (f == nullptr) return out;
  for (const auto& metric : f->metric) {
    EXPECT_EQ(metric.label.size(), 1u) << name;
    for (const auto& l : metric.label) {
      EXPECT_EQ(l.name, label) << name;
      out[l.value] = metric.counter.value;
    }
  }
  return out;
}

double Unlabelled(Metrics& m, const std::string& name) {
  const auto fams = m.registry()->Collect();
  const prometheus::MetricFamily* f = Family(fams, name);
  EXPECT_NE(f, nullptr) << name;
  if (f == nullptr || f->metric.size() != 1) {
    ADD_FAILURE() << name << ": expected one unlabelled series";
    return -1;
  }
  EXPECT_TRUE(f->metric[0].label.empty()) << name;
  return f->type == prometheus::MetricType::Gauge ? f->metric[0].gauge.value : f->metric[0].counter.value;
}

TEST(MetricsTest, ForwardSeriesExistAtZeroFromTheStart) {
  Metrics m;
  for (const char* name : {"kvrelay_forward_bytes_total", "kvrelay_forward_full_bytes_total",
                           "kvrelay_forward_elided_bytes_total", "kvrelay_outbox_messages", "kvrelay_outbox_bytes"}) {
    EXPECT_EQ(Unlabelled(m, name), 0.0) << name;
  }
  const std::map<std::string, double> outcomes = {
      {"committed", 0}, {"duplicate", 0}, {"retry", 0}, {"whole", 0}, {"dead_letter", 0}};
  EXPECT_EQ(ByLabel(m, "kvrelay_forwards_total", "outcome"), outcomes);
  const std::map<std::string, double> received = {{"committed", 0}, {"duplicate", 0}, {"refused", 0}};
  EXPECT_EQ(ByLabel(m, "kvrelay_forwards_received_total", "outcome"), received);
  const std::map<std::string, double> codes = {
      {"INVALID_ARGUMENT", 0}, {"ALREADY_EXISTS", 0},     {"FAILED_PRECONDITION", 0}, {"PERMISSION_DENIED", 0},
      {"DEADLINE_EXCEEDED", 0}, {"UNAVAILABLE", 0}, {"RESOURCE_EXHAUSTED", 0},  {"NOT_FOUND", 0}};
  EXPECT_EQ(ByLabel(m, "kvrelay_dead_letters_total", "code"), codes);

  const auto fams = m.registry()->Collect();
  const prometheus::MetricFamily* h = Family(fams, "kvrelay_forward_seconds");
  ASSERT_NE(h, nullptr);
  ASSERT_EQ(h->metric.size(), 1u);
  EXPECT_EQ(h->metric[0].histogram.sample_count, 0u);
  const auto& buckets = h->metric[0].histogram.bucket;
  ASSERT_GE(buckets.size(), 3u);
  EXPECT_EQ(buckets.front().upper_bound, 0.001);
  // The last finite bound covers --forward-timeout-seconds' default (300).
  EXPECT_EQ(buckets[buckets.size() - 2].upper_bound, 300.0);

  // The exposition names each family with its type.
  const std::string text = prometheus::TextSerializer().Serialize(fams);
  for (const char* line : {"# TYPE kvrelay_forward_bytes_total counter", "# TYPE kvrelay_forward_full_bytes_total counter",
                           "# TYPE kvrelay_forward_elided_bytes_total counter", "# TYPE kvrelay_forwards_total counter",
                           "# TYPE kvrelay_forward_seconds histogram", "# TYPE kvrelay_outbox_messages gauge",
                           "# TYPE kvrelay_outbox_bytes gauge", "# TYPE kvrelay_dead_letters_total counter",
                           "# TYPE kvrelay_forwards_received_total counter"}) {
    EXPECT_NE(text.find(line), std::string::npos) << line;
  }
  // (kvrelay_auth_failures_total's reason "peer_not_allowed" is a value, not a label.)
  EXPECT_EQ(text.find("peer="), std::string::npos) << "no series carries a peer label";
  EXPECT_EQ(text.find("target="), std::string::npos) << "no series carries a peer's target";
}

TEST(MetricsTest, ForwardMethodsMoveTheirSeries) {
  Metrics m;
  m.AddForwardBytes(1000);
  m.AddForwardBytes(24);
  m.AddWireBytes("h2o-head", 300);
  m.AddWireBytes("h2o-head", 10);
  m.AddForwardFull(4096);
  m.AddForwardElided(512);
  m.AddForwardOutcome("retry");
  m.AddForwardOutcome("committed");
  m.AddForwardOutcome("committed");
  m.ObserveForward(0.02);
  m.ObserveForward(200);
  m.SetOutbox(3, 777);
  m.AddDeadLetter(grpc::StatusCode::ALREADY_EXISTS);
  m.AddDeadLetter(grpc::StatusCode::ABORTED);  // an undeclared code gets its own series
  m.AddForwardReceived("refused");

  EXPECT_EQ(Unlabelled(m, "kvrelay_forward_bytes_total"), 1024.0);
  EXPECT_EQ(ByLabel(m, "kvrelay_wire_bytes_total", "family"), (std::map<std::string, double>{{"h2o-head", 310}}));
  EXPECT_EQ(Unlabelled(m, "kvrelay_forward_full_bytes_total"), 4096.0);
  EXPECT_EQ(Unlabelled(m, "kvrelay_forward_elided_bytes_total"), 512.0);
  EXPECT_EQ(Unlabelled(m, "kvrelay_outbox_messages"), 3.0);
  EXPECT_EQ(Unlabelled(m, "kvrelay_outbox_bytes"), 777.0);
  m.SetOutbox(0, 0);
  EXPECT_EQ(Unlabelled(m, "kvrelay_outbox_bytes"), 0.0);

  auto outcomes = ByLabel(m, "kvrelay_forwards_total", "outcome");
  EXPECT_EQ(outcomes["committed"], 2.0);
  EXPECT_EQ(outcomes["retry"], 1.0);
  EXPECT_EQ(outcomes["dead_letter"], 0.0);
  auto codes = ByLabel(m, "kvrelay_dead_letters_total", "code");
  EXPECT_EQ(codes["ALREADY_EXISTS"], 1.0);
  EXPECT_EQ(codes["ABORTED"], 1.0);
  EXPECT_EQ(codes["UNAVAILABLE"], 0.0);
  auto received = ByLabel(m, "kvrelay_forwards_received_total", "outcome");
  EXPECT_EQ(received["refused"], 1.0);
  EXPECT_EQ(received["committed"], 0.0);

  const auto fams = m.registry()->Collect();
  const prometheus::MetricFamily* h = Family(fams, "kvrelay_forward_seconds");
  ASSERT_NE(h, nullptr);
  EXPECT_EQ(h->metric[0].histogram.sample_count, 2u);
  EXPECT_DOUBLE_EQ(h->metric[0].histogram.sample_sum, 200.02);
  // Cumulative: 0.02 s is in the 0.025 bucket, 200 s only from the 300 one.
  for (const auto& b : h->metric[0].histogram.bucket) {
    if (b.upper_bound == 0.025) { EXPECT_EQ(b.cumulative_count, 1u); }
    if (b.upper_bound == 120) { EXPECT_EQ(b.cumulative_count, 1u); }
    if (b.upper_bound == 300) { EXPECT_EQ(b.cumulative_count, 2u); }
  }
}

}  // namespace
}  // namespace kvrelay

#include "server/store/store.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "proto/stream_codec.h"

namespace kvrelay {

// TrackState's values are the wire's: the RPCs convert with a cast.
static_assert(static_cast<int>(TrackState::kUnspecified) == v1::RECIPIENT_STATE_UNSPECIFIED &&
              static_cast<int>(TrackState::kQueued) == v1::RECIPIENT_STATE_QUEUED &&
              static_cast<int>(TrackState::kCommitted) == v1::RECIPIENT_STATE_COMMITTED &&
              static_cast<int>(TrackState::kDelivered) == v1::RECIPIENT_STATE_DELIVERED &&
              static_cast<int>(TrackState::kAcked) == v1::RECIPIENT_STATE_ACKED &&
              static_cast<int>(TrackState::kDeadLettered) == v1::RECIPIENT_STATE_DEAD_LETTERED);

const char* TrackStateName(TrackState s) {
  switch (s) {
    case TrackState::kUnspecified: return "unspecified";
    case TrackState::kQueued: return "queued";
    case TrackState::kCommitted: return "committed";
    case TrackState::kDelivered: return "delivered";
    case TrackState::kAcked: return "acked";
    case TrackState::kDeadLettered: return "dead_lettered";
  }
  return "?";
}

bool MaySee(const StoredMessage& m, absl::string_view agent) {
  return m.sender == agent || std::find(m.recipients.begin(), m.recipients.end(), agent) != m.recipients.end();
}

absl::Status NotVisibleError(absl::string_view field, absl::string_view session, absl::string_view message_id,
                             absl::string_view agent) {
  return absl::NotFoundError(absl::StrCat(field, ": no message '", message_id, "' visible to agent \"", agent,
                                          "\" in session '", session, "'"));
}

uint64_t RetainedBytes(uint64_t tensor_bytes, uint64_t layers) {
  return tensor_bytes + kMessageOverheadBytes + kLayerOverheadBytes * layers;
}

void Outbox::MergeTrack(RecipientTrack* cur, const RecipientTrack& track) {
  if (cur->state == TrackState::kDeadLettered) return;
  // The destination committed it (and may have reported it delivered or
  // acked): a sender giving up later, its answer lost, does not undo that.
  if (track.state == TrackState::kDeadLettered && cur->state > TrackState::kQueued) return;
  if (track.state == TrackState::kDeadLettered || track.state >= cur->state) {
    const uint32_t attempts = std::max(cur->attempts, track.attempts);
    const std::string relay = track.relay.empty() ? cur->relay : track.relay;
    *cur = track;
    cur->attempts = attempts;
    cur->relay = relay;
  }
}

}  // namespace kvrelay

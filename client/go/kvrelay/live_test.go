package kvrelay

// Tests against a live relay: they run only when KVRELAY_LIVE_ADDR names
// one (tests/client/go/test_go_client.py starts a kvrelay-server and runs
// each with go test -run), and skip otherwise.

import (
	"context"
	"encoding/binary"
	"fmt"
	"math/rand"
	"os"
	"regexp"
	"sort"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
)

// liveClient dials $KVRELAY_LIVE_ADDR, or skips the test.
func liveClient(t *testing.T) (*Client, context.Context) {
	t.Helper()
	addr := os.Getenv("KVRELAY_LIVE_ADDR")
	if addr == "" {
		t.Skip("KVRELAY_LIVE_ADDR not set: no live relay")
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	c, err := Dial(ctx, addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c, ctx
}

// liveSession is a session id of its own for each run.
func liveSession(name string) string { return "go-live-" + name + "-" + NewMessageID()[2:10] }

const (
	liveLayers, liveKV, liveScore, liveDim = 2, 2, 4, 16
)

// randomTurn is an F32 turn (2 layers, 2 KV heads, 4 score heads, head_dim
// 16) with random K/V and scores, and an uploaded history at positions
// 0..nHistory-1 in every head when nHistory > 0.
func randomTurn(seed int64, nPrompt, nGen, nHistory int) *Turn {
	rng := rand.New(rand.NewSource(seed))
	normal := func(n int) []byte {
		xs := make([]float32, n)
		for i := range xs {
			xs[i] = float32(rng.NormFloat64())
		}
		return f32Bytes(xs...)
	}
	uniform := func(n int) []byte {
		xs := make([]float32, n)
		for i := range xs {
			xs[i] = rng.Float32()
		}
		return f32Bytes(xs...)
	}
	t := &Turn{DType: "F32", KVHeads: liveKV, ScoreHeads: liveScore, HeadDim: liveDim, NPrompt: nPrompt, NGen: nGen,
		NHistory: nHistory, FirstAgent: nHistory == 0}
	kv := liveKV * liveDim
	for l := 0; l < liveLayers; l++ {
		layer := TurnLayer{PromptK: normal(kv * nPrompt), PromptV: normal(kv * nPrompt), GenK: normal(kv * nGen),
			GenV: normal(kv * nGen), PromptScore: uniform(liveScore * nPrompt)}
		if nHistory > 0 {
			layer.HistoryK, layer.HistoryV = normal(kv*nHistory), normal(kv*nHistory)
			for h := 0; h < liveKV; h++ {
				for i := 0; i < nHistory; i++ {
					layer.HistoryPos = binary.LittleEndian.AppendUint32(layer.HistoryPos, uint32(i))
				}
			}
		}
		t.Layers = append(t.Layers, layer)
	}
	return t
}

// randomQueryTurn is randomTurn with random queries (F32 gen.q) instead of
// scores.
func randomQueryTurn(seed int64, nPrompt, nGen int) *Turn {
	t := randomTurn(seed, nPrompt, nGen, 0)
	rng := rand.New(rand.NewSource(seed + 1000))
	t.QueryDType = "F32"
	for l := range t.Layers {
		xs := make([]float32, liveScore*nGen*liveDim)
		for i := range xs {
			xs[i] = float32(rng.NormFloat64())
		}
		t.Layers[l].PromptScore, t.Layers[l].GenQ = nil, f32Bytes(xs...)
	}
	return t
}

// massOn is a history.score [liveScore, n]: 100 on the columns cols[h] of
// the score heads reading KV head h (GQA), 0 elsewhere: those tokens
// outweigh any prompt token's score.
func massOn(n int, cols [][]int) []byte {
	xs := make([]float32, liveScore*n)
	group := liveScore / liveKV
	for q := 0; q < liveScore; q++ {
		for _, c := range cols[q/group] {
			xs[q*n+c] = 100
		}
	}
	return f32Bytes(xs...)
}

// positions is each layer's and head's position ids of a delivered message.
func positions(t *testing.T, m *Message) [][][]int32 {
	t.Helper()
	n := int(m.Header.GetNHistory() + m.Header.GetNAnchor() + m.Header.GetNKept() + m.Header.GetNGen())
	out := make([][][]int32, m.Header.GetLayers())
	for _, x := range m.Tensors {
		if !strings.HasSuffix(x.Name, ".pos") {
			continue
		}
		for h := 0; h < int(m.Header.GetKvHeads()); h++ {
			row := make([]int32, n)
			for i := range row {
				row[i] = int32(binary.LittleEndian.Uint32(x.Data[4*(h*n+i):]))
			}
			out[x.Layer] = append(out[x.Layer], row)
		}
	}
	return out
}

// historySets is, per layer and head, the sorted position ids of the
// message's history part.
func historySets(t *testing.T, m *Message) [][]string {
	var out [][]string
	for _, layer := range positions(t, m) {
		var heads []string
		for _, row := range layer {
			ids := append([]int32(nil), row[:m.Header.GetNHistory()]...)
			sort.Slice(ids, func(i, j int) bool { return ids[i] < ids[j] })
			heads = append(heads, fmt.Sprint(ids))
		}
		out = append(out, heads)
	}
	return out
}

func publishFetch(t *testing.T, c *Client, ctx context.Context, turn *Turn, o PublishOptions) (*PublishResult, *Message) {
	t.Helper()
	r, err := c.Publish(ctx, turn, o)
	if err != nil {
		t.Fatalf("publish: %v", err)
	}
	m, err := c.Fetch(ctx, o.SessionID, o.Recipients[0], true)
	if err != nil {
		t.Fatalf("fetch: %v", err)
	}
	if m.Header.GetMessageId() != r.MessageID {
		t.Fatalf("fetched %s, published %s", m.Header.GetMessageId(), r.MessageID)
	}
	return r, m
}

// A turn with queries gets the fidelity figure in the publish's accounting,
// the delivered header's and Compress's; a turn with scores gets none.
func TestLiveAttentionError(t *testing.T) {
	c, ctx := liveClient(t)
	s := liveSession("attention-error")
	q := randomQueryTurn(60, 12, 4)
	r, m := publishFetch(t, c, ctx, q, PublishOptions{SessionID: s, Sender: "planner", Recipients: []string{"critic"},
		Policy: "h2o-head:k=2"})
	e, ok := AttentionError(r.Accounting)
	if !ok || !(e > 0) {
		t.Fatalf("publish of a turn with queries: attention_error %v, %v, want a figure > 0 (k=2 of 12 changes the output)",
			e, ok)
	}
	if got, ok := AttentionError(m.Header.GetAccounting()); !ok || got != e {
		t.Errorf("delivered header: attention_error %v, %v, want %v", got, ok, e)
	}
	cm, err := c.Compress(ctx, q, "h2o-head:k=2")
	if err != nil {
		t.Fatal(err)
	}
	if got, ok := AttentionError(cm.Header.GetAccounting()); !ok || got != e {
		t.Errorf("compress: attention_error %v, %v, want %v", got, ok, e)
	}
	r, m = publishFetch(t, c, ctx, randomTurn(61, 12, 4, 0), PublishOptions{SessionID: s, Sender: "planner",
		Recipients: []string{"critic"}, Policy: "h2o-head:k=2"})
	if r.Accounting.AttentionError != nil || m.Header.GetAccounting().AttentionError != nil {
		t.Errorf("a turn with scores: attention_error %v (publish), %v (delivered), want none",
			r.Accounting.AttentionError, m.Header.GetAccounting().AttentionError)
	}
}

// The chain's anchors of an uploaded history travel in the geometry: a
// history budget keeps them in every head. An anchor the history does not
// hold is the relay's INVALID_ARGUMENT, naming history_anchors.
func TestLiveHistoryAnchors(t *testing.T) {
	c, ctx := liveClient(t)
	s := liveSession("anchors")
	turn := randomTurn(70, 12, 3, 12)
	pos0 := int64(30) // history ids 0..11; 20 is one it does not hold
	turn.HistoryAnchors, turn.PromptPos0 = []int32{3, 7}, &pos0
	o := PublishOptions{SessionID: s, Sender: "planner", Recipients: []string{"critic"}, Policy: "h2o-head:k=4,hist=2"}
	_, m := publishFetch(t, c, ctx, turn, o)
	if m.Header.GetNHistory() != 4 || fmt.Sprint(m.Header.GetAnchorPos()) != "[3 7]" {
		t.Fatalf("n_history %d, anchor_pos %v, want 4 (2 anchors + hist=2) and [3 7]",
			m.Header.GetNHistory(), m.Header.GetAnchorPos())
	}
	for l, layer := range positions(t, m) {
		for h, row := range layer {
			held := map[int32]bool{}
			for _, p := range row[:4] {
				held[p] = true
			}
			if !held[3] || !held[7] {
				t.Errorf("layer.%d head %d: history %v, want anchors 3 and 7 in it", l, h, row[:4])
			}
		}
	}
	turn.HistoryAnchors = []int32{3, 20}
	_, err := c.Publish(ctx, turn, o)
	if Code(err) != codes.InvalidArgument || !regexp.MustCompile(`history_anchors.*\b20\b`).MatchString(err.Error()) {
		t.Errorf("an anchor the history does not hold: %v, want INVALID_ARGUMENT naming history_anchors and 20", err)
	}
}

// NEEDS a relay that accepts PART_HISTORY_SCORE. The agent's mass on
// history tokens 9 and 11 makes them the two that hist=2 keeps besides the
// anchors.
func TestLiveHistoryScoreUploaded(t *testing.T) {
	c, ctx := liveClient(t)
	turn := randomTurn(80, 10, 3, 12)
	turn.HistoryAnchors = []int32{0, 2}
	for l := range turn.Layers {
		turn.Layers[l].HistoryScore = massOn(12, [][]int{{9, 11}, {9, 11}})
	}
	_, m := publishFetch(t, c, ctx, turn, PublishOptions{SessionID: liveSession("history-score"), Sender: "planner",
		Recipients: []string{"critic"}, Policy: "h2o-head:k=4,hist=2"})
	if m.Header.GetNHistory() != 4 {
		t.Fatalf("n_history %d, want 4", m.Header.GetNHistory())
	}
	for l, heads := range historySets(t, m) {
		for h, got := range heads {
			if got != "[0 2 9 11]" {
				t.Errorf("layer.%d head %d: history %s, want [0 2 9 11]", l, h, got)
			}
		}
	}
}

// NEEDS a relay that accepts PART_HISTORY_SCORE. With a parent the
// history is the parent message: the history.score's columns are its
// tokens per head, in its order. Mass on each head's last two tokens (the
// parent's generated ones, of no importance otherwise) makes hist=2 keep
// them besides the chain's anchors; without the mass it keeps others.
func TestLiveHistoryScoreWithParent(t *testing.T) {
	c, ctx := liveClient(t)
	s := liveSession("parent-score")
	_, parent := publishFetch(t, c, ctx, randomTurn(90, 12, 3, 0), PublishOptions{SessionID: s, Sender: "planner",
		Recipients: []string{"critic"}, Policy: "h2o-head:k=4"})
	h := parent.Header
	n := int(h.GetNHistory() + h.GetNAnchor() + h.GetNKept() + h.GetNGen())
	if fmt.Sprint(h.GetAnchorPos()) != "[0 1 2 3]" {
		t.Fatalf("parent anchor_pos %v, want [0 1 2 3]", h.GetAnchorPos())
	}
	pos := positions(t, parent)
	child := func(withScore bool) *Message {
		turn := randomTurn(91, 10, 2, 0)
		if withScore {
			turn.HistoryScoreTokens = n
			for l := range turn.Layers {
				turn.Layers[l].HistoryScore = massOn(n, [][]int{{n - 2, n - 1}, {n - 2, n - 1}})
			}
		}
		_, m := publishFetch(t, c, ctx, turn, PublishOptions{SessionID: s, Sender: "critic",
			Recipients: []string{"judge"}, Policy: "h2o-head:k=4,hist=2", ParentID: h.GetMessageId()})
		return m
	}
	m := child(true)
	if m.Header.GetNHistory() != 6 || m.Header.GetParentId() != h.GetMessageId() {
		t.Fatalf("n_history %d (want 4 anchors + hist=2), parent %q", m.Header.GetNHistory(), m.Header.GetParentId())
	}
	got := historySets(t, m)
	for l := range got {
		for hd := range got[l] {
			ids := []int32{0, 1, 2, 3, pos[l][hd][n-2], pos[l][hd][n-1]}
			sort.Slice(ids, func(i, j int) bool { return ids[i] < ids[j] })
			if want := fmt.Sprint(ids); got[l][hd] != want {
				t.Errorf("layer.%d head %d: history %s, want %s", l, hd, got[l][hd], want)
			}
		}
	}
	if plain := historySets(t, child(false)); fmt.Sprint(plain) == fmt.Sprint(got) {
		t.Errorf("without the history.score the same history %v: the score changed nothing", plain)
	}
	// Columns other than the parent's tokens per head: the parent does not fit.
	wide := randomTurn(92, 10, 2, 0)
	wide.HistoryScoreTokens = n + 1
	for l := range wide.Layers {
		wide.Layers[l].HistoryScore = massOn(n+1, [][]int{{0}, {0}})
	}
	_, err := c.Publish(ctx, wide, PublishOptions{SessionID: s, Sender: "critic", Recipients: []string{"judge"},
		Policy: "h2o-head:k=4,hist=2", ParentID: h.GetMessageId()})
	if Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), fmt.Sprintf("history_score_tokens: %d", n+1)) {
		t.Errorf("%d columns on a parent of %d tokens per head: %v, want FAILED_PRECONDITION naming "+
			"history_score_tokens", n+1, n, err)
	}
}

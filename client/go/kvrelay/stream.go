package kvrelay

import (
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"math"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/kvrelay/kvrelay/client/go/kvrelay/v1"
)

// castagnoli is the CRC32C table (hardware-accelerated where the CPU has it).
var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// Turn is one agent turn: per layer the prompt and generated K/V, the
// attention input and optionally history (docs/FORMAT.md, "Turn"). Tensors
// are little-endian, row-major bytes: K/V in DType ("F32", "F16" or "BF16"
// bit patterns) of shape [KVHeads, n, HeadDim], history positions I32
// [KVHeads, NHistory]. The attention input is the same in every layer:
// with QueryDType "" the scores (PromptScore, F32 [ScoreHeads, NPrompt],
// the attention mass on each prompt token), else the generated steps'
// post-RoPE queries (GenQ, [ScoreHeads, NGen, HeadDim] in QueryDType), from
// which the relay computes the scores. With PromptScore a turn may also
// carry HistoryScore (this agent's attention mass on the history's tokens)
// and, with an uploaded history, HistoryAnchors.
type Turn struct {
	DType      string
	KVHeads    int
	ScoreHeads int
	HeadDim    int
	NPrompt    int
	NGen       int
	NHistory   int
	// FirstAgent: the turn opens the chain and keeps its anchors (attention
	// sinks). Set it for a first agent's turn: Go's zero value is false
	// (ReadTurnFile and C++ default to true, Python and Node to "no
	// uploaded history").
	FirstAgent bool
	// PromptPos0: position id of the first prompt token; nil: NHistory, or
	// with PublishOptions.ParentID where the parent's turn ended.
	PromptPos0 *int64
	// QueryDType: "" when every layer carries PromptScore; "F32" or DType
	// when every layer carries GenQ instead (in that dtype) and no
	// PromptScore. ScoreHeads is then GenQ's first dimension.
	QueryDType string
	// SoftmaxScale: the attention's logit scale for the scores from GenQ
	// (finite, > 0, checked on every turn); nil: 1/sqrt(HeadDim). The relay
	// ignores it on a turn with PromptScore.
	SoftmaxScale *float64
	// HistoryAnchors: position ids of the chain's anchors that the uploaded
	// history holds (a fetched message's Header.AnchorPos), ascending. Every
	// head of every layer's history must hold each once (the relay checks),
	// and a history budget (hist=) never drops them. Only with NHistory > 0;
	// with PublishOptions.ParentID the relay takes the parent's.
	HistoryAnchors []int32
	// HistoryScoreTokens: the columns of every layer's HistoryScore, the
	// history's tokens per head: NHistory for an uploaded history (0 means
	// that when the layers carry HistoryScore), or with
	// PublishOptions.ParentID the parent message's (its header's NHistory +
	// NAnchor + NKept + NGen), which must then be given.
	HistoryScoreTokens int
	Layers             []TurnLayer
}

// TurnLayer holds one layer's tensors: exactly one of PromptScore and GenQ
// (Turn.QueryDType says which; the other nil), the History* ones only when
// NHistory > 0. HistoryScore (optional, in every layer or none, only with
// PromptScore) is this agent's attention mass on each history token, F32
// [ScoreHeads, HistoryScoreTokens], finite and >= 0, in the history's
// token order per KV head (GQA: score head q reads KV head
// q / (ScoreHeads / KVHeads)); it adds to the tokens' accumulated
// importance, of which a history budget keeps the top.
type TurnLayer struct {
	PromptK, PromptV, GenK, GenV, PromptScore []byte
	HistoryK, HistoryV, HistoryPos            []byte
	GenQ                                      []byte
	HistoryScore                              []byte
}

// Tensor is one delivered tensor, named as in the message file format
// ("layer.0.k", "layer.3.v.codes", ...).
type Tensor struct {
	Name  string
	Layer uint32
	Part  pb.Part
	DType string // safetensors dtype: F32, F16, BF16, I32 or U8
	Shape []int
	Data  []byte // little-endian
}

// Message is a delivered message: its header (ids, token counts,
// quantization, accounting) and its tensors in delivery order. Quantized
// messages stay packed (k.codes, k.scale, k.zero, v.codes, ...).
type Message struct {
	Header  *pb.MessageHeader
	Tensors []Tensor
}

// NextPos is the position id where the receiver's own tokens start: where
// the relayed turn ended (Header.NextPos), also when its last tokens were
// evicted, and at least 1 + every position id held (all a relay before
// that header field tells).
func (m *Message) NextPos() int64 {
	next := m.Header.GetNextPos()
	for _, t := range m.Tensors {
		if t.Part != pb.Part_PART_POS {
			continue
		}
		for i := 0; i+4 <= len(t.Data); i += 4 {
			p := int64(int32(binary.LittleEndian.Uint32(t.Data[i:])))
			if p+1 > next {
				next = p + 1
			}
		}
	}
	return next
}

var dtypeSize = map[string]int{"F32": 4, "F16": 2, "BF16": 2, "I32": 4, "U8": 1}

var protoDType = map[string]pb.DType{"F32": pb.DType_DTYPE_F32, "F16": pb.DType_DTYPE_F16, "BF16": pb.DType_DTYPE_BF16}

// invalidf is the status of an argument the caller passed that cannot be
// sent: InvalidArgument, before any call.
func invalidf(format string, args ...interface{}) error {
	return status.Errorf(codes.InvalidArgument, format, args...)
}

// corruptf is the status of a delivery that does not assemble (out of
// order, a chunk missing, a bad size, a header that describes no valid
// message, a CRC32C or trailer mismatch, ...): DataLoss, for the relay sent
// damaged data and the caller did nothing wrong.
func corruptf(format string, args ...interface{}) error {
	return status.Errorf(codes.DataLoss, format, args...)
}

type uploadTensor struct {
	layer uint32
	part  pb.Part
	data  []byte
}

// planUpload checks every tensor's length against the turn's geometry and
// lists the tensors in upload order (relay.proto, "Tensor order").
func planUpload(t *Turn) (*pb.TurnGeometry, []uploadTensor, error) {
	if t == nil || len(t.Layers) == 0 {
		return nil, nil, invalidf("turn.layers: empty, expected at least one layer")
	}
	dtype, ok := protoDType[t.DType]
	if !ok {
		return nil, nil, invalidf("turn.dtype: %q, expected F32, F16 or BF16", t.DType)
	}
	for _, f := range []struct {
		name string
		v    int
	}{{"kv_heads", t.KVHeads}, {"score_heads", t.ScoreHeads}, {"head_dim", t.HeadDim},
		{"n_prompt", t.NPrompt}, {"n_gen", t.NGen}, {"n_history", t.NHistory}} {
		if f.v < 0 || f.v > math.MaxUint32 {
			return nil, nil, invalidf("turn.%s: %d, expected 0..2^32-1", f.name, f.v)
		}
	}
	qdtype, err := queryDType(t)
	if err != nil {
		return nil, nil, err
	}
	if s := t.SoftmaxScale; s != nil && !(*s >= 1e-6 && *s <= 1e3) {
		return nil, nil, invalidf("turn.softmax_scale: %v, expected a finite number in [1e-06, 1000] or nil (1/sqrt(head_dim))", *s)
	}
	if err := checkAnchors(t); err != nil {
		return nil, nil, err
	}
	historyScore, err := historyScoreTokens(t, qdtype)
	if err != nil {
		return nil, nil, err
	}
	kv := dtypeSize[t.DType] * t.KVHeads * t.HeadDim
	type partData struct {
		part pb.Part
		name string
		data []byte
		want int
	}
	var tensors []uploadTensor
	for l := range t.Layers {
		layer := &t.Layers[l]
		attention := partData{pb.Part_PART_PROMPT_SCORE, "prompt.score", layer.PromptScore, 4 * t.ScoreHeads * t.NPrompt}
		if qdtype != "" {
			attention = partData{pb.Part_PART_GEN_Q, "gen.q", layer.GenQ, dtypeSize[qdtype] * t.ScoreHeads * t.NGen * t.HeadDim}
		}
		if attention.data == nil && attention.want > 0 {
			if qdtype == "" {
				return nil, nil, invalidf("layer.%d.prompt.score: missing, expected it or layer.%d.gen.q (the queries)", l, l)
			}
			return nil, nil, invalidf("layer.%d.gen.q: missing, expected %d bytes like layer.0 (every layer carries the same one)",
				l, attention.want)
		}
		parts := []partData{
			{pb.Part_PART_PROMPT_K, "prompt.k", layer.PromptK, kv * t.NPrompt},
			{pb.Part_PART_PROMPT_V, "prompt.v", layer.PromptV, kv * t.NPrompt},
			{pb.Part_PART_GEN_K, "gen.k", layer.GenK, kv * t.NGen},
			{pb.Part_PART_GEN_V, "gen.v", layer.GenV, kv * t.NGen},
			attention,
		}
		if historyScore > 0 {
			parts = append(parts, partData{pb.Part_PART_HISTORY_SCORE, "history.score", layer.HistoryScore,
				4 * t.ScoreHeads * historyScore})
		}
		if t.NHistory > 0 {
			parts = append(parts, []partData{
				{pb.Part_PART_HISTORY_K, "history.k", layer.HistoryK, kv * t.NHistory},
				{pb.Part_PART_HISTORY_V, "history.v", layer.HistoryV, kv * t.NHistory},
				{pb.Part_PART_HISTORY_POS, "history.pos", layer.HistoryPos, 4 * t.KVHeads * t.NHistory},
			}...)
		}
		for _, p := range parts {
			if len(p.data) != p.want {
				return nil, nil, invalidf("layer.%d.%s: %d bytes, expected %d", l, p.name, len(p.data), p.want)
			}
			tensors = append(tensors, uploadTensor{layer: uint32(l), part: p.part, data: p.data})
		}
	}
	g := &pb.TurnGeometry{
		Layers: uint32(len(t.Layers)), KvHeads: uint32(t.KVHeads), ScoreHeads: uint32(t.ScoreHeads),
		HeadDim: uint32(t.HeadDim), Dtype: dtype, NPrompt: uint32(t.NPrompt), NGen: uint32(t.NGen),
		NHistory: uint32(t.NHistory), FirstAgent: t.FirstAgent, PromptPos0: t.PromptPos0,
	}
	if qdtype != "" {
		g.QueryDtype = protoDType[qdtype]
	}
	if t.SoftmaxScale != nil {
		scale := *t.SoftmaxScale
		g.SoftmaxScale = &scale
	}
	if len(t.HistoryAnchors) > 0 {
		g.HistoryAnchors = append([]int32(nil), t.HistoryAnchors...)
	}
	g.HistoryScoreTokens = uint32(historyScore)
	return g, tensors, nil
}

// checkAnchors checks t.HistoryAnchors: ascending distinct ids >= 0, at
// most NHistory of them, none without history. Whether every head holds
// each is the relay's to check.
func checkAnchors(t *Turn) error {
	for i, a := range t.HistoryAnchors {
		if a < 0 || (i > 0 && a <= t.HistoryAnchors[i-1]) {
			return invalidf("turn.history_anchors[%d]: %d, expected ascending distinct position ids >= 0", i, a)
		}
	}
	switch n := len(t.HistoryAnchors); {
	case n > 0 && t.NHistory == 0:
		return invalidf("turn.history_anchors: %d position ids, expected none for a turn without history "+
			"(with parent_id the relay takes the parent's anchors)", n)
	case n > t.NHistory:
		return invalidf("turn.history_anchors: %d position ids, expected at most n_history = %d", n, t.NHistory)
	}
	return nil
}

// historyScoreTokens is the columns of the layers' HistoryScore, 0 when
// they carry none: t.HistoryScoreTokens, or NHistory when that is 0. It
// checks that every layer or none carries one, never with queries, and
// that an uploaded history's score covers NHistory tokens; without
// uploaded history the columns are the parent's tokens per head, which
// only the relay can check.
func historyScoreTokens(t *Turn, qdtype string) (int, error) {
	n, given, missing := t.HistoryScoreTokens, -1, -1
	for l := range t.Layers {
		if t.Layers[l].HistoryScore != nil {
			if given < 0 {
				given = l
			}
		} else if missing < 0 {
			missing = l
		}
	}
	switch {
	case n < 0 || n > math.MaxUint32:
		return 0, invalidf("turn.history_score_tokens: %d, expected 0..2^32-1", n)
	case given < 0 && n != 0:
		return 0, invalidf("turn.history_score_tokens: %d, expected 0 (no layer carries a history.score)", n)
	case given < 0:
		return 0, nil
	case missing >= 0:
		return 0, invalidf("layer.%d.history.score: missing, expected it in every layer or in none (layer.%d has one)",
			missing, given)
	case qdtype != "":
		return 0, invalidf("layer.0.history.score: given with layer.0.gen.q, expected none " +
			"(the relay computes the mass on the history from the queries)")
	case n == 0 && t.NHistory == 0:
		return 0, invalidf("turn.history_score_tokens: 0, expected the parent's tokens per head (its header's " +
			"n_history + n_anchor + n_kept + n_gen) for a history.score without uploaded history")
	case n == 0:
		return t.NHistory, nil
	case t.NHistory > 0 && n != t.NHistory:
		return 0, invalidf("turn.history_score_tokens: %d, expected n_history = %d (the uploaded history's tokens)",
			n, t.NHistory)
	}
	return n, nil
}

// checkHistoryScoreHasHistory refuses a history.score without any history:
// none uploaded and no parent (parent says whether the call has one).
func checkHistoryScoreHasHistory(g *pb.TurnGeometry, parent bool) error {
	if g.GetHistoryScoreTokens() > 0 && g.GetNHistory() == 0 && !parent {
		return invalidf("layer.0.history.score: [%d, %d] given without history, expected none (upload the history, "+
			"or publish with parent_id: its columns are then the parent's tokens per head)",
			g.GetScoreHeads(), g.GetHistoryScoreTokens())
	}
	return nil
}

// queryDType is the dtype of the layers' GenQ ("F32" or the K/V dtype), or
// "" when they carry PromptScore, as t.QueryDType says; it checks that every
// layer carries exactly one of the two, the same one as layer 0.
func queryDType(t *Turn) (string, error) {
	queries := t.QueryDType != ""
	for l := range t.Layers {
		score, q := t.Layers[l].PromptScore != nil, t.Layers[l].GenQ != nil
		switch {
		case score && q:
			return "", invalidf("layer.%d.gen.q: given together with layer.%d.prompt.score, expected exactly one of the two", l, l)
		case queries && score:
			return "", invalidf("layer.%d.prompt.score: given, expected layer.%d.gen.q "+
				"(turn.query_dtype is %s: every layer carries the queries)", l, l, t.QueryDType)
		case !queries && q && l == 0:
			return "", invalidf("layer.0.gen.q: dtype unset (turn.query_dtype \"\"), expected F32 or the K/V dtype (%s turn)", t.DType)
		case !queries && q:
			return "", invalidf("layer.%d.gen.q: given, expected layer.%d.prompt.score like layer.0 "+
				"(every layer carries the same one)", l, l)
		}
	}
	if queries && t.QueryDType != "F32" && t.QueryDType != t.DType {
		return "", invalidf("layer.0.gen.q: dtype %q (turn.query_dtype), expected F32 or the K/V dtype (%s turn)",
			t.QueryDType, t.DType)
	}
	return t.QueryDType, nil
}

// sendChunks cuts tensors into chunks of at most MaxChunkBytes, each with its
// CRC32C, then sends the trailer: chunk count, bytes and the CRC32C of all
// chunk data in stream order. A tensor of 0 bytes sends no chunk.
func sendChunks(tensors []uploadTensor, chunk func(*pb.Chunk) error, trailer func(*pb.Trailer) error) error {
	var chunks, bytes uint64
	var crc uint32
	for _, t := range tensors {
		for off := 0; off < len(t.data); off += MaxChunkBytes {
			end := off + MaxChunkBytes
			if end > len(t.data) {
				end = len(t.data)
			}
			piece := t.data[off:end]
			crc = crc32.Update(crc, castagnoli, piece)
			chunks++
			bytes += uint64(len(piece))
			if err := chunk(&pb.Chunk{Layer: t.layer, Part: t.part, Offset: uint64(off), Data: piece,
				Crc32C: crc32.Checksum(piece, castagnoli)}); err != nil {
				return err
			}
		}
	}
	return trailer(&pb.Trailer{Chunks: chunks, Bytes: bytes, Crc32C: crc})
}

// assembler rebuilds a Message from a delivery stream (header, chunks,
// trailer), checking order, offsets, sizes and CRC32Cs; every failure is
// DataLoss (corruptf). Memory follows the data received, not what the
// header announces: a tensor's buffer is made on its first chunk and grows
// (at most doubling, never past the tensor's size) as chunks arrive, so a
// bogus header costs nothing.
type assembler struct {
	header *pb.MessageHeader
	slots  []Tensor // Data: the bytes received so far
	sizes  []int    // each slot's size as the header implies
	filled int      // bytes of slots[next] received (len(slots[next].Data))
	next   int
	chunks uint64
	bytes  uint64
	crc    uint32
	done   bool
}

func (a *assembler) add(r *pb.FetchResponse) error {
	if a.done {
		return corruptf("delivery stream: response after the trailer, expected the end")
	}
	switch k := r.GetKind().(type) {
	case *pb.FetchResponse_Header:
		return a.start(k.Header)
	case *pb.FetchResponse_Chunk:
		return a.addChunk(k.Chunk)
	case *pb.FetchResponse_Trailer:
		return a.finish(k.Trailer)
	default:
		return corruptf("delivery stream: empty response, expected header, chunk or trailer")
	}
}

func (a *assembler) start(h *pb.MessageHeader) error {
	if a.header != nil {
		return corruptf("header: given twice, expected one")
	}
	if h.GetLayers() < 1 || h.GetKvHeads() < 1 || h.GetHeadDim() < 1 {
		return corruptf("header: layers %d, kv_heads %d, head_dim %d, expected each >= 1",
			h.GetLayers(), h.GetKvHeads(), h.GetHeadDim())
	}
	var dtype string
	for name, d := range protoDType {
		if d == h.GetDtype() {
			dtype = name
		}
	}
	if dtype == "" {
		return corruptf("header.dtype: %v, expected DTYPE_F32, DTYPE_F16 or DTYPE_BF16", h.GetDtype())
	}
	n64 := uint64(h.GetNHistory()) + uint64(h.GetNAnchor()) + uint64(h.GetNKept()) + uint64(h.GetNGen())
	if n64 >= 1<<31 {
		return corruptf("header.n_history+n_anchor+n_kept+n_gen: %d, expected < 2^31", n64)
	}
	if h.GetNextPos() < 0 || h.GetNextPos() > 1<<31 {
		return corruptf("header.next_pos: %d, expected 0..2^31", h.GetNextPos())
	}
	n, H, d, bits := int(n64), int(h.GetKvHeads()), int(h.GetHeadDim()), int(h.GetQuantBits())
	type spec struct {
		part   pb.Part
		suffix string
		dtype  string
		shape  []int
	}
	var specs []spec
	if bits != 0 {
		if bits != 2 && bits != 4 && bits != 8 {
			return corruptf("header.quant_bits: %d, expected 0, 2, 4 or 8", bits)
		}
		if h.GetQuantGroup() < 1 {
			return corruptf("header.quant_group: %d, expected >= 1 when quantized", h.GetQuantGroup())
		}
		if d*bits%8 != 0 {
			return corruptf("header.head_dim: %d, expected head_dim*quant_bits a multiple of 8", d)
		}
		groups := (n + int(h.GetQuantGroup()) - 1) / int(h.GetQuantGroup())
		specs = []spec{
			{pb.Part_PART_K_CODES, "k.codes", "U8", []int{H, n, d * bits / 8}},
			{pb.Part_PART_K_SCALE, "k.scale", "F16", []int{H, groups, d}},
			{pb.Part_PART_K_ZERO, "k.zero", "F16", []int{H, groups, d}},
			{pb.Part_PART_V_CODES, "v.codes", "U8", []int{H, n, d * bits / 8}},
			{pb.Part_PART_V_SCALE, "v.scale", "F16", []int{H, n}},
			{pb.Part_PART_V_ZERO, "v.zero", "F16", []int{H, n}},
		}
	} else {
		specs = []spec{
			{pb.Part_PART_K, "k", dtype, []int{H, n, d}},
			{pb.Part_PART_V, "v", dtype, []int{H, n, d}},
		}
	}
	specs = append(specs, spec{pb.Part_PART_POS, "pos", "I32", []int{H, n}})
	// The message's size, checked here; a tensor's buffer is made only when
	// its first chunk arrives (addChunk).
	var total uint64
	for _, s := range specs {
		total += mulSat(numBytes(s.dtype, s.shape), uint64(h.GetLayers()))
	}
	if total > maxMessageBytes || total > uint64(math.MaxInt) {
		return corruptf("header: a message of %d bytes, expected below 2^36", total)
	}
	if sent := h.GetAccounting().GetSentBytes(); sent != total {
		return corruptf("header.accounting.sent_bytes: %d, expected %d (bytes of the tensors the header describes)", sent, total)
	}
	for l := 0; l < int(h.GetLayers()); l++ {
		for _, s := range specs {
			a.slots = append(a.slots, Tensor{Name: fmt.Sprintf("layer.%d.%s", l, s.suffix), Layer: uint32(l),
				Part: s.part, DType: s.dtype, Shape: s.shape})
			a.sizes = append(a.sizes, int(numBytes(s.dtype, s.shape)))
		}
	}
	a.header = h
	a.skipComplete()
	return nil
}

func (a *assembler) skipComplete() {
	for a.next < len(a.slots) && a.filled == a.sizes[a.next] {
		a.next++
		a.filled = 0
	}
}

func (a *assembler) addChunk(c *pb.Chunk) error {
	if a.header == nil {
		return corruptf("chunk: before the header, expected a header first")
	}
	what := fmt.Sprintf("chunk layer %d %v offset %d", c.GetLayer(), c.GetPart(), c.GetOffset())
	if a.next >= len(a.slots) {
		return corruptf("%s: after every tensor of the message is complete, expected the trailer", what)
	}
	slot, size := &a.slots[a.next], a.sizes[a.next]
	if c.GetLayer() != slot.Layer || c.GetPart() != slot.Part || c.GetOffset() != uint64(a.filled) {
		return corruptf("%s: out of order, expected chunk layer %d %v offset %d", what, slot.Layer, slot.Part, a.filled)
	}
	n, room := len(c.GetData()), size-a.filled
	if n < 1 || n > MaxChunkBytes || n > room {
		return corruptf("%s: %d data bytes, expected 1..%d (%s has %d bytes)", what, n,
			minInt(MaxChunkBytes, room), slot.Name, size)
	}
	if crc := crc32.Checksum(c.GetData(), castagnoli); crc != c.GetCrc32C() {
		return corruptf("%s: crc32c %d, expected %d (computed over the data)", what, c.GetCrc32C(), crc)
	}
	slot.Data = appendBounded(slot.Data, c.GetData(), size)
	a.filled += n
	a.chunks++
	a.bytes += uint64(n)
	a.crc = crc32.Update(a.crc, castagnoli, c.GetData())
	a.skipComplete()
	return nil
}

func (a *assembler) finish(t *pb.Trailer) error {
	if a.header == nil {
		return corruptf("trailer: before the header, expected a header first")
	}
	if a.next < len(a.slots) {
		return corruptf("trailer: stream ended with %s at %d of %d bytes", a.slots[a.next].Name, a.filled, a.sizes[a.next])
	}
	for _, f := range []struct {
		name      string
		got, want uint64
	}{{"chunks", t.GetChunks(), a.chunks}, {"bytes", t.GetBytes(), a.bytes}, {"crc32c", uint64(t.GetCrc32C()), uint64(a.crc)}} {
		if f.got != f.want {
			return corruptf("trailer.%s: %d, expected %d (computed over the chunks received)", f.name, f.got, f.want)
		}
	}
	a.done = true
	return nil
}

func (a *assembler) message() (*Message, error) {
	if !a.done {
		return nil, corruptf("delivery stream: ended without a trailer, expected header, chunks, trailer")
	}
	for i := range a.slots {
		if a.slots[i].Data == nil { // a tensor of 0 bytes: no chunk
			a.slots[i].Data = []byte{}
		}
	}
	return &Message{Header: a.header, Tensors: a.slots}, nil
}

// appendBounded appends data to buf, a tensor of size bytes being filled:
// when buf has no room, its capacity at most doubles (at least to fit data,
// at most to size), so what is allocated stays within twice what was
// received and a complete tensor's capacity is exactly its size.
// REQUIRES: len(buf)+len(data) <= size.
func appendBounded(buf, data []byte, size int) []byte {
	need := len(buf) + len(data)
	if need > cap(buf) {
		c := 2 * cap(buf)
		if c < need {
			c = need
		}
		if c > size {
			c = size
		}
		grown := make([]byte, len(buf), c)
		copy(grown, buf)
		buf = grown
	}
	return append(buf, data...)
}

// maxMessageBytes bounds what a delivery header may announce (64 GiB).
const maxMessageBytes = 1 << 36

// numBytes is the size of a tensor, saturated above maxMessageBytes.
func numBytes(dtype string, shape []int) uint64 {
	n := uint64(dtypeSize[dtype])
	for _, x := range shape {
		n = mulSat(n, uint64(x))
	}
	return n
}

// mulSat is a*b, or maxMessageBytes+1 when that is larger.
func mulSat(a, b uint64) uint64 {
	if b != 0 && a > maxMessageBytes/b {
		return maxMessageBytes + 1
	}
	return a * b
}

func minInt(a, b int) int {
	if a < b {
		return a
	}
	return b
}

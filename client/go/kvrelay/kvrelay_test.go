package kvrelay

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"math"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	pb "github.com/kvrelay/kvrelay/client/go/kvrelay/v1"
)

func f32Bytes(xs ...float32) []byte {
	b := make([]byte, 4*len(xs))
	for i, x := range xs {
		binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(x))
	}
	return b
}

func TestCastagnoliKnownVectors(t *testing.T) {
	for _, c := range []struct {
		data []byte
		want uint32
	}{{[]byte("123456789"), 0xE3069283}, {make([]byte, 32), 0x8A9136AA}, {bytes.Repeat([]byte{0xFF}, 32), 0x62A8AB43}} {
		if got := crc32.Checksum(c.data, castagnoli); got != c.want {
			t.Errorf("crc32c(%q) = %#x, want %#x", c.data, got, c.want)
		}
	}
}

func TestSendChunksSplitsAndTrails(t *testing.T) {
	big := bytes.Repeat([]byte{1, 2, 3}, (2*MaxChunkBytes+5)/3+1)[:2*MaxChunkBytes+5]
	small := []byte{7, 8, 9}
	var got []string
	var trailer *pb.Trailer
	err := sendChunks([]uploadTensor{{0, pb.Part_PART_PROMPT_K, big}, {0, pb.Part_PART_PROMPT_V, nil}, {0, pb.Part_PART_GEN_K, small}},
		func(c *pb.Chunk) error {
			if c.GetCrc32C() != crc32.Checksum(c.GetData(), castagnoli) {
				t.Errorf("chunk %v@%d: crc32c %d, want the data's", c.GetPart(), c.GetOffset(), c.GetCrc32C())
			}
			got = append(got, fmt.Sprintf("%v@%d+%d", c.GetPart(), c.GetOffset(), len(c.GetData())))
			return nil
		},
		func(tr *pb.Trailer) error { trailer = tr; return nil })
	if err != nil {
		t.Fatal(err)
	}
	want := []string{
		fmt.Sprintf("PART_PROMPT_K@0+%d", MaxChunkBytes), fmt.Sprintf("PART_PROMPT_K@%d+%d", MaxChunkBytes, MaxChunkBytes),
		fmt.Sprintf("PART_PROMPT_K@%d+5", 2*MaxChunkBytes), "PART_GEN_K@0+3",
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("chunks %v, want %v", got, want)
	}
	all := append(append([]byte{}, big...), small...)
	if trailer.GetChunks() != 4 || trailer.GetBytes() != uint64(len(all)) || trailer.GetCrc32C() != crc32.Checksum(all, castagnoli) {
		t.Errorf("trailer %v, want 4 chunks, %d bytes, crc32c %d", trailer, len(all), crc32.Checksum(all, castagnoli))
	}
}

func tinyTurn() *Turn {
	layer := func() TurnLayer {
		return TurnLayer{PromptK: f32Bytes(0, 1, 2, 3, 4, 5), PromptV: f32Bytes(0, 1, 2, 3, 4, 5),
			GenK: f32Bytes(6, 7), GenV: f32Bytes(6, 7), PromptScore: f32Bytes(1, 2, 3, 4, 5, 6)}
	}
	return &Turn{DType: "F32", KVHeads: 1, ScoreHeads: 2, HeadDim: 2, NPrompt: 3, NGen: 1, FirstAgent: true,
		Layers: []TurnLayer{layer(), layer()}}
}

func TestPlanUpload(t *testing.T) {
	turn := tinyTurn()
	g, tensors, err := planUpload(turn)
	if err != nil {
		t.Fatal(err)
	}
	if g.GetLayers() != 2 || g.GetDtype() != pb.DType_DTYPE_F32 || g.PromptPos0 != nil {
		t.Errorf("geometry %v", g)
	}
	var order []string
	for _, x := range tensors {
		order = append(order, fmt.Sprintf("%d:%v", x.layer, x.part))
	}
	want := "[0:PART_PROMPT_K 0:PART_PROMPT_V 0:PART_GEN_K 0:PART_GEN_V 0:PART_PROMPT_SCORE " +
		"1:PART_PROMPT_K 1:PART_PROMPT_V 1:PART_GEN_K 1:PART_GEN_V 1:PART_PROMPT_SCORE]"
	if fmt.Sprint(order) != want {
		t.Errorf("order %v, want %s", order, want)
	}
	turn.Layers[1].GenK = turn.Layers[1].GenK[4:]
	_, _, err = planUpload(turn)
	if Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "layer.1.gen.k: 4 bytes, expected 8") {
		t.Errorf("short gen.k: %v", err)
	}
}

// queryTurn is a 2-layer BF16 turn (H=1, S=2, d=2, 3 prompt and 2 generated
// tokens) whose layers carry gen.q in qdtype instead of scores.
func queryTurn(qdtype string) *Turn {
	bf16 := func(n int) []byte { return bytes.Repeat([]byte{0x80, 0x3f}, n) } // 1.0
	layer := func() TurnLayer {
		q := bf16(2 * 2 * 2)
		if qdtype == "F32" {
			q = f32Bytes(1, -1, 0.5, 2, 0, 1, 3, -2)
		}
		return TurnLayer{PromptK: bf16(6), PromptV: bf16(6), GenK: bf16(4), GenV: bf16(4), GenQ: q}
	}
	return &Turn{DType: "BF16", KVHeads: 1, ScoreHeads: 2, HeadDim: 2, NPrompt: 3, NGen: 2, FirstAgent: true,
		QueryDType: qdtype, Layers: []TurnLayer{layer(), layer()}}
}

func TestPlanUploadQueries(t *testing.T) {
	for _, qdtype := range []string{"F32", "BF16"} {
		turn := queryTurn(qdtype)
		scale := 0.125
		turn.SoftmaxScale = &scale
		g, tensors, err := planUpload(turn)
		if err != nil {
			t.Fatalf("%s: %v", qdtype, err)
		}
		scale = 3 // the geometry holds its own copy
		if g.GetQueryDtype() != protoDType[qdtype] || g.SoftmaxScale == nil || g.GetSoftmaxScale() != 0.125 ||
			g.GetScoreHeads() != 2 || g.GetNGen() != 2 {
			t.Errorf("%s: geometry %v", qdtype, g)
		}
		var order []string
		for _, x := range tensors {
			order = append(order, fmt.Sprintf("%d:%v:%d", x.layer, x.part, len(x.data)))
		}
		q := 2 * 2 * 2 * dtypeSize[qdtype]
		want := fmt.Sprintf("[0:PART_PROMPT_K:12 0:PART_PROMPT_V:12 0:PART_GEN_K:8 0:PART_GEN_V:8 0:PART_GEN_Q:%d "+
			"1:PART_PROMPT_K:12 1:PART_PROMPT_V:12 1:PART_GEN_K:8 1:PART_GEN_V:8 1:PART_GEN_Q:%d]", q, q)
		if fmt.Sprint(order) != want {
			t.Errorf("%s: order %v, want %s", qdtype, order, want)
		}
	}
	// A turn with scores sends neither query_dtype nor (unless given) a scale.
	if g, _, err := planUpload(tinyTurn()); err != nil || g.GetQueryDtype() != pb.DType_DTYPE_UNSPECIFIED || g.SoftmaxScale != nil {
		t.Errorf("scores: geometry %v, %v", g, err)
	}
}

func TestPlanUploadQueryErrors(t *testing.T) {
	scale := func(x float64) *float64 { return &x }
	for _, c := range []struct {
		name string
		edit func(*Turn)
		want string
	}{
		{"both", func(x *Turn) { x.Layers[0].PromptScore = f32Bytes(1, 2, 3, 4, 5, 6) },
			"layer.0.gen.q: given together with layer.0.prompt.score, expected exactly one of the two"},
		{"scores in layer 1", func(x *Turn) { x.Layers[1].GenQ, x.Layers[1].PromptScore = nil, f32Bytes(1, 2, 3, 4, 5, 6) },
			"layer.1.prompt.score: given, expected layer.1.gen.q (turn.query_dtype is F32: every layer carries the queries)"},
		{"queries in layer 1 of a score turn", func(x *Turn) {
			x.QueryDType = ""
			x.Layers[0].GenQ, x.Layers[0].PromptScore = nil, f32Bytes(1, 2, 3, 4, 5, 6)
		}, "layer.1.gen.q: given, expected layer.1.prompt.score like layer.0 (every layer carries the same one)"},
		{"no query dtype", func(x *Turn) { x.QueryDType = "" },
			`layer.0.gen.q: dtype unset (turn.query_dtype ""), expected F32 or the K/V dtype (BF16 turn)`},
		{"third dtype", func(x *Turn) { x.QueryDType = "F16" },
			`layer.0.gen.q: dtype "F16" (turn.query_dtype), expected F32 or the K/V dtype (BF16 turn)`},
		{"K/V-dtype bytes sent as F32", func(x *Turn) { x.Layers[0].GenQ = x.Layers[0].GenQ[:16] },
			"layer.0.gen.q: 16 bytes, expected 32"},
		{"missing in layer 1", func(x *Turn) { x.Layers[1].GenQ = nil },
			"layer.1.gen.q: missing, expected 32 bytes like layer.0"},
		{"negative scale", func(x *Turn) { x.SoftmaxScale = scale(-1) },
			"turn.softmax_scale: -1, expected a finite number in [1e-06, 1000] or nil"},
		{"zero scale", func(x *Turn) { x.SoftmaxScale = scale(0) }, "turn.softmax_scale: 0, expected a finite number in [1e-06, 1000]"},
		{"huge scale", func(x *Turn) { x.SoftmaxScale = scale(1e300) }, "turn.softmax_scale: 1e+300, expected"},
		{"NaN scale", func(x *Turn) { x.SoftmaxScale = scale(math.NaN()) }, "turn.softmax_scale: NaN, expected"},
		{"infinite scale", func(x *Turn) { x.SoftmaxScale = scale(math.Inf(1)) }, "turn.softmax_scale: +Inf, expected"},
	} {
		turn := queryTurn("F32")
		c.edit(turn)
		_, _, err := planUpload(turn)
		if Code(err) != codes.InvalidArgument || err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want INVALID_ARGUMENT containing %q", c.name, err, c.want)
		}
	}
	noScore := tinyTurn()
	noScore.Layers[1].PromptScore = nil
	if _, _, err := planUpload(noScore); err == nil ||
		!strings.Contains(err.Error(), "layer.1.prompt.score: missing, expected it or layer.1.gen.q (the queries)") {
		t.Errorf("no score: %v", err)
	}
	// Publish and Compress refuse them before any call.
	relay := &fakeRelay{committed: map[string]bool{}}
	c := NewClient(relay)
	both := queryTurn("BF16")
	both.Layers[0].PromptScore = f32Bytes(1, 2, 3, 4, 5, 6)
	_, err := c.Publish(context.Background(), both, PublishOptions{SessionID: "s", Sender: "planner", Recipients: []string{"critic"}})
	if Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "layer.0.gen.q: given together") || len(relay.seen) != 0 {
		t.Errorf("publish: %v (relay saw %v)", err, relay.seen)
	}
	if _, err := c.Compress(context.Background(), both, "h2o-head:k=2,window=1"); Code(err) != codes.InvalidArgument ||
		!strings.Contains(err.Error(), "kvrelay: compress: ") || !strings.Contains(err.Error(), "layer.0.gen.q: given together") {
		t.Errorf("compress: %v", err)
	}
}

// delivery is a valid delivery of a 1-layer dense F32 message: H=1, n=2, d=2.
func delivery() []*pb.FetchResponse {
	k, v, pos := f32Bytes(1, 2, 3, 4), f32Bytes(5, 6, 7, 8), []byte{0, 0, 0, 0, 1, 0, 0, 0}
	chunk := func(part pb.Part, data []byte) *pb.FetchResponse {
		return &pb.FetchResponse{Kind: &pb.FetchResponse_Chunk{Chunk: &pb.Chunk{Part: part, Data: data,
			Crc32C: crc32.Checksum(data, castagnoli)}}}
	}
	all := append(append(append([]byte{}, k...), v...), pos...)
	return []*pb.FetchResponse{
		{Kind: &pb.FetchResponse_Header{Header: &pb.MessageHeader{MessageId: "m", Layers: 1, KvHeads: 1, HeadDim: 2,
			Dtype: pb.DType_DTYPE_F32, NAnchor: 1, NGen: 1, Accounting: &pb.Accounting{SentBytes: 40}}}},
		chunk(pb.Part_PART_K, k), chunk(pb.Part_PART_V, v), chunk(pb.Part_PART_POS, pos),
		{Kind: &pb.FetchResponse_Trailer{Trailer: &pb.Trailer{Chunks: 3, Bytes: uint64(len(all)),
			Crc32C: crc32.Checksum(all, castagnoli)}}},
	}
}

func assemble(rs []*pb.FetchResponse) (*Message, error) {
	var a assembler
	for _, r := range rs {
		if err := a.add(r); err != nil {
			return nil, err
		}
	}
	return a.message()
}

func TestAssembler(t *testing.T) {
	m, err := assemble(delivery())
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, x := range m.Tensors {
		got = append(got, fmt.Sprintf("%s %s %v %d", x.Name, x.DType, x.Shape, len(x.Data)))
	}
	if want := "[layer.0.k F32 [1 2 2] 16 layer.0.v F32 [1 2 2] 16 layer.0.pos I32 [1 2] 8]"; fmt.Sprint(got) != want {
		t.Errorf("tensors %v, want %s", got, want)
	}
	if !bytes.Equal(m.Tensors[1].Data, f32Bytes(5, 6, 7, 8)) {
		t.Errorf("v = %v", m.Tensors[1].Data)
	}
	// Positions 0 and 1 held: without a header next_pos (an older relay) the
	// receiver continues at 2; the header's turn end wins when it is later.
	if got := m.NextPos(); got != 2 {
		t.Errorf("NextPos() = %d without a header next_pos, want 2", got)
	}
	ended := delivery()
	ended[0].GetHeader().NextPos = 9
	if m, err := assemble(ended); err != nil || m.NextPos() != 9 {
		t.Errorf("NextPos() with header next_pos 9: %v, %v", m, err)
	}

	// Every malformed delivery is DATA_LOSS: the relay sent damaged data,
	// the caller did nothing wrong.
	corrupt := delivery()
	corrupt[2].GetChunk().Crc32C ^= 1
	badTrailer := delivery()
	badTrailer[4].GetTrailer().Crc32C ^= 1
	swapped := delivery()
	swapped[1], swapped[2] = swapped[2], swapped[1]
	wrongSize := delivery()
	wrongSize[0].GetHeader().Accounting.SentBytes = 41
	negativeNext := delivery()
	negativeNext[0].GetHeader().NextPos = -1
	noLayers := delivery()
	noLayers[0].GetHeader().Layers = 0
	badBits := delivery()
	badBits[0].GetHeader().QuantBits = 3
	oversized := delivery()
	oversized[1].GetChunk().Data = append(oversized[1].GetChunk().Data, 0, 0, 0, 0)
	oversized[1].GetChunk().Crc32C = crc32.Checksum(oversized[1].GetChunk().Data, castagnoli)
	for _, c := range []struct {
		name string
		rs   []*pb.FetchResponse
		code codes.Code
		msg  string
	}{
		{"bad chunk crc", corrupt, codes.DataLoss, "crc32c"},
		{"bad trailer crc", badTrailer, codes.DataLoss, "trailer.crc32c"},
		{"out of order", swapped, codes.DataLoss, "out of order"},
		{"no trailer", delivery()[:4], codes.DataLoss, "without a trailer"},
		{"missing chunk", append(delivery()[:3], delivery()[4]), codes.DataLoss, "layer.0.pos at 0 of 8"},
		{"sent_bytes", wrongSize, codes.DataLoss, "sent_bytes: 41, expected 40"},
		{"next_pos", negativeNext, codes.DataLoss, "header.next_pos: -1, expected 0..2^31"},
		{"no layers", noLayers, codes.DataLoss, "header: layers 0, kv_heads 1, head_dim 2, expected each >= 1"},
		{"quant_bits", badBits, codes.DataLoss, "header.quant_bits: 3, expected 0, 2, 4 or 8"},
		{"chunk past its tensor", oversized, codes.DataLoss, "20 data bytes, expected 1..16"},
		{"chunk before the header", delivery()[1:], codes.DataLoss, "chunk: before the header"},
		{"second header", append(delivery()[:1], delivery()...), codes.DataLoss, "header: given twice"},
		{"extra chunk", append(delivery()[:4], delivery()[3], delivery()[4]), codes.DataLoss,
			"after every tensor of the message is complete"},
		{"after the trailer", append(delivery(), delivery()[3]), codes.DataLoss, "response after the trailer"},
		{"empty response", append(delivery()[:1], &pb.FetchResponse{}), codes.DataLoss, "empty response"},
		{"empty stream", nil, codes.DataLoss, "without a trailer"},
	} {
		_, err := assemble(c.rs)
		if Code(err) != c.code || !strings.Contains(err.Error(), c.msg) {
			t.Errorf("%s: %v, want %v containing %q", c.name, err, c.code, c.msg)
		}
	}
}

func TestCodeUnwraps(t *testing.T) {
	err := fmt.Errorf("kvrelay: ack: %w", status.Error(codes.NotFound, "no such message"))
	if Code(err) != codes.NotFound || CodeName(Code(err)) != "NOT_FOUND" {
		t.Errorf("Code(%v) = %v", err, Code(err))
	}
	if Code(nil) != codes.OK || Code(fmt.Errorf("plain")) != codes.Unknown {
		t.Error("Code of nil / a plain error")
	}
}

func TestTurnFileRoundTrip(t *testing.T) {
	dir := t.TempDir()
	turn := tinyTurn()
	var ts []Tensor
	for l, layer := range turn.Layers {
		p := fmt.Sprintf("layer.%d.", l)
		ts = append(ts,
			Tensor{Name: p + "prompt.k", DType: "F32", Shape: []int{1, 3, 2}, Data: layer.PromptK},
			Tensor{Name: p + "prompt.v", DType: "F32", Shape: []int{1, 3, 2}, Data: layer.PromptV},
			Tensor{Name: p + "gen.k", DType: "F32", Shape: []int{1, 1, 2}, Data: layer.GenK},
			Tensor{Name: p + "gen.v", DType: "F32", Shape: []int{1, 1, 2}, Data: layer.GenV},
			Tensor{Name: p + "prompt.score", DType: "F32", Shape: []int{2, 3}, Data: layer.PromptScore})
	}
	path := filepath.Join(dir, "turn.safetensors")
	if err := writeSafetensors(path, ts, map[string]string{"first_agent": "false", "prompt_pos0": "7"}); err != nil {
		t.Fatal(err)
	}
	got, err := ReadTurnFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if got.FirstAgent || got.PromptPos0 == nil || *got.PromptPos0 != 7 || got.NPrompt != 3 || got.ScoreHeads != 2 ||
		len(got.Layers) != 2 || !bytes.Equal(got.Layers[1].PromptScore, turn.Layers[1].PromptScore) {
		t.Errorf("read back %+v", got)
	}
	ts[6].Shape = []int{1, 2, 3} // layer.1.prompt.v, same size, wrong shape
	if err := writeSafetensors(path, ts, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := ReadTurnFile(path); err == nil || !strings.Contains(err.Error(), "layer.1.prompt.v: F32 [1 2 3], expected F32 [1 3 2]") {
		t.Errorf("wrong shape: %v", err)
	}
}

// queryTurnTensors is queryTurn(qdtype) as turn-file tensors.
func queryTurnTensors(qdtype string) []Tensor {
	turn := queryTurn(qdtype)
	var ts []Tensor
	for l, layer := range turn.Layers {
		p := fmt.Sprintf("layer.%d.", l)
		ts = append(ts,
			Tensor{Name: p + "prompt.k", DType: "BF16", Shape: []int{1, 3, 2}, Data: layer.PromptK},
			Tensor{Name: p + "prompt.v", DType: "BF16", Shape: []int{1, 3, 2}, Data: layer.PromptV},
			Tensor{Name: p + "gen.k", DType: "BF16", Shape: []int{1, 2, 2}, Data: layer.GenK},
			Tensor{Name: p + "gen.v", DType: "BF16", Shape: []int{1, 2, 2}, Data: layer.GenV},
			Tensor{Name: p + "gen.q", DType: qdtype, Shape: []int{2, 2, 2}, Data: layer.GenQ})
	}
	return ts
}

func TestTurnFileWithQueries(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "turn.safetensors")
	for _, qdtype := range []string{"F32", "BF16"} {
		if err := writeSafetensors(path, queryTurnTensors(qdtype), map[string]string{"softmax_scale": "1.25e-1"}); err != nil {
			t.Fatal(err)
		}
		got, err := ReadTurnFile(path)
		if err != nil {
			t.Fatalf("%s: %v", qdtype, err)
		}
		want := queryTurn(qdtype)
		if got.QueryDType != qdtype || got.ScoreHeads != 2 || got.NGen != 2 || got.SoftmaxScale == nil ||
			*got.SoftmaxScale != 0.125 || len(got.Layers) != 2 || got.Layers[1].PromptScore != nil ||
			!bytes.Equal(got.Layers[1].GenQ, want.Layers[1].GenQ) {
			t.Errorf("%s: read back %+v", qdtype, got)
		}
		if g, _, err := planUpload(got); err != nil || g.GetQueryDtype() != protoDType[qdtype] || g.GetSoftmaxScale() != 0.125 {
			t.Errorf("%s: geometry %v, %v", qdtype, g, err)
		}
	}
	// Without the metadata: no scale (the relay's 1/sqrt(head_dim)).
	if err := writeSafetensors(path, queryTurnTensors("F32"), nil); err != nil {
		t.Fatal(err)
	}
	if got, err := ReadTurnFile(path); err != nil || got.SoftmaxScale != nil {
		t.Errorf("no softmax_scale: %+v, %v", got, err)
	}

	score := Tensor{Name: "layer.1.prompt.score", DType: "F32", Shape: []int{2, 3}, Data: f32Bytes(1, 2, 3, 4, 5, 6)}
	for _, c := range []struct {
		name string
		edit func([]Tensor) []Tensor
		meta map[string]string
		want string
	}{
		{"both", func(ts []Tensor) []Tensor { return append(ts, score) }, nil,
			"layer.1.gen.q: given together with layer.1.prompt.score, expected exactly one of the two"},
		{"mixed", func(ts []Tensor) []Tensor { return append(ts[:9], score) }, nil,
			"layer.1.prompt.score: given, expected layer.1.gen.q like layer.0 (every layer carries the same one)"},
		{"neither", func(ts []Tensor) []Tensor { return ts[:9] }, nil,
			"layer.1.prompt.score: missing, expected it or layer.1.gen.q (the queries)"},
		{"third dtype", func(ts []Tensor) []Tensor {
			ts[4].DType, ts[4].Data = "F16", ts[4].Data[:16]
			return ts
		}, nil, "layer.0.gen.q: dtype F16, expected F32 or BF16 (the K/V dtype)"},
		{"dtype differs in layer 1", func(ts []Tensor) []Tensor {
			ts[9].DType, ts[9].Data = "BF16", ts[9].Data[:16]
			return ts
		}, nil, "layer.1.gen.q: BF16 [2 2 2], expected F32 [2 2 2] (from layer.0)"},
		{"shape", func(ts []Tensor) []Tensor {
			ts[9].Shape = []int{2, 1, 4}
			return ts
		}, nil, "layer.1.gen.q: F32 [2 1 4], expected F32 [2 2 2] (from layer.0)"},
		{"scale 0", nil, map[string]string{"softmax_scale": "0"}, `metadata softmax_scale: "0", expected a finite decimal number in [1e-06, 1000]`},
		{"scale 1e300", nil, map[string]string{"softmax_scale": "1e300"}, `metadata softmax_scale: "1e300", expected`},
		{"scale -1", nil, map[string]string{"softmax_scale": "-1"}, `metadata softmax_scale: "-1", expected`},
		{"scale inf", nil, map[string]string{"softmax_scale": "inf"}, `metadata softmax_scale: "inf", expected`},
		{"scale nan", nil, map[string]string{"softmax_scale": "NaN"}, `metadata softmax_scale: "NaN", expected`},
		{"scale hex", nil, map[string]string{"softmax_scale": "0x1p-3"}, `metadata softmax_scale: "0x1p-3", expected`},
		{"scale overflow", nil, map[string]string{"softmax_scale": "1e999"}, `metadata softmax_scale: "1e999", expected`},
	} {
		ts := queryTurnTensors("F32")
		if c.edit != nil {
			ts = c.edit(ts)
		}
		if err := writeSafetensors(path, ts, c.meta); err != nil {
			t.Fatal(err)
		}
		if _, err := ReadTurnFile(path); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want %q", c.name, err, c.want)
		}
	}
}

// Tensors that share bytes, or a negative dimension that multiplies to the
// right size, are refused (as the C++ reader does); gaps are fine.
func TestReadSafetensorsRefusesOverlapsAndNegativeShapes(t *testing.T) {
	dir := t.TempDir()
	write := func(header string, data int) string {
		path := filepath.Join(dir, "f.safetensors")
		buf := make([]byte, 8, 8+len(header)+data)
		binary.LittleEndian.PutUint64(buf, uint64(len(header)))
		buf = append(append(buf, header...), make([]byte, data)...)
		if err := os.WriteFile(path, buf, 0o644); err != nil {
			t.Fatal(err)
		}
		return path
	}
	for _, c := range []struct{ header, want string }{
		{`{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}`,
			"a and b: data_offsets overlap"},
		{`{"a":{"dtype":"F32","shape":[-1,-2],"data_offsets":[0,8]}}`, "shape [-1 -2], expected dimensions 0..2^40"},
		{`{"a":{"dtype":"U8","shape":[1099511627776,1099511627776],"data_offsets":[0,0]}}`, "expected at most 16 bytes"},
	} {
		if _, _, err := readSafetensors(write(c.header, 16)); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want %q", c.header, err, c.want)
		}
	}
	gap := `{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}}`
	if _, ts, err := readSafetensors(write(gap, 16)); err != nil || len(ts) != 2 {
		t.Errorf("gap: %v", err)
	}
}

// ---- Publish: the message id travels with every error ----------------------------

// fakeRelay stands in for a relay's Publish: it records each header's message
// id; session "down" answers UNAVAILABLE; session "slow" never answers the
// first upload of an id (the caller's deadline passes: the outcome is
// unknown) and answers a re-publish of that id with duplicate = true, as the
// relay does once committed.
type fakeRelay struct {
	mu        sync.Mutex
	seen      []string
	headers   []*pb.PublishHeader
	committed map[string]bool
}

func (f *fakeRelay) Invoke(ctx context.Context, method string, args, reply interface{}, opts ...grpc.CallOption) error {
	if method == "/kvrelay.v1.Relay/Stats" {
		*reply.(*pb.StatsResponse) = pb.StatsResponse{MessagesCommitted: 3, StoreBytes: 4096, Version: "fake"}
		return nil
	}
	return status.Error(codes.Unimplemented, method)
}

func (f *fakeRelay) NewStream(ctx context.Context, desc *grpc.StreamDesc, method string, opts ...grpc.CallOption) (grpc.ClientStream, error) {
	if method != "/kvrelay.v1.Relay/Publish" {
		return nil, status.Error(codes.Unimplemented, method)
	}
	return &fakePublish{ctx: ctx, relay: f}, nil
}

type fakePublish struct {
	ctx    context.Context
	relay  *fakeRelay
	header *pb.PublishHeader
}

func (s *fakePublish) Header() (metadata.MD, error) { return nil, nil }
func (s *fakePublish) Trailer() metadata.MD         { return nil }
func (s *fakePublish) CloseSend() error             { return nil }
func (s *fakePublish) Context() context.Context     { return s.ctx }

func (s *fakePublish) SendMsg(m interface{}) error {
	if h := m.(*pb.PublishRequest).GetHeader(); h != nil {
		s.header = h
		s.relay.mu.Lock()
		s.relay.seen = append(s.relay.seen, h.GetMessageId())
		s.relay.headers = append(s.relay.headers, h)
		s.relay.mu.Unlock()
	}
	return nil
}

func (s *fakePublish) RecvMsg(m interface{}) error {
	id := s.header.GetMessageId()
	if s.header.GetSessionId() == "down" {
		return status.Error(codes.Unavailable, "fake relay: going away")
	}
	s.relay.mu.Lock()
	dup := s.relay.committed[id]
	s.relay.committed[id] = true
	s.relay.mu.Unlock()
	if dup {
		*m.(*pb.PublishResponse) = pb.PublishResponse{MessageId: id, Duplicate: true}
		return nil
	}
	<-s.ctx.Done() // committed, but the answer never comes
	return status.Error(codes.DeadlineExceeded, "context deadline exceeded")
}

var generatedID = regexp.MustCompile(`^m-[0-9a-f]{24}$`)

func publishError(t *testing.T, err error) *PublishError {
	t.Helper()
	var pe *PublishError
	if !errors.As(err, &pe) {
		t.Fatalf("error %v (%T): errors.As finds no *PublishError", err, err)
	}
	return pe
}

// A role or policy that protobuf cannot marshal (invalid UTF-8) is
// InvalidArgument naming the field, before any call.
func TestPublishRejectsUnsendableStrings(t *testing.T) {
	relay := &fakeRelay{committed: map[string]bool{}}
	c := NewClient(relay)
	for _, c2 := range []struct {
		field string
		o     PublishOptions
	}{
		{"role", PublishOptions{SessionID: "s", Sender: "planner", Recipients: []string{"critic"}, Role: "r\xff"}},
		{"role", PublishOptions{SessionID: "s", Sender: "planner", Recipients: []string{"critic"}, Role: strings.Repeat("r", 129)}},
		{"policy", PublishOptions{SessionID: "s", Sender: "planner", Recipients: []string{"critic"}, Policy: "full\xff"}},
	} {
		_, err := c.Publish(context.Background(), tinyTurn(), c2.o)
		if Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), c2.field+": ") {
			t.Errorf("%s: %v, want InvalidArgument naming it", c2.field, err)
		}
	}
	if len(relay.seen) != 0 {
		t.Errorf("the relay saw %v, want no call", relay.seen)
	}
}

func TestPublishErrorCarriesMessageID(t *testing.T) {
	relay := &fakeRelay{committed: map[string]bool{}}
	c := NewClient(relay)
	ctx := context.Background()
	o := PublishOptions{SessionID: "down", Sender: "planner", Recipients: []string{"critic"}}

	// A server error, generated id: the id on the error is the one the relay saw.
	_, err := c.Publish(ctx, tinyTurn(), o)
	pe := publishError(t, err)
	if !generatedID.MatchString(pe.MessageID) || fmt.Sprint(relay.seen) != fmt.Sprint([]string{pe.MessageID}) {
		t.Errorf("message id %q, relay saw %v", pe.MessageID, relay.seen)
	}
	if Code(err) != codes.Unavailable || pe.SessionID != "down" ||
		!strings.Contains(err.Error(), "kvrelay: publish "+pe.MessageID+" to session down: ") {
		t.Errorf("error %v: code %v", err, Code(err))
	}

	// The caller's id, chosen up front.
	o.MessageID = NewMessageID()
	_, err = c.Publish(ctx, tinyTurn(), o)
	if pe := publishError(t, err); pe.MessageID != o.MessageID || relay.seen[len(relay.seen)-1] != o.MessageID {
		t.Errorf("message id %q, want %q (relay saw %v)", pe.MessageID, o.MessageID, relay.seen)
	}

	// Errors found before any call carry it too.
	bad := tinyTurn()
	bad.DType = "F64"
	_, err = c.Publish(ctx, bad, PublishOptions{SessionID: "s", MessageID: "m-x", Sender: "a", Recipients: []string{"b"}})
	if pe := publishError(t, err); pe.MessageID != "m-x" || Code(err) != codes.InvalidArgument {
		t.Errorf("bad dtype: %v (id %q)", err, pe.MessageID)
	}
	_, err = c.Publish(ctx, tinyTurn(), PublishOptions{SessionID: "s", Sender: "a"})
	if pe := publishError(t, err); !generatedID.MatchString(pe.MessageID) || Code(err) != codes.InvalidArgument {
		t.Errorf("no recipients: %v (id %q)", err, pe.MessageID)
	}
}

func TestPublishRetryWithTheErrorsID(t *testing.T) {
	relay := &fakeRelay{committed: map[string]bool{}}
	c := NewClient(relay)
	o := PublishOptions{SessionID: "slow", Sender: "planner", Recipients: []string{"critic"}}
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	_, err := c.Publish(ctx, tinyTurn(), o)
	if Code(err) != codes.DeadlineExceeded {
		t.Fatalf("first publish: %v, want DEADLINE_EXCEEDED", err)
	}
	o.MessageID = publishError(t, err).MessageID
	r, err := c.Publish(context.Background(), tinyTurn(), o)
	if err != nil || r.MessageID != o.MessageID || !r.Duplicate {
		t.Fatalf("retry with %s: %+v, %v; want a duplicate", o.MessageID, r, err)
	}
	if fmt.Sprint(relay.seen) != fmt.Sprint([]string{o.MessageID, o.MessageID}) {
		t.Errorf("relay saw %v, want %s twice (one message)", relay.seen, o.MessageID)
	}
}

func TestPublishUnreachableRelayTellsTheID(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := Dial(ctx, "127.0.0.1:1") // nothing listens on port 1
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_, err = c.Publish(ctx, tinyTurn(), PublishOptions{SessionID: "s", Sender: "planner", Recipients: []string{"critic"}})
	if code := Code(err); code != codes.Unavailable && code != codes.DeadlineExceeded {
		t.Errorf("publish to a closed port: %v, want UNAVAILABLE", err)
	}
	if pe := publishError(t, err); !generatedID.MatchString(pe.MessageID) {
		t.Errorf("message id %q", pe.MessageID)
	}
}

// ---- assembler memory ----------------------------------------------------------------

func fetchChunks(t *testing.T, tensors []uploadTensor) []*pb.FetchResponse {
	t.Helper()
	var rs []*pb.FetchResponse
	err := sendChunks(tensors,
		func(c *pb.Chunk) error {
			rs = append(rs, &pb.FetchResponse{Kind: &pb.FetchResponse_Chunk{Chunk: c}})
			return nil
		},
		func(tr *pb.Trailer) error {
			rs = append(rs, &pb.FetchResponse{Kind: &pb.FetchResponse_Trailer{Trailer: tr}})
			return nil
		})
	if err != nil {
		t.Fatal(err)
	}
	return rs
}

func TestAssemblerHugeHeaderAllocatesOnlyWhatArrives(t *testing.T) {
	// 1 layer, 8 KV heads, head_dim 128, F32, 2^22 tokens: k and v of 16 GiB
	// each, pos of 128 MiB; a valid header (below the 64 GiB bound) whose
	// data never comes: 3 chunks of k, then the trailer.
	const n = 1 << 22
	kBytes := uint64(8 * n * 128 * 4)
	h := &pb.MessageHeader{MessageId: "m", Layers: 1, KvHeads: 8, HeadDim: 128, Dtype: pb.DType_DTYPE_F32,
		NKept: n, Accounting: &pb.Accounting{SentBytes: 2*kBytes + 8*n*4}}
	piece := bytes.Repeat([]byte{1, 2, 3, 4}, MaxChunkBytes/4)
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	var a assembler
	if err := a.add(&pb.FetchResponse{Kind: &pb.FetchResponse_Header{Header: h}}); err != nil {
		t.Fatalf("header: %v", err)
	}
	rs := fetchChunks(t, []uploadTensor{{0, pb.Part_PART_K, bytes.Repeat(piece, 3)}})
	for _, r := range rs[:3] {
		if err := a.add(r); err != nil {
			t.Fatalf("chunk: %v", err)
		}
	}
	err := a.add(rs[3])
	runtime.ReadMemStats(&after)
	want := fmt.Sprintf("trailer: stream ended with layer.0.k at %d of %d bytes", 3*MaxChunkBytes, kBytes)
	if Code(err) != codes.DataLoss || !strings.Contains(err.Error(), want) {
		t.Errorf("trailer: %v, want DATA_LOSS %q", err, want)
	}
	if got := cap(a.slots[0].Data); got > 2*3*MaxChunkBytes {
		t.Errorf("layer.0.k holds %d bytes of capacity for %d received", got, 3*MaxChunkBytes)
	}
	for i, s := range a.slots[1:] {
		if s.Data != nil {
			t.Errorf("%s (slot %d): %d bytes allocated before any chunk", s.Name, i+1, cap(s.Data))
		}
	}
	// What the assembler allocated (the 3 MiB of chunks and the trailer's
	// test data included), far from the 32 GiB the header announces.
	if grown := after.TotalAlloc - before.TotalAlloc; grown > 64<<20 {
		t.Errorf("allocated %d bytes for a header announcing %d", grown, h.GetAccounting().GetSentBytes())
	}
}

func TestAssemblerMultiChunkTensors(t *testing.T) {
	// H=1, d=320, F32, n=2049: k and v of 2,622,720 bytes (3 chunks each).
	const H, d, n = 1, 320, 2049
	k, v, pos := make([]byte, H*n*d*4), make([]byte, H*n*d*4), make([]byte, H*n*4)
	for i := range k {
		k[i], v[i] = byte(i*7), byte(i*13+1)
	}
	for i := 0; i < n; i++ {
		binary.LittleEndian.PutUint32(pos[4*i:], uint32(i))
	}
	h := &pb.MessageHeader{MessageId: "m", Layers: 1, KvHeads: H, HeadDim: d, Dtype: pb.DType_DTYPE_F32,
		NAnchor: 4, NKept: n - 4, Accounting: &pb.Accounting{SentBytes: uint64(len(k) + len(v) + len(pos))}}
	rs := append([]*pb.FetchResponse{{Kind: &pb.FetchResponse_Header{Header: h}}},
		fetchChunks(t, []uploadTensor{{0, pb.Part_PART_K, k}, {0, pb.Part_PART_V, v}, {0, pb.Part_PART_POS, pos}})...)
	if len(rs) != 1+3+3+1+1 {
		t.Fatalf("%d responses", len(rs))
	}
	m, err := assemble(rs)
	if err != nil {
		t.Fatal(err)
	}
	for i, want := range [][]byte{k, v, pos} {
		got := m.Tensors[i].Data
		if !bytes.Equal(got, want) || cap(got) != len(want) {
			t.Errorf("%s: %d bytes (capacity %d), equal %t; want %d bytes", m.Tensors[i].Name, len(got), cap(got),
				bytes.Equal(got, want), len(want))
		}
	}
}

func TestStats(t *testing.T) {
	c := NewClient(&fakeRelay{committed: map[string]bool{}})
	st, err := c.Stats(context.Background())
	if err != nil || st.GetMessagesCommitted() != 3 || st.GetStoreBytes() != 4096 || st.GetVersion() != "fake" {
		t.Errorf("Stats() = %v, %v", st, err)
	}
	// Other unary calls reach the same stand-in, which does not implement them.
	if _, err := c.CloseSession(context.Background(), "s"); Code(err) != codes.Unimplemented ||
		!strings.Contains(err.Error(), "kvrelay: close session s: ") {
		t.Errorf("CloseSession: %v", err)
	}
}

// ---- credentials ---------------------------------------------------------------------

// authRecorder is a gRPC server that records each call's authorization
// metadata and answers UNAUTHENTICATED.
type authRecorder struct {
	mu   sync.Mutex
	seen map[string][]string // method -> authorization values
}

func startAuthRecorder(t *testing.T) (string, *authRecorder) {
	t.Helper()
	r := &authRecorder{seen: map[string][]string{}}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := grpc.NewServer(grpc.UnknownServiceHandler(func(_ interface{}, stream grpc.ServerStream) error {
		method, _ := grpc.MethodFromServerStream(stream)
		md, _ := metadata.FromIncomingContext(stream.Context())
		r.mu.Lock()
		r.seen[method] = append(r.seen[method], md.Get("authorization")...)
		r.mu.Unlock()
		return status.Error(codes.Unauthenticated, "recorder")
	}))
	go s.Serve(lis)
	t.Cleanup(s.Stop)
	return lis.Addr().String(), r
}

func (r *authRecorder) get(method string) []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.seen[method]...)
}

// The token goes with unary and streaming calls over plaintext; an explicit
// token wins over $KVRELAY_TOKEN, which Dial without options sends.
func TestTokenSentOnEveryCallOverPlaintext(t *testing.T) {
	addr, rec := startAuthRecorder(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	t.Setenv(TokenEnv, "from-env")
	for _, tc := range []struct {
		name string
		dial func() (*Client, error)
		want string
	}{
		{"explicit", func() (*Client, error) { return DialSecure(ctx, addr, Security{Token: "tok-1"}) }, "Bearer tok-1"},
		{"env via Security", func() (*Client, error) { return DialSecure(ctx, addr, Security{}) }, "Bearer from-env"},
		{"env via Dial", func() (*Client, error) { return Dial(ctx, addr) }, "Bearer from-env"},
	} {
		rec.seen = map[string][]string{}
		c, err := tc.dial()
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		_, err = c.Stats(ctx)
		if Code(err) != codes.Unauthenticated {
			t.Errorf("%s: Stats: %v, want UNAUTHENTICATED from the recorder", tc.name, err)
		}
		_, err = c.Publish(ctx, tinyTurn(), PublishOptions{SessionID: "s", Sender: "planner", Recipients: []string{"critic"}})
		if Code(err) != codes.Unauthenticated {
			t.Errorf("%s: Publish: %v", tc.name, err)
		}
		_, err = c.Fetch(ctx, "s", "critic", false)
		if Code(err) != codes.Unauthenticated {
			t.Errorf("%s: Fetch: %v", tc.name, err)
		}
		for _, m := range []string{"/kvrelay.v1.Relay/Stats", "/kvrelay.v1.Relay/Publish", "/kvrelay.v1.Relay/Fetch"} {
			if got := rec.get(m); fmt.Sprint(got) != fmt.Sprint([]string{tc.want}) {
				t.Errorf("%s: %s: authorization %q, want [%q]", tc.name, m, got, tc.want)
			}
		}
		c.Close()
	}
	t.Setenv(TokenEnv, "")
	rec.seen = map[string][]string{}
	c, err := Dial(ctx, addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.Stats(ctx)
	if got := rec.get("/kvrelay.v1.Relay/Stats"); len(got) != 0 {
		t.Errorf("no token: authorization %q, want none", got)
	}
}

func TestSecurityErrorsNameTheFieldNotTheToken(t *testing.T) {
	dir := t.TempDir()
	notPEM := filepath.Join(dir, "ca.pem")
	if err := os.WriteFile(notPEM, []byte("not a certificate\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		s    Security
		want string
	}{
		{Security{Token: "secret\nline"}, "token: byte 6 of 11 is 0x0a, expected visible ASCII"},
		{Security{Token: "sec ret"}, "token: byte 3 of 7 is 0x20"},
		{Security{CertFile: "c.pem", KeyFile: "k.pem"}, "tls cert/key: given without a CA file"},
		{Security{CAFile: filepath.Join(dir, "missing.pem")}, "tls CA file: open "},
		{Security{CAFile: notPEM}, "no PEM certificate, expected one or more"},
		{Security{CAFile: notPEM, CertFile: "c.pem"}, "no PEM certificate"},
	} {
		_, err := tc.s.DialOptions()
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: %v, want it to contain %q", tc.s, err, tc.want)
		} else if strings.Contains(err.Error(), "secret") || strings.Contains(err.Error(), "sec ret") {
			t.Errorf("%v: shows the token", err)
		}
	}
}

func TestReadTokenFile(t *testing.T) {
	dir := t.TempDir()
	write := func(name, text string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(text), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	if tok, err := ReadTokenFile(write("a", "  tok-123 \r\nsecond line\n")); err != nil || tok != "tok-123" {
		t.Errorf("ReadTokenFile = %q, %v; want tok-123", tok, err)
	}
	if tok, err := ReadTokenFile(write("b", "tok-456")); err != nil || tok != "tok-456" {
		t.Errorf("no newline: %q, %v", tok, err)
	}
	if _, err := ReadTokenFile(write("c", " \nlater\n")); err == nil || !strings.Contains(err.Error(), "first line empty") {
		t.Errorf("empty first line: %v", err)
	}
	if _, err := ReadTokenFile(filepath.Join(dir, "none")); err == nil {
		t.Error("missing file: no error")
	}
}

// ---- history.score, history_anchors, attention_error --------------------------------

// historyTurn is tinyTurn with an uploaded history of 4 tokens (positions
// 0..3) and the chain's anchors 0 and 2.
func historyTurn() *Turn {
	turn := tinyTurn()
	turn.NHistory, turn.FirstAgent, turn.HistoryAnchors = 4, false, []int32{0, 2}
	for l := range turn.Layers {
		layer := &turn.Layers[l]
		layer.HistoryK = f32Bytes(0, 1, 2, 3, 4, 5, 6, 7)
		layer.HistoryV = f32Bytes(0, 1, 2, 3, 4, 5, 6, 7)
		layer.HistoryPos = []byte{0, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0}
		layer.HistoryScore = f32Bytes(0, 0, 9, 9, 0, 0, 9, float32(l)) // [ScoreHeads 2, NHistory 4]
	}
	return turn
}

func TestPlanUploadHistoryScoreAndAnchors(t *testing.T) {
	turn := historyTurn()
	g, tensors, err := planUpload(turn)
	if err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(g.GetHistoryAnchors()) != "[0 2]" || g.GetHistoryScoreTokens() != 4 || g.GetNHistory() != 4 {
		t.Errorf("geometry %v", g)
	}
	turn.HistoryAnchors[0] = 1 // the geometry holds its own copy
	if g.GetHistoryAnchors()[0] != 0 {
		t.Errorf("geometry anchors alias the turn's: %v", g.GetHistoryAnchors())
	}
	var order []string
	for _, x := range tensors {
		order = append(order, fmt.Sprintf("%d:%v:%d", x.layer, x.part, len(x.data)))
	}
	layer := "PART_PROMPT_K:24 %[1]d:PART_PROMPT_V:24 %[1]d:PART_GEN_K:8 %[1]d:PART_GEN_V:8 %[1]d:PART_PROMPT_SCORE:24 " +
		"%[1]d:PART_HISTORY_SCORE:32 %[1]d:PART_HISTORY_K:32 %[1]d:PART_HISTORY_V:32 %[1]d:PART_HISTORY_POS:16"
	want := "[0:" + fmt.Sprintf(layer, 0) + " 1:" + fmt.Sprintf(layer, 1) + "]"
	if fmt.Sprint(order) != want {
		t.Errorf("order %v\nwant  %s", order, want)
	}
	if !bytes.Equal(tensors[14].data, turn.Layers[1].HistoryScore) {
		t.Errorf("layer 1 history.score bytes %v", tensors[14].data)
	}
	// An explicit HistoryScoreTokens equal to NHistory is the same upload.
	turn.HistoryAnchors[0] = 0
	turn.HistoryScoreTokens = 4
	if g2, _, err := planUpload(turn); err != nil || g2.GetHistoryScoreTokens() != 4 {
		t.Errorf("explicit history_score_tokens: %v, %v", g2, err)
	}
	// With a parent (no uploaded history): the parent's tokens per head, given.
	child := tinyTurn()
	child.HistoryScoreTokens = 3
	for l := range child.Layers {
		child.Layers[l].HistoryScore = f32Bytes(1, 2, 3, 4, 5, 6)
	}
	g, tensors, err = planUpload(child)
	if err != nil || g.GetHistoryScoreTokens() != 3 || g.GetNHistory() != 0 || len(g.GetHistoryAnchors()) != 0 {
		t.Fatalf("parent-style turn: %v, %v", g, err)
	}
	if len(tensors) != 12 || tensors[5].part != pb.Part_PART_HISTORY_SCORE || tensors[4].part != pb.Part_PART_PROMPT_SCORE {
		t.Errorf("parent-style order: %d tensors, [4] %v, [5] %v", len(tensors), tensors[4].part, tensors[5].part)
	}
	// None: neither field nor part.
	if g, tensors, err := planUpload(tinyTurn()); err != nil || g.GetHistoryScoreTokens() != 0 || g.HistoryAnchors != nil ||
		len(tensors) != 10 {
		t.Errorf("plain turn: %v, %d tensors, %v", g, len(tensors), err)
	}
}

func TestPlanUploadHistoryErrors(t *testing.T) {
	for _, c := range []struct {
		name string
		edit func(*Turn)
		want string
	}{
		{"anchors descending", func(x *Turn) { x.HistoryAnchors = []int32{2, 1} },
			"turn.history_anchors[1]: 1, expected ascending distinct position ids >= 0"},
		{"anchor twice", func(x *Turn) { x.HistoryAnchors = []int32{1, 1} }, "turn.history_anchors[1]: 1, expected ascending"},
		{"negative anchor", func(x *Turn) { x.HistoryAnchors = []int32{-1} }, "turn.history_anchors[0]: -1, expected"},
		{"more anchors than history", func(x *Turn) { x.HistoryAnchors = []int32{0, 1, 2, 3, 4} },
			"turn.history_anchors: 5 position ids, expected at most n_history = 4"},
		{"anchors without history", func(x *Turn) {
			x.NHistory = 0
			for l := range x.Layers {
				x.Layers[l].HistoryScore = nil
			}
		}, "turn.history_anchors: 2 position ids, expected none for a turn without history"},
		{"score in layer 1 only", func(x *Turn) { x.Layers[0].HistoryScore = nil },
			"layer.0.history.score: missing, expected it in every layer or in none (layer.1 has one)"},
		{"score short", func(x *Turn) { x.Layers[1].HistoryScore = x.Layers[1].HistoryScore[4:] },
			"layer.1.history.score: 28 bytes, expected 32"},
		{"tokens other than n_history", func(x *Turn) { x.HistoryScoreTokens = 5 },
			"turn.history_score_tokens: 5, expected n_history = 4 (the uploaded history's tokens)"},
		{"tokens without a score", func(x *Turn) {
			x.HistoryScoreTokens = 4
			for l := range x.Layers {
				x.Layers[l].HistoryScore = nil
			}
		}, "turn.history_score_tokens: 4, expected 0 (no layer carries a history.score)"},
		{"parent-style without tokens", func(x *Turn) { x.NHistory, x.HistoryAnchors = 0, nil },
			"turn.history_score_tokens: 0, expected the parent's tokens per head"},
		{"negative tokens", func(x *Turn) { x.HistoryScoreTokens = -1 }, "turn.history_score_tokens: -1, expected 0..2^32-1"},
	} {
		turn := historyTurn()
		c.edit(turn)
		_, _, err := planUpload(turn)
		if Code(err) != codes.InvalidArgument || err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want INVALID_ARGUMENT containing %q", c.name, err, c.want)
		}
	}
	q := queryTurn("F32")
	for l := range q.Layers {
		q.Layers[l].HistoryScore = f32Bytes(1, 2)
	}
	q.HistoryScoreTokens = 1
	if _, _, err := planUpload(q); Code(err) != codes.InvalidArgument ||
		!strings.Contains(err.Error(), "layer.0.history.score: given with layer.0.gen.q, expected none") {
		t.Errorf("with gen.q: %v", err)
	}

	// A history.score needs a history: uploaded, or the parent's.
	relay := &fakeRelay{committed: map[string]bool{}}
	c := NewClient(relay)
	orphan := tinyTurn()
	orphan.HistoryScoreTokens = 3
	for l := range orphan.Layers {
		orphan.Layers[l].HistoryScore = f32Bytes(1, 2, 3, 4, 5, 6)
	}
	o := PublishOptions{SessionID: "s", Sender: "planner", Recipients: []string{"critic"}, MessageID: "m-orphan"}
	const noHistory = "layer.0.history.score: [2, 3] given without history, expected none (upload the history, or publish with parent_id"
	if _, err := c.Publish(context.Background(), orphan, o); Code(err) != codes.InvalidArgument ||
		!strings.Contains(err.Error(), noHistory) || len(relay.seen) != 0 {
		t.Errorf("publish without a parent: %v (relay saw %v)", err, relay.seen)
	}
	if _, err := c.Compress(context.Background(), orphan, "full"); Code(err) != codes.InvalidArgument ||
		!strings.Contains(err.Error(), noHistory) {
		t.Errorf("compress: %v", err)
	}
	// With a parent it is sent: history_score_tokens and the parts reach the relay.
	o.ParentID, o.MessageID = "m-parent", "m-child"
	relay.committed["m-child"] = true // the stand-in answers at once
	if _, err := c.Publish(context.Background(), orphan, o); err != nil {
		t.Fatalf("publish with a parent: %v", err)
	}
	if len(relay.headers) != 1 || relay.headers[0].GetGeometry().GetHistoryScoreTokens() != 3 ||
		relay.headers[0].GetParentId() != "m-parent" || relay.headers[0].GetGeometry().GetFirstAgent() {
		t.Errorf("headers %v", relay.headers)
	}
}

func TestTurnFileWithHistoryScoreAndAnchors(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "turn.safetensors")
	files := func() []Tensor {
		var ts []Tensor
		for l, layer := range historyTurn().Layers {
			p := fmt.Sprintf("layer.%d.", l)
			ts = append(ts,
				Tensor{Name: p + "prompt.k", DType: "F32", Shape: []int{1, 3, 2}, Data: layer.PromptK},
				Tensor{Name: p + "prompt.v", DType: "F32", Shape: []int{1, 3, 2}, Data: layer.PromptV},
				Tensor{Name: p + "gen.k", DType: "F32", Shape: []int{1, 1, 2}, Data: layer.GenK},
				Tensor{Name: p + "gen.v", DType: "F32", Shape: []int{1, 1, 2}, Data: layer.GenV},
				Tensor{Name: p + "prompt.score", DType: "F32", Shape: []int{2, 3}, Data: layer.PromptScore},
				Tensor{Name: p + "history.k", DType: "F32", Shape: []int{1, 4, 2}, Data: layer.HistoryK},
				Tensor{Name: p + "history.v", DType: "F32", Shape: []int{1, 4, 2}, Data: layer.HistoryV},
				Tensor{Name: p + "history.pos", DType: "I32", Shape: []int{1, 4}, Data: layer.HistoryPos},
				Tensor{Name: p + "history.score", DType: "F32", Shape: []int{2, 4}, Data: layer.HistoryScore})
		}
		return ts
	}
	// A turn for a parent: history.score without history tensors.
	forParent := func() []Tensor {
		var ts []Tensor
		for _, x := range files() {
			if !strings.Contains(x.Name, "history.") || strings.HasSuffix(x.Name, "history.score") {
				ts = append(ts, x)
			}
		}
		return ts
	}
	meta := map[string]string{"first_agent": "false", "history_anchors": "0,2"}
	if err := writeSafetensors(path, files(), meta); err != nil {
		t.Fatal(err)
	}
	got, err := ReadTurnFile(path)
	if err != nil {
		t.Fatal(err)
	}
	want := historyTurn()
	if fmt.Sprint(got.HistoryAnchors) != "[0 2]" || got.HistoryScoreTokens != 4 || got.NHistory != 4 ||
		!bytes.Equal(got.Layers[1].HistoryScore, want.Layers[1].HistoryScore) {
		t.Errorf("read back %+v", got)
	}
	if g, _, err := planUpload(got); err != nil || g.GetHistoryScoreTokens() != 4 || fmt.Sprint(g.GetHistoryAnchors()) != "[0 2]" {
		t.Errorf("geometry %v, %v", g, err)
	}
	// Neither: no anchors, no score.
	if err := writeSafetensors(path, files()[:8], nil); err != nil {
		t.Fatal(err)
	}
	if got, err := ReadTurnFile(path); err != nil || got.HistoryAnchors != nil || got.HistoryScoreTokens != 0 ||
		got.Layers[0].HistoryScore != nil {
		t.Errorf("without: %+v, %v", got, err)
	}
	if err := writeSafetensors(path, forParent(), nil); err != nil {
		t.Fatal(err)
	}
	child, err := ReadTurnFile(path)
	if err != nil || child.NHistory != 0 || child.HistoryScoreTokens != 4 ||
		!bytes.Equal(child.Layers[1].HistoryScore, want.Layers[1].HistoryScore) {
		t.Fatalf("for a parent: %+v, %v", child, err)
	}
	relay := &fakeRelay{committed: map[string]bool{"m-child": true}}
	o := PublishOptions{SessionID: "s", Sender: "critic", Recipients: []string{"judge"}, MessageID: "m-child"}
	if _, err := NewClient(relay).Publish(context.Background(), child, o); Code(err) != codes.InvalidArgument ||
		!strings.Contains(err.Error(), "layer.0.history.score: [2, 4] given without history") {
		t.Errorf("publish without a parent: %v", err)
	}
	o.ParentID = "m-parent"
	if _, err := NewClient(relay).Publish(context.Background(), child, o); err != nil ||
		relay.headers[0].GetGeometry().GetHistoryScoreTokens() != 4 {
		t.Errorf("publish with a parent: %v, %v", err, relay.headers)
	}
	acc := Tensor{Name: "layer.0.history.acc", DType: "F32", Shape: []int{1, 4}, Data: f32Bytes(0, 0, 0, 0)}
	for _, c := range []struct {
		name string
		ts   []Tensor
		meta string
		want string
	}{
		{"anchor not a number", files(), "0,x", `metadata history_anchors: item "x" of 1, expected comma-separated position ids`},
		{"negative anchor", files(), "-1", `metadata history_anchors: item "-1" of 0, expected`},
		{"anchor past int32", files(), "2147483648", `metadata history_anchors: item "2147483648" of 0`},
		{"empty item", files(), "0,,2", `metadata history_anchors: item "" of 1`},
		{"score in layer 0 only", files()[:17], "0,2", "layer.1.history.score: missing"},
		{"score in layer 1 only", append(files()[:8], files()[9:]...), "0,2",
			"layer.1.history.score: given, expected it in every layer or in none"},
		{"score shape", func() []Tensor {
			ts := files()
			ts[8].Shape = []int{4, 2}
			return ts
		}(), "0,2", "layer.0.history.score: F32 [4 2], expected F32 [2 4] (from layer.0)"},
		{"score without history, widths differ", func() []Tensor {
			ts := forParent()
			ts[11].Shape, ts[11].Data = []int{2, 3}, ts[11].Data[:24]
			return ts
		}(), "", "layer.1.history.score: F32 [2 3], expected F32 [2 4] (from layer.0)"},
		{"history.acc", append(files(), acc), "0,2", "layer.0.history.acc: not carried by Publish or Compress"},
	} {
		if err := writeSafetensors(path, c.ts, map[string]string{"history_anchors": c.meta}); err != nil {
			t.Fatal(err)
		}
		if _, err := ReadTurnFile(path); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want %q", c.name, err, c.want)
		}
	}
}

func TestAttentionErrorInTheAccountingAndTheMessageFile(t *testing.T) {
	if _, ok := AttentionError(nil); ok {
		t.Error("AttentionError(nil): ok")
	}
	if _, ok := AttentionError(&pb.Accounting{Policy: "h2o-head:k=2"}); ok {
		t.Error("AttentionError of an accounting without the figure: ok")
	}
	zero := 0.0
	if e, ok := AttentionError(&pb.Accounting{AttentionError: &zero}); !ok || e != 0 {
		t.Errorf("AttentionError(0) = %v, %v; 0 is a figure", e, ok)
	}
	dir := t.TempDir()
	for _, c := range []struct {
		figure *float64
		want   string
	}{{nil, ""}, {func() *float64 { x := 0.1234567890123456789; return &x }(), "0.12345678901234568"},
		{func() *float64 { x := 3e-7; return &x }(), "3e-07"}} {
		rs := delivery()
		rs[0].GetHeader().Accounting.AttentionError = c.figure
		m, err := assemble(rs)
		if err != nil {
			t.Fatal(err)
		}
		if e, ok := AttentionError(m.Header.GetAccounting()); ok != (c.figure != nil) || (ok && e != *c.figure) {
			t.Errorf("delivered header: %v, %v, want %v", e, ok, c.figure)
		}
		path := filepath.Join(dir, "msg.safetensors")
		if err := WriteMessageFile(path, m); err != nil {
			t.Fatal(err)
		}
		meta, _, err := readSafetensors(path)
		if err != nil {
			t.Fatal(err)
		}
		if got, ok := meta["attention_error"]; got != c.want || ok != (c.want != "") {
			t.Errorf("metadata attention_error %q (present %v), want %q", got, ok, c.want)
		}
	}
}

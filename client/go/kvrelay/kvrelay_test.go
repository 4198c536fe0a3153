package kvrelay

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"math"
	"path/filepath"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "kvrelay/v1"
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

	corrupt := delivery()
	corrupt[2].GetChunk().Crc32C ^= 1
	badTrailer := delivery()
	badTrailer[4].GetTrailer().Crc32C ^= 1
	swapped := delivery()
	swapped[1], swapped[2] = swapped[2], swapped[1]
	wrongSize := delivery()
	wrongSize[0].GetHeader().Accounting.SentBytes = 41
	for _, c := range []struct {
		name string
		rs   []*pb.FetchResponse
		code codes.Code
		msg  string
	}{
		{"bad chunk crc", corrupt, codes.DataLoss, "crc32c"},
		{"bad trailer crc", badTrailer, codes.DataLoss, "trailer.crc32c"},
		{"out of order", swapped, codes.InvalidArgument, "out of order"},
		{"no trailer", delivery()[:4], codes.DataLoss, "without a trailer"},
		{"missing chunk", append(delivery()[:3], delivery()[4]), codes.InvalidArgument, "layer.0.pos at 0 of 8"},
		{"sent_bytes", wrongSize, codes.InvalidArgument, "sent_bytes: 41, expected 40"},
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

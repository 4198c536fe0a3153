package kvrelay

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"os"
	"regexp"
	"sort"
	"strconv"
	"strings"
)

// Minimal safetensors I/O for turn and message files (docs/FORMAT.md): an
// 8-byte little-endian header length N, N bytes of JSON header, then the raw
// little-endian tensor data.

type stEntry struct {
	DType       string   `json:"dtype"`
	Shape       []int    `json:"shape"`
	DataOffsets [2]int64 `json:"data_offsets"`
}

type stTensor struct {
	dtype string
	shape []int
	data  []byte
}

// readSafetensors returns the metadata and the tensors (views into one
// buffer holding the file).
func readSafetensors(path string) (map[string]string, map[string]stTensor, error) {
	buf, err := os.ReadFile(path)
	if err != nil {
		return nil, nil, err
	}
	if len(buf) < 8 {
		return nil, nil, fmt.Errorf("%s: %d bytes, expected at least 8 (header length)", path, len(buf))
	}
	n := binary.LittleEndian.Uint64(buf)
	if n > uint64(len(buf)-8) {
		return nil, nil, fmt.Errorf("%s: header length %d, expected at most %d (file size - 8)", path, n, len(buf)-8)
	}
	var header map[string]json.RawMessage
	if err := json.Unmarshal(buf[8:8+n], &header); err != nil {
		return nil, nil, fmt.Errorf("%s: header: %w", path, err)
	}
	meta := map[string]string{}
	if raw, ok := header["__metadata__"]; ok {
		if err := json.Unmarshal(raw, &meta); err != nil {
			return nil, nil, fmt.Errorf("%s: __metadata__: %w", path, err)
		}
		delete(header, "__metadata__")
	}
	data := buf[8+n:]
	tensors := make(map[string]stTensor, len(header))
	type span struct {
		name       string
		begin, end int64
	}
	var spans []span
	for name, raw := range header {
		var e stEntry
		if err := json.Unmarshal(raw, &e); err != nil {
			return nil, nil, fmt.Errorf("%s: %s: %w", path, name, err)
		}
		size, ok := dtypeSize[e.DType]
		if !ok {
			return nil, nil, fmt.Errorf("%s: %s: dtype %q, expected F32, F16, BF16, I32 or U8", path, name, e.DType)
		}
		want := int64(size)
		for _, x := range e.Shape {
			if x < 0 || x > 1<<40 {
				return nil, nil, fmt.Errorf("%s: %s: shape %v, expected dimensions 0..2^40", path, name, e.Shape)
			}
			want *= int64(x)
			if want > int64(len(data)) {
				return nil, nil, fmt.Errorf("%s: %s: shape %v, expected at most %d bytes (the file's data)", path, name, e.Shape, len(data))
			}
		}
		b, end := e.DataOffsets[0], e.DataOffsets[1]
		if b < 0 || end-b != want || end > int64(len(data)) {
			return nil, nil, fmt.Errorf("%s: %s: data_offsets [%d,%d], expected %d bytes within the file", path, name, b, end, want)
		}
		tensors[name] = stTensor{dtype: e.DType, shape: e.Shape, data: data[b:end:end]}
		spans = append(spans, span{name, b, end})
	}
	// Tensors may leave gaps but never share bytes.
	sort.Slice(spans, func(i, j int) bool { return spans[i].begin < spans[j].begin })
	last := -1
	for i, s := range spans {
		if s.end == s.begin {
			continue
		}
		if last >= 0 && s.begin < spans[last].end {
			return nil, nil, fmt.Errorf("%s: %s and %s: data_offsets overlap", path, spans[last].name, s.name)
		}
		last = i
	}
	return meta, tensors, nil
}

// writeSafetensors writes tensors in the given order, with metadata.
func writeSafetensors(path string, tensors []Tensor, meta map[string]string) error {
	header := map[string]interface{}{}
	if len(meta) > 0 {
		header["__metadata__"] = meta
	}
	var off int64
	for _, t := range tensors {
		header[t.Name] = stEntry{DType: t.DType, Shape: t.Shape, DataOffsets: [2]int64{off, off + int64(len(t.Data))}}
		off += int64(len(t.Data))
	}
	js, err := json.Marshal(header)
	if err != nil {
		return err
	}
	if pad := (8 - len(js)%8) % 8; pad > 0 {
		js = append(js, strings.Repeat(" ", pad)...)
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	var n [8]byte
	binary.LittleEndian.PutUint64(n[:], uint64(len(js)))
	_, err = f.Write(append(n[:], js...))
	for _, t := range tensors {
		if err == nil {
			_, err = f.Write(t.Data)
		}
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	return nil
}

// decimalPattern is a decimal number, an exponent allowed (no hexadecimal,
// no inf or nan): what a turn file's softmax_scale holds.
var decimalPattern = regexp.MustCompile(`^[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?$`)

// digitsPattern is a decimal integer without sign: an item of a turn file's
// history_anchors.
var digitsPattern = regexp.MustCompile(`^[0-9]+$`)

// ReadTurnFile reads a turn file (docs/FORMAT.md, "Turn"), checking names,
// dtypes and shapes; the relay checks the values. A file whose layers carry
// gen.q gives a Turn with GenQ and QueryDType (gen.q's dtype), and its
// softmax_scale metadata SoftmaxScale. history.score gives HistoryScore
// and HistoryScoreTokens: NHistory with history, else its columns (a turn
// for a parent: publish it with PublishOptions.ParentID); the
// history_anchors metadata gives HistoryAnchors. history.acc cannot be
// uploaded: a file with it is refused, naming it.
func ReadTurnFile(path string) (*Turn, error) {
	meta, tensors, err := readSafetensors(path)
	if err != nil {
		return nil, err
	}
	get := func(name string) (stTensor, error) {
		t, ok := tensors[name]
		if !ok {
			return t, fmt.Errorf("%s: %s: missing", path, name)
		}
		return t, nil
	}
	k0, err := get("layer.0.prompt.k")
	if err != nil {
		return nil, err
	}
	if len(k0.shape) != 3 {
		return nil, fmt.Errorf("%s: layer.0.prompt.k: shape %v, expected [kv_heads, n_prompt, head_dim]", path, k0.shape)
	}
	if _, ok := protoDType[k0.dtype]; !ok {
		return nil, fmt.Errorf("%s: layer.0.prompt.k: dtype %s, expected F32, F16 or BF16", path, k0.dtype)
	}
	t := &Turn{DType: k0.dtype, KVHeads: k0.shape[0], NPrompt: k0.shape[1], HeadDim: k0.shape[2], FirstAgent: true}
	// The attention input: layer 0's prompt.score or gen.q, the same one in
	// every layer (checked below).
	attention := "prompt.score"
	if q0, ok := tensors["layer.0.gen.q"]; ok {
		attention = "gen.q"
		if q0.dtype != "F32" && q0.dtype != t.DType {
			return nil, fmt.Errorf("%s: layer.0.gen.q: dtype %s, expected F32 or %s (the K/V dtype)", path, q0.dtype, t.DType)
		}
		t.QueryDType = q0.dtype
	}
	for _, dim := range []struct {
		name string
		axis int
		dst  *int
	}{{"layer.0." + attention, 0, &t.ScoreHeads}, {"layer.0.gen.k", 1, &t.NGen}} {
		x, err := get(dim.name)
		if err != nil {
			return nil, err
		}
		if len(x.shape) <= dim.axis {
			return nil, fmt.Errorf("%s: %s: shape %v, too few dimensions", path, dim.name, x.shape)
		}
		*dim.dst = x.shape[dim.axis]
	}
	h0, hasHistory := tensors["layer.0.history.k"]
	if hasHistory && len(h0.shape) == 3 {
		t.NHistory = h0.shape[1]
	}
	hs0, hasHistoryScore := tensors["layer.0.history.score"]
	switch {
	case hasHistoryScore && attention == "gen.q":
		return nil, fmt.Errorf("%s: layer.0.history.score: given with layer.0.gen.q, expected none "+
			"(the relay computes the mass on the history from the queries)", path)
	case hasHistoryScore && hasHistory:
		t.HistoryScoreTokens = t.NHistory
	case hasHistoryScore && len(hs0.shape) == 2:
		// No history: the score covers a parent's tokens (publish with
		// PublishOptions.ParentID), as many as its columns.
		t.HistoryScoreTokens = hs0.shape[1]
	case hasHistoryScore:
		return nil, fmt.Errorf("%s: layer.0.history.score: shape %v, expected [score_heads, tokens]", path, hs0.shape)
	}
	if v, ok := meta["history_anchors"]; ok && v != "" {
		for i, item := range strings.Split(v, ",") {
			id, err := strconv.ParseUint(item, 10, 31)
			if err != nil || !digitsPattern.MatchString(item) {
				return nil, fmt.Errorf("%s: metadata history_anchors: item %q of %d, expected comma-separated "+
					"position ids (decimal, 0..2^31-1)", path, item, i)
			}
			t.HistoryAnchors = append(t.HistoryAnchors, int32(id))
		}
	}
	if v, ok := meta["first_agent"]; ok {
		if v != "true" && v != "false" {
			return nil, fmt.Errorf("%s: metadata first_agent: %q, expected \"true\" or \"false\"", path, v)
		}
		t.FirstAgent = v == "true"
	}
	if v, ok := meta["prompt_pos0"]; ok {
		p, err := strconv.ParseInt(v, 10, 64)
		if err != nil || p < 0 {
			return nil, fmt.Errorf("%s: metadata prompt_pos0: %q, expected a decimal integer >= 0", path, v)
		}
		t.PromptPos0 = &p
	}
	if v, ok := meta["softmax_scale"]; ok {
		scale, err := strconv.ParseFloat(v, 64)
		if err != nil || !decimalPattern.MatchString(v) || !(scale >= 1e-6 && scale <= 1e3) {
			return nil, fmt.Errorf("%s: metadata softmax_scale: %q, expected a finite decimal number in [1e-06, 1000]", path, v)
		}
		t.SoftmaxScale = &scale
	}
	type field struct {
		name  string
		dtype string
		shape []int
		dst   func(*TurnLayer) *[]byte
	}
	kv := func(n int) []int { return []int{t.KVHeads, n, t.HeadDim} }
	fields := []field{
		{"prompt.k", t.DType, kv(t.NPrompt), func(l *TurnLayer) *[]byte { return &l.PromptK }},
		{"prompt.v", t.DType, kv(t.NPrompt), func(l *TurnLayer) *[]byte { return &l.PromptV }},
		{"gen.k", t.DType, kv(t.NGen), func(l *TurnLayer) *[]byte { return &l.GenK }},
		{"gen.v", t.DType, kv(t.NGen), func(l *TurnLayer) *[]byte { return &l.GenV }},
	}
	if attention == "gen.q" {
		fields = append(fields, field{"gen.q", t.QueryDType, []int{t.ScoreHeads, t.NGen, t.HeadDim},
			func(l *TurnLayer) *[]byte { return &l.GenQ }})
	} else {
		fields = append(fields, field{"prompt.score", "F32", []int{t.ScoreHeads, t.NPrompt},
			func(l *TurnLayer) *[]byte { return &l.PromptScore }})
	}
	if hasHistory {
		fields = append(fields,
			field{"history.k", t.DType, kv(t.NHistory), func(l *TurnLayer) *[]byte { return &l.HistoryK }},
			field{"history.v", t.DType, kv(t.NHistory), func(l *TurnLayer) *[]byte { return &l.HistoryV }},
			field{"history.pos", "I32", []int{t.KVHeads, t.NHistory}, func(l *TurnLayer) *[]byte { return &l.HistoryPos }})
	}
	if hasHistoryScore {
		fields = append(fields, field{"history.score", "F32", []int{t.ScoreHeads, t.HistoryScoreTokens},
			func(l *TurnLayer) *[]byte { return &l.HistoryScore }})
	}
	seen := map[string]bool{}
	for l := 0; ; l++ {
		if _, ok := tensors[fmt.Sprintf("layer.%d.prompt.k", l)]; !ok {
			break
		}
		_, score := tensors[fmt.Sprintf("layer.%d.prompt.score", l)]
		_, queries := tensors[fmt.Sprintf("layer.%d.gen.q", l)]
		switch {
		case score && queries:
			return nil, fmt.Errorf("%s: layer.%d.gen.q: given together with layer.%d.prompt.score, expected exactly one of the two",
				path, l, l)
		case !score && !queries:
			return nil, fmt.Errorf("%s: layer.%d.prompt.score: missing, expected it or layer.%d.gen.q (the queries)", path, l, l)
		case queries != (attention == "gen.q"):
			given, want := "prompt.score", "gen.q"
			if queries {
				given, want = want, given
			}
			return nil, fmt.Errorf("%s: layer.%d.%s: given, expected layer.%d.%s like layer.0 (every layer carries the same one)",
				path, l, given, l, want)
		}
		var layer TurnLayer
		for _, f := range fields {
			name := fmt.Sprintf("layer.%d.%s", l, f.name)
			x, err := get(name)
			if err != nil {
				return nil, err
			}
			if x.dtype != f.dtype || fmt.Sprint(x.shape) != fmt.Sprint(f.shape) {
				return nil, fmt.Errorf("%s: %s: %s %v, expected %s %v (from layer.0)", path, name, x.dtype, x.shape, f.dtype, f.shape)
			}
			*f.dst(&layer) = x.data
			seen[name] = true
		}
		t.Layers = append(t.Layers, layer)
	}
	if len(seen) != len(tensors) {
		names := make([]string, 0, len(tensors))
		for name := range tensors {
			if !seen[name] {
				names = append(names, name)
			}
		}
		sort.Strings(names)
		switch {
		case strings.HasSuffix(names[0], ".history.acc"):
			return nil, fmt.Errorf("%s: %s: not carried by Publish or Compress, expected none (publish with "+
				"parent_id to keep the parent's acc, or compress offline with kvrelayctl compress)", path, names[0])
		case strings.HasSuffix(names[0], ".history.score"):
			return nil, fmt.Errorf("%s: %s: given, expected it in every layer or in none (layer.0 has none)",
				path, names[0])
		}
		return nil, fmt.Errorf("%s: %s: unexpected tensor in a turn of %d layers (history: %v)", path, names[0], len(t.Layers), hasHistory)
	}
	return t, nil
}

// joinInt32 is the ids in decimal, comma-separated.
func joinInt32(ids []int32) string {
	parts := make([]string, len(ids))
	for i, id := range ids {
		parts[i] = strconv.FormatInt(int64(id), 10)
	}
	return strings.Join(parts, ",")
}

// WriteMessageFile writes a fetched message as a message file
// (docs/FORMAT.md, "Message"), with the delivery in its metadata like
// `kvrelayctl fetch --out`.
func WriteMessageFile(path string, m *Message) error {
	h, a := m.Header, m.Header.GetAccounting()
	u := func(x uint64) string { return strconv.FormatUint(x, 10) }
	meta := map[string]string{
		"format":           "kvrelay.message.v2",
		"policy":           a.GetPolicy(),
		"dtype":            strings.TrimPrefix(h.GetDtype().String(), "DTYPE_"),
		"n_history":        u(uint64(h.GetNHistory())),
		"n_anchor":         u(uint64(h.GetNAnchor())),
		"n_kept":           u(uint64(h.GetNKept())),
		"n_gen":            u(uint64(h.GetNGen())),
		"full_bytes":       u(a.GetFullBytes()),
		"sent_bytes":       u(a.GetSentBytes()),
		"next_pos":         strconv.FormatInt(m.NextPos(), 10),
		"anchor_pos":       joinInt32(h.GetAnchorPos()),
		"message_id":       h.GetMessageId(),
		"session":          h.GetSessionId(),
		"from":             h.GetSender(),
		"delivery_attempt": u(uint64(h.GetDeliveryAttempt())),
		"received_bytes":   u(a.GetReceivedBytes()),
		"ratio":            strconv.FormatFloat(a.GetRatio(), 'f', 6, 64),
		"compress_seconds": strconv.FormatFloat(a.GetCompressSeconds(), 'f', 6, 64),
		"commit_seconds":   strconv.FormatFloat(a.GetCommitSeconds(), 'f', 6, 64),
	}
	if h.GetQuantBits() != 0 {
		meta["quant_bits"] = u(uint64(h.GetQuantBits()))
		meta["quant_group"] = u(uint64(h.GetQuantGroup()))
		meta["quant_rotate"] = strconv.FormatBool(h.GetQuantRotate())
	}
	if h.GetRole() != "" {
		meta["role"] = h.GetRole()
	}
	if h.GetParentId() != "" {
		meta["parent_id"] = h.GetParentId()
	}
	if e, ok := AttentionError(a); ok {
		meta["attention_error"] = strconv.FormatFloat(e, 'g', -1, 64) // reads back exactly
	}
	return writeSafetensors(path, m.Tensors, meta)
}

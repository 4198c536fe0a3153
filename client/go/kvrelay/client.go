// Package kvrelay is a Go client of the kvrelay.v1.Relay service
// (proto/kvrelay/v1/relay.proto): publish an agent's turn, fetch the
// composed message, acknowledge it.
//
//	c, err := kvrelay.Dial(ctx, "127.0.0.1:50051")
//	// or, TLS with a token: kvrelay.DialSecure(ctx, "relay:50051",
//	//	kvrelay.Security{CAFile: "ca.pem", Token: token})
//	r, err := c.Publish(ctx, turn, kvrelay.PublishOptions{
//		SessionID: "s1", Sender: "planner", Recipients: []string{"critic"},
//		Policy: "h2o-head:k=32+obf:p=8"})
//	m, err := c.Fetch(ctx, "s1", "critic", false)
//	err = c.Ack(ctx, "s1", "critic", m.Header.GetMessageId())
//
// Deadlines come from the context: Fetch waits for a message until the
// context's deadline (DEADLINE_EXCEEDED when none arrived). Errors wrap the
// relay's gRPC status, or a status this client produced itself (DataLoss for
// every malformed delivery: out of order or missing chunks, bad sizes, a
// header that describes no valid message, a sent_bytes, CRC32C or trailer
// mismatch; InvalidArgument, before any call, for arguments that cannot be
// sent); Code and Status find it through the wrapping. Nothing is retried.
//
// Retrying a publish is safe only with the SAME message id: a re-publish of a
// committed id answers with Duplicate = true, while a new id publishes a
// second message. When the outcome is unknown (DEADLINE_EXCEEDED,
// UNAVAILABLE, ...) retry with the id you passed, or, when you passed none,
// with the one the error carries: every error Publish returns is a
// *PublishError with the MessageID that publish used (errors.As finds it).
// Simplest: choose the id up front with NewMessageID.
package kvrelay

// The stubs in kvrelay/v1 come from proto/ through generate.sh.
//go:generate bash ../generate.sh

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"regexp"
	"unicode/utf8"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/kvrelay/kvrelay/client/go/kvrelay/v1"
)

// MaxChunkBytes is the most tensor bytes one Chunk carries (relay.proto).
const MaxChunkBytes = 1 << 20

var idPattern = regexp.MustCompile(`^[A-Za-z0-9._:-]{1,128}$`)

// Client is a connection to one relay. Safe for concurrent use.
type Client struct {
	conn  *grpc.ClientConn // nil when built by NewClient
	relay pb.RelayClient
}

// Dial connects to the relay at addr ("HOST:PORT" or "unix:PATH"). Without
// options it uses Security{}.DialOptions(): a plaintext channel that sends
// $KVRELAY_TOKEN when set. For TLS, a client certificate or a token, use
// DialSecure (or pass Security.DialOptions). The connection is made lazily:
// an unreachable relay, or one whose certificate fails verification, shows
// up as UNAVAILABLE on the first call.
func Dial(ctx context.Context, addr string, opts ...grpc.DialOption) (*Client, error) {
	if len(opts) == 0 {
		var err error
		if opts, err = (Security{}).DialOptions(); err != nil {
			return nil, err
		}
	}
	conn, err := grpc.DialContext(ctx, addr, opts...)
	if err != nil {
		return nil, fmt.Errorf("kvrelay: dial %s: %w", addr, err)
	}
	return &Client{conn: conn, relay: pb.NewRelayClient(conn)}, nil
}

// NewClient uses an existing connection, which the caller closes.
func NewClient(conn grpc.ClientConnInterface) *Client {
	return &Client{relay: pb.NewRelayClient(conn)}
}

// Close closes the connection Dial made.
func (c *Client) Close() error {
	if c.conn == nil {
		return nil
	}
	return c.conn.Close()
}

// Status returns the gRPC status that err wraps (the relay's, or one this
// package produced), and false when there is none.
func Status(err error) (*status.Status, bool) {
	var se interface{ GRPCStatus() *status.Status }
	if errors.As(err, &se) {
		return se.GRPCStatus(), true
	}
	return nil, false
}

// Code is the gRPC code that err wraps: OK for nil, Unknown when it wraps none.
func Code(err error) codes.Code {
	if err == nil {
		return codes.OK
	}
	if s, ok := Status(err); ok {
		return s.Code()
	}
	return codes.Unknown
}

// CodeName is the canonical name of a code, as relay.proto and the other
// kvrelay clients write it: "INVALID_ARGUMENT", "DATA_LOSS", ...
func CodeName(c codes.Code) string {
	if name, ok := codeNames[c]; ok {
		return name
	}
	return fmt.Sprintf("CODE_%d", uint32(c))
}

var codeNames = map[codes.Code]string{
	codes.OK: "OK", codes.Canceled: "CANCELLED", codes.Unknown: "UNKNOWN",
	codes.InvalidArgument: "INVALID_ARGUMENT", codes.DeadlineExceeded: "DEADLINE_EXCEEDED",
	codes.NotFound: "NOT_FOUND", codes.AlreadyExists: "ALREADY_EXISTS",
	codes.PermissionDenied: "PERMISSION_DENIED", codes.ResourceExhausted: "RESOURCE_EXHAUSTED",
	codes.FailedPrecondition: "FAILED_PRECONDITION", codes.Aborted: "ABORTED",
	codes.OutOfRange: "OUT_OF_RANGE", codes.Unimplemented: "UNIMPLEMENTED",
	codes.Internal: "INTERNAL", codes.Unavailable: "UNAVAILABLE", codes.DataLoss: "DATA_LOSS",
	codes.Unauthenticated: "UNAUTHENTICATED",
}

// NewMessageID returns a fresh message id: "m-" and 24 random hex digits.
func NewMessageID() string {
	b := make([]byte, 12)
	if _, err := rand.Read(b); err != nil {
		panic(fmt.Sprintf("kvrelay: crypto/rand: %v", err))
	}
	return "m-" + hex.EncodeToString(b)
}

func checkID(field, v string, required bool) error {
	if v == "" && !required {
		return nil
	}
	if !idPattern.MatchString(v) {
		return status.Errorf(codes.InvalidArgument, "%s: %q, expected [A-Za-z0-9._:-]{1,128}", field, v)
	}
	return nil
}

// PublishOptions routes a turn.
type PublishOptions struct {
	SessionID  string   // required
	MessageID  string   // idempotency key; empty: NewMessageID() (the error or result tells which)
	Sender     string   // required: the publishing agent
	Recipients []string // 1..64 distinct agents
	Role       string   // optional; selects the relay's default policy
	Policy     string   // pipeline spec; empty: the role's default
	ParentID   string   // history by reference; the turn then carries none and is sent with FirstAgent false
}

// PublishResult is the relay's answer to a publish.
type PublishResult struct {
	MessageID string
	Duplicate bool // the id was already committed; nothing changed
	// Accounting: bytes, ratio, policy and, for a turn with queries (GenQ),
	// Accounting.AttentionError, the fidelity figure (nil for a turn with
	// PromptScore; see AttentionError).
	Accounting *pb.Accounting
}

// AttentionError is the fidelity figure of an accounting (a PublishResult's,
// or a delivered Message's Header.GetAccounting()): the mean over layers of
// |o_msg - o_full| / |o_full| of the sender's own attention output, and
// true, for a turn with queries; 0 and false when the turn had none (0 is a
// figure, not its absence).
func AttentionError(a *pb.Accounting) (float64, bool) {
	if a == nil || a.AttentionError == nil {
		return 0, false
	}
	return *a.AttentionError, true
}

// PublishError is every error Publish returns: the message id that publish
// used (o.MessageID, or the one generated when that was empty) and what
// failed. Retry a publish whose outcome is unknown with this MessageID, never
// a fresh one: a re-publish of a committed id answers Duplicate = true.
//
//	var pe *kvrelay.PublishError
//	if errors.As(err, &pe) { o.MessageID = pe.MessageID } // then retry with o
type PublishError struct {
	MessageID string
	SessionID string
	Err       error // the gRPC status error (Code and Status find it)
}

func (e *PublishError) Error() string {
	if e.SessionID == "" {
		return fmt.Sprintf("kvrelay: publish %s: %v", e.MessageID, e.Err)
	}
	return fmt.Sprintf("kvrelay: publish %s to session %s: %v", e.MessageID, e.SessionID, e.Err)
}

// Unwrap returns Err.
func (e *PublishError) Unwrap() error { return e.Err }

// Publish uploads turn for o.Recipients: the header, every tensor as
// CRC32C-checked chunks in relay.proto's order, and the commit trailer.
// Errors are *PublishError, carrying the message id to retry with.
func (c *Client) Publish(ctx context.Context, turn *Turn, o PublishOptions) (*PublishResult, error) {
	if o.MessageID == "" {
		o.MessageID = NewMessageID()
	}
	fail := func(err error) (*PublishResult, error) {
		return nil, &PublishError{MessageID: o.MessageID, SessionID: o.SessionID, Err: err}
	}
	if err := checkPublish(o); err != nil {
		return fail(err)
	}
	geometry, tensors, err := planUpload(turn)
	if err == nil {
		err = checkHistoryScoreHasHistory(geometry, o.ParentID != "")
	}
	if err != nil {
		return fail(err)
	}
	if o.ParentID != "" {
		geometry.FirstAgent = false // continues a chain: never the first agent's turn
	}
	r, err := c.publish(ctx, &pb.PublishHeader{
		SessionId: o.SessionID, MessageId: o.MessageID, Sender: o.Sender, Recipients: o.Recipients,
		Role: o.Role, Policy: o.Policy, ParentId: o.ParentID, Geometry: geometry,
	}, tensors)
	if err != nil {
		return fail(err)
	}
	return &PublishResult{MessageID: r.GetMessageId(), Duplicate: r.GetDuplicate(), Accounting: r.GetAccounting()}, nil
}

func checkPublish(o PublishOptions) error {
	for _, f := range []struct {
		name, v  string
		required bool
	}{{"session_id", o.SessionID, true}, {"message_id", o.MessageID, true},
		{"sender", o.Sender, true}, {"parent_id", o.ParentID, false}} {
		if err := checkID(f.name, f.v, f.required); err != nil {
			return err
		}
	}
	if !utf8.ValidString(o.Role) || len(o.Role) > 128 {
		return status.Errorf(codes.InvalidArgument, "role: %q, expected UTF-8 of at most 128 bytes", o.Role)
	}
	if !utf8.ValidString(o.Policy) {
		return status.Errorf(codes.InvalidArgument, "policy: %q, expected valid UTF-8 (a pipeline spec is printable ASCII)", o.Policy)
	}
	if len(o.Recipients) == 0 {
		return status.Error(codes.InvalidArgument, "recipients: empty, expected 1..64 agents")
	}
	for i, r := range o.Recipients {
		if err := checkID(fmt.Sprintf("recipients[%d]", i), r, true); err != nil {
			return err
		}
	}
	return nil
}

func (c *Client) publish(ctx context.Context, header *pb.PublishHeader, tensors []uploadTensor) (*pb.PublishResponse, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := c.relay.Publish(ctx)
	if err != nil {
		return nil, err
	}
	err = sendUpload(tensors,
		func() error { return stream.Send(&pb.PublishRequest{Kind: &pb.PublishRequest_Header{Header: header}}) },
		func(ch *pb.Chunk) error {
			return stream.Send(&pb.PublishRequest{Kind: &pb.PublishRequest_Chunk{Chunk: ch}})
		},
		func(t *pb.Trailer) error {
			return stream.Send(&pb.PublishRequest{Kind: &pb.PublishRequest_Commit{Commit: t}})
		})
	if err != nil {
		return nil, err
	}
	return stream.CloseAndRecv()
}

// sendUpload sends an upload stream's header, every tensor's chunks and the
// commit trailer, each through its function (a stream's Send). io.EOF from a
// Send means the relay ended the call early: the reply has its status, so it
// counts as success here.
func sendUpload(tensors []uploadTensor, header func() error, chunk func(*pb.Chunk) error,
	trailer func(*pb.Trailer) error) error {
	err := header()
	if err == nil {
		err = sendChunks(tensors, chunk, trailer)
	}
	if err == io.EOF {
		return nil
	}
	return err
}

// Fetch returns the oldest unacknowledged message for (session, agent),
// waiting for one until ctx's deadline. With autoAck the relay acknowledges
// once it sent the trailer, before this client checked it; prefer Ack once
// the message is safely used.
func (c *Client) Fetch(ctx context.Context, session, agent string, autoAck bool) (*Message, error) {
	if err := checkID("session_id", session, true); err != nil {
		return nil, fmt.Errorf("kvrelay: fetch: %w", err)
	}
	if err := checkID("agent", agent, true); err != nil {
		return nil, fmt.Errorf("kvrelay: fetch: %w", err)
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel() // also cancels the call when the delivery is malformed
	stream, err := c.relay.Fetch(ctx, &pb.FetchRequest{SessionId: session, Agent: agent, AutoAck: autoAck})
	if err != nil {
		return nil, fmt.Errorf("kvrelay: fetch %s/%s: %w", session, agent, err)
	}
	m, err := receive(stream.Recv)
	if err != nil {
		return nil, fmt.Errorf("kvrelay: fetch %s/%s: %w", session, agent, err)
	}
	return m, nil
}

// receive assembles a delivery (header, chunks, trailer) from recv, a
// stream's Recv, until the stream ends.
func receive(recv func() (*pb.FetchResponse, error)) (*Message, error) {
	var a assembler
	for {
		r, err := recv()
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, err
		}
		if err := a.add(r); err != nil {
			return nil, err
		}
	}
	return a.message()
}

// Ack acknowledges a delivered message (NotFound for an unknown one,
// FailedPrecondition for one not yet delivered to agent).
func (c *Client) Ack(ctx context.Context, session, agent, messageID string) error {
	for _, f := range [][2]string{{"session_id", session}, {"agent", agent}, {"message_id", messageID}} {
		if err := checkID(f[0], f[1], true); err != nil {
			return fmt.Errorf("kvrelay: ack: %w", err)
		}
	}
	_, err := c.relay.Ack(ctx, &pb.AckRequest{SessionId: session, Agent: agent, MessageId: messageID})
	if err != nil {
		return fmt.Errorf("kvrelay: ack %s for %s/%s: %w", messageID, session, agent, err)
	}
	return nil
}

// CloseSession frees a session; returns the number of messages freed. Idempotent.
func (c *Client) CloseSession(ctx context.Context, session string) (uint32, error) {
	if err := checkID("session_id", session, true); err != nil {
		return 0, fmt.Errorf("kvrelay: close session: %w", err)
	}
	r, err := c.relay.CloseSession(ctx, &pb.CloseSessionRequest{SessionId: session})
	if err != nil {
		return 0, fmt.Errorf("kvrelay: close session %s: %w", session, err)
	}
	return r.GetMessagesFreed(), nil
}

// Stats returns the relay's counters since it started and what it holds now
// (relay.proto, StatsResponse).
func (c *Client) Stats(ctx context.Context) (*pb.StatsResponse, error) {
	r, err := c.relay.Stats(ctx, &pb.StatsRequest{})
	if err != nil {
		return nil, fmt.Errorf("kvrelay: stats: %w", err)
	}
	return r, nil
}

// Compress uploads turn for stateless compression with policy (a pipeline
// spec, required) and returns the compressed message as Fetch does; the
// relay stores nothing.
func (c *Client) Compress(ctx context.Context, turn *Turn, policy string) (*Message, error) {
	if policy == "" || !utf8.ValidString(policy) {
		return nil, fmt.Errorf("kvrelay: compress: %w", status.Errorf(codes.InvalidArgument,
			"policy: %q, expected a pipeline spec (non-empty, valid UTF-8)", policy))
	}
	geometry, tensors, err := planUpload(turn)
	if err == nil {
		err = checkHistoryScoreHasHistory(geometry, false)
	}
	if err != nil {
		return nil, fmt.Errorf("kvrelay: compress: %w", err)
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel() // also cancels the call when the reply is malformed
	stream, err := c.relay.Compress(ctx)
	if err != nil {
		return nil, fmt.Errorf("kvrelay: compress: %w", err)
	}
	header := &pb.CompressHeader{Policy: policy, Geometry: geometry}
	err = sendUpload(tensors,
		func() error {
			return stream.Send(&pb.CompressRequest{Kind: &pb.CompressRequest_Header{Header: header}})
		},
		func(ch *pb.Chunk) error {
			return stream.Send(&pb.CompressRequest{Kind: &pb.CompressRequest_Chunk{Chunk: ch}})
		},
		func(t *pb.Trailer) error {
			return stream.Send(&pb.CompressRequest{Kind: &pb.CompressRequest_Commit{Commit: t}})
		})
	if err == nil {
		err = stream.CloseSend() // Recv below has the relay's answer either way
	}
	if err != nil {
		return nil, fmt.Errorf("kvrelay: compress: %w", err)
	}
	// The reply has the delivery's shape: the same header, chunks, trailer.
	m, err := receive(func() (*pb.FetchResponse, error) {
		r, err := stream.Recv()
		if err != nil {
			return nil, err
		}
		switch k := r.GetKind().(type) {
		case *pb.CompressResponse_Header:
			return &pb.FetchResponse{Kind: &pb.FetchResponse_Header{Header: k.Header}}, nil
		case *pb.CompressResponse_Chunk:
			return &pb.FetchResponse{Kind: &pb.FetchResponse_Chunk{Chunk: k.Chunk}}, nil
		case *pb.CompressResponse_Trailer:
			return &pb.FetchResponse{Kind: &pb.FetchResponse_Trailer{Trailer: k.Trailer}}, nil
		}
		return &pb.FetchResponse{}, nil // empty: the assembler names it
	})
	if err != nil {
		return nil, fmt.Errorf("kvrelay: compress: %w", err)
	}
	return m, nil
}

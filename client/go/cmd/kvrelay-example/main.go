// Command kvrelay-example publishes one turn file to a relay, fetches the
// composed message as the recipient, writes it as a message file and
// acknowledges it. With -compress it calls the stateless Compress instead
// and writes its reply (nothing is stored; -policy required).
//
//	kvrelay-example -addr 127.0.0.1:50051 -in turn.safetensors -out msg.safetensors \
//	    [-policy SPEC] [-session S] [-from planner] [-to critic] [-id MSGID] [-parent MSGID] [-timeout 60s] \
//	    [-compress] [-tls-ca FILE [-tls-cert FILE -tls-key FILE]] [-token-file FILE]
//
// -parent continues a relayed cache: the turn goes with the parent message's
// id (of the same session, delivered to -from) in place of a history, and
// the relay composes it on the message it holds. The turn file may then carry
// history.score over the parent's tokens.
//
// -tls-ca turns TLS on; the token (first line of -token-file, else
// $KVRELAY_TOKEN) goes with every call as "authorization: Bearer TOKEN".
//
// Exit status: 0 ok, 1 a failed call or bad file, 2 usage error. Errors print
// as "kvrelay-example: STEP: CODE: details", e.g.
// "kvrelay-example: publish: INVALID_ARGUMENT: header.policy '...': ...".
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"strconv"
	"time"

	"github.com/kvrelay/kvrelay/client/go/kvrelay"
	kvrelayv1 "github.com/kvrelay/kvrelay/client/go/kvrelay/v1"
)

type options struct {
	addr, in, out, policy, session, from, to, id, parent string
	tlsCA, tlsCert, tlsKey, tokenFile                    string
	timeout                                              time.Duration
	compress                                             bool
}

// stepError names the step that failed; its message carries the gRPC code
// name when there is one.
type stepError struct {
	step string
	err  error
}

func (e *stepError) Error() string {
	if s, ok := kvrelay.Status(e.err); ok {
		return fmt.Sprintf("%s: %s: %s", e.step, kvrelay.CodeName(s.Code()), s.Message())
	}
	return fmt.Sprintf("%s: %v", e.step, e.err)
}

func (e *stepError) Unwrap() error { return e.err }

// attentionError is " attention_error=X" (X read back exactly) for an
// accounting that has the figure (a turn with queries), else "".
func attentionError(a *kvrelayv1.Accounting) string {
	if e, ok := kvrelay.AttentionError(a); ok {
		return " attention_error=" + strconv.FormatFloat(e, 'g', -1, 64)
	}
	return ""
}

func run(o options) error {
	turn, err := kvrelay.ReadTurnFile(o.in)
	if err != nil {
		return &stepError{"read turn", err}
	}
	ctx, cancel := context.WithTimeout(context.Background(), o.timeout)
	defer cancel()
	sec := kvrelay.Security{CAFile: o.tlsCA, CertFile: o.tlsCert, KeyFile: o.tlsKey}
	if o.tokenFile != "" {
		if sec.Token, err = kvrelay.ReadTokenFile(o.tokenFile); err != nil {
			return &stepError{"read token", err}
		}
	}
	c, err := kvrelay.DialSecure(ctx, o.addr, sec)
	if err != nil {
		return &stepError{"dial", err}
	}
	defer c.Close()

	if o.compress {
		m, err := c.Compress(ctx, turn, o.policy)
		if err != nil {
			return &stepError{"compress", err}
		}
		if err := kvrelay.WriteMessageFile(o.out, m); err != nil {
			return &stepError{"write message", err}
		}
		a := m.Header.GetAccounting()
		fmt.Printf("compressed policy=%s full_bytes=%d sent_bytes=%d ratio=%.3f next_pos=%d out=%s%s\n",
			a.GetPolicy(), a.GetFullBytes(), a.GetSentBytes(), a.GetRatio(), m.NextPos(), o.out, attentionError(a))
		return nil
	}

	id := o.id
	if id == "" {
		id = kvrelay.NewMessageID()
	}
	r, err := c.Publish(ctx, turn, kvrelay.PublishOptions{
		SessionID: o.session, MessageID: id, Sender: o.from, Recipients: []string{o.to}, Policy: o.policy,
		ParentID: o.parent,
	})
	if err != nil {
		return &stepError{"publish", err}
	}
	a := r.Accounting
	fmt.Printf("published message_id=%s duplicate=%t policy=%s full_bytes=%d sent_bytes=%d ratio=%.3f%s\n",
		r.MessageID, r.Duplicate, a.GetPolicy(), a.GetFullBytes(), a.GetSentBytes(), a.GetRatio(), attentionError(a))

	m, err := c.Fetch(ctx, o.session, o.to, false)
	if err != nil {
		return &stepError{"fetch", err}
	}
	// Fetch delivers the oldest unacknowledged message: one left by an
	// earlier run is not ours to write or acknowledge.
	if got := m.Header.GetMessageId(); got != r.MessageID {
		return &stepError{"fetch", fmt.Errorf("got message %s, expected %s (the one just published): session %s "+
			"holds an older unacknowledged message for %s; fetch it with kvrelayctl, or use another -session",
			got, r.MessageID, o.session, o.to)}
	}
	// Acknowledge only once the message is safely on disk.
	if err := kvrelay.WriteMessageFile(o.out, m); err != nil {
		return &stepError{"write message", err}
	}
	h := m.Header
	if err := c.Ack(ctx, o.session, o.to, h.GetMessageId()); err != nil {
		return &stepError{"ack", err}
	}
	fmt.Printf("fetched message_id=%s delivery_attempt=%d layers=%d history=%d anchor=%d kept=%d gen=%d "+
		"quant_bits=%d tensors=%d acked=true out=%s\n",
		h.GetMessageId(), h.GetDeliveryAttempt(), h.GetLayers(), h.GetNHistory(), h.GetNAnchor(), h.GetNKept(),
		h.GetNGen(), h.GetQuantBits(), len(m.Tensors), o.out)
	return nil
}

func main() {
	var o options
	fs := flag.NewFlagSet("kvrelay-example", flag.ContinueOnError)
	fs.StringVar(&o.addr, "addr", "", "relay address HOST:PORT (required)")
	fs.StringVar(&o.in, "in", "", "turn file to publish (required)")
	fs.StringVar(&o.out, "out", "", "where to write the fetched message (required)")
	fs.StringVar(&o.policy, "policy", "", "pipeline spec; empty: the relay's default")
	fs.StringVar(&o.session, "session", "go-example", "session id")
	fs.StringVar(&o.from, "from", "planner", "publishing agent")
	fs.StringVar(&o.to, "to", "critic", "recipient, who then fetches and acks")
	fs.StringVar(&o.id, "id", "", "message id (idempotency key); empty: a fresh one")
	fs.StringVar(&o.parent, "parent", "", "id of the message this turn continues (history by reference)")
	fs.DurationVar(&o.timeout, "timeout", 60*time.Second, "deadline for the whole exchange")
	fs.BoolVar(&o.compress, "compress", false, "call the stateless Compress instead of publish/fetch/ack")
	fs.StringVar(&o.tlsCA, "tls-ca", "", "PEM CA file that signs the relay's certificate; turns TLS on")
	fs.StringVar(&o.tlsCert, "tls-cert", "", "PEM client certificate (mTLS; with -tls-key and -tls-ca)")
	fs.StringVar(&o.tlsKey, "tls-key", "", "PEM key of -tls-cert")
	fs.StringVar(&o.tokenFile, "token-file", "", "file whose first line is the agent's token; default $"+
		kvrelay.TokenEnv)
	if err := fs.Parse(os.Args[1:]); err != nil {
		os.Exit(2)
	}
	usage := func(format string, args ...interface{}) {
		fmt.Fprintf(os.Stderr, "kvrelay-example: "+format+"\n", args...)
		fs.Usage()
		os.Exit(2)
	}
	for _, f := range []struct{ name, v string }{{"addr", o.addr}, {"in", o.in}, {"out", o.out}} {
		if f.v == "" {
			usage("missing required flag -%s", f.name)
		}
	}
	if fs.NArg() > 0 {
		usage("unexpected argument %q", fs.Arg(0))
	}
	if o.compress && o.policy == "" {
		usage("flag -compress needs -policy (Compress has no default policy)")
	}
	if o.compress && o.parent != "" {
		usage("flag -parent: not with -compress (Compress is stateless: it holds no parent message)")
	}
	if (o.tlsCert == "") != (o.tlsKey == "") {
		usage("flags -tls-cert and -tls-key: expected both or neither")
	}
	if o.tlsCert != "" && o.tlsCA == "" {
		usage("flag -tls-cert needs -tls-ca (which turns TLS on)")
	}
	if o.timeout <= 0 {
		usage("flag -timeout: %v, expected > 0", o.timeout)
	}
	if err := run(o); err != nil {
		fmt.Fprintf(os.Stderr, "kvrelay-example: %v\n", err)
		os.Exit(1)
	}
}

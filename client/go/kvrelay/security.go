package kvrelay

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"os"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
)

// TokenEnv is the environment variable a token is taken from when
// Security.Token is empty.
const TokenEnv = "KVRELAY_TOKEN"

// Security says how to reach a relay: TLS (on when CAFile is set), an
// optional client certificate (mTLS) and the agent's bearer token.
//
// The token is sent as "authorization: Bearer TOKEN" metadata on every call,
// over TLS and over plaintext alike: a relay's local listener (a Unix socket
// or loopback port in the agent's pod) is plaintext by design. It never
// appears in this package's errors.
type Security struct {
	// CAFile is a PEM file of the CA certificates that sign the relay's
	// certificate. Non-empty: the channel is TLS; empty: plaintext.
	CAFile string
	// CertFile and KeyFile are the client certificate and its key (PEM),
	// both or neither; they need CAFile.
	CertFile, KeyFile string
	// ServerName overrides the name the relay's certificate is checked
	// against (default: the host of the address dialled).
	ServerName string
	// Token is the bearer token; empty: $KVRELAY_TOKEN; both empty: no
	// authorization metadata.
	Token string
}

// DialOptions are the transport and per-call credentials for s, for Dial or
// grpc.DialContext. Errors name the file or field at fault.
func (s Security) DialOptions() ([]grpc.DialOption, error) {
	var opts []grpc.DialOption
	if s.CAFile == "" {
		if s.CertFile != "" || s.KeyFile != "" {
			return nil, fmt.Errorf("kvrelay: tls cert/key: given without a CA file, expected a CA file too " +
				"(it turns TLS on)")
		}
		if s.ServerName != "" {
			return nil, fmt.Errorf("kvrelay: tls server name: given without a CA file, expected a CA file too")
		}
		opts = append(opts, grpc.WithTransportCredentials(insecure.NewCredentials()))
	} else {
		cfg, err := s.tlsConfig()
		if err != nil {
			return nil, err
		}
		opts = append(opts, grpc.WithTransportCredentials(credentials.NewTLS(cfg)))
	}
	token := s.Token
	if token == "" {
		token = os.Getenv(TokenEnv)
	}
	if token != "" {
		creds, err := TokenCredentials(token)
		if err != nil {
			return nil, err
		}
		opts = append(opts, grpc.WithPerRPCCredentials(creds))
	}
	return opts, nil
}

func (s Security) tlsConfig() (*tls.Config, error) {
	pem, err := os.ReadFile(s.CAFile)
	if err != nil {
		return nil, fmt.Errorf("kvrelay: tls CA file: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("kvrelay: tls CA file %s: no PEM certificate, expected one or more", s.CAFile)
	}
	cfg := &tls.Config{RootCAs: pool, ServerName: s.ServerName, MinVersion: tls.VersionTLS12}
	if (s.CertFile == "") != (s.KeyFile == "") {
		return nil, fmt.Errorf("kvrelay: tls cert %q and key %q: expected both or neither", s.CertFile, s.KeyFile)
	}
	if s.CertFile != "" {
		pair, err := tls.LoadX509KeyPair(s.CertFile, s.KeyFile)
		if err != nil {
			return nil, fmt.Errorf("kvrelay: tls cert %s and key %s: %w", s.CertFile, s.KeyFile, err)
		}
		cfg.Certificates = []tls.Certificate{pair}
	}
	return cfg, nil
}

// DialSecure is Dial with the credentials of s, then opts.
func DialSecure(ctx context.Context, addr string, s Security, opts ...grpc.DialOption) (*Client, error) {
	base, err := s.DialOptions()
	if err != nil {
		return nil, err
	}
	return Dial(ctx, addr, append(base, opts...)...)
}

// TokenCredentials sends token as "authorization: Bearer TOKEN" on every
// call, also over a plaintext channel (RequireTransportSecurity is false).
// A token must be visible ASCII (0x21..0x7e), as an HTTP/2 header value
// allows; the error says where it is not, without the token.
func TokenCredentials(token string) (credentials.PerRPCCredentials, error) {
	if token == "" {
		return nil, fmt.Errorf("kvrelay: token: empty, expected a bearer token")
	}
	for i := 0; i < len(token); i++ {
		if c := token[i]; c < 0x21 || c > 0x7e {
			return nil, fmt.Errorf("kvrelay: token: byte %d of %d is 0x%02x, expected visible ASCII (0x21..0x7e)",
				i, len(token), c)
		}
	}
	return bearer{"Bearer " + token}, nil
}

type bearer struct{ value string }

func (b bearer) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return map[string]string{"authorization": b.value}, nil
}

func (bearer) RequireTransportSecurity() bool { return false }

// ReadTokenFile returns the first line of the file at path, surrounding
// whitespace trimmed (a tokens file written by an editor or a Secret mount
// may end in a newline). An empty first line is an error.
func ReadTokenFile(path string) (string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", fmt.Errorf("kvrelay: token file: %w", err)
	}
	line := string(b)
	if i := strings.IndexByte(line, '\n'); i >= 0 {
		line = line[:i]
	}
	token := strings.TrimSpace(line)
	if token == "" {
		return "", fmt.Errorf("kvrelay: token file %s: first line empty, expected the token", path)
	}
	return token, nil
}

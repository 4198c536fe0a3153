package kvrelay

import (
	"fmt"

	"google.golang.org/protobuf/proto"
)

// protoCodec marshals messages with google.golang.org/protobuf (the API that
// protoc-gen-go generates for). grpc-go before 1.35 (Debian 12 ships 1.33)
// marshals through github.com/golang/protobuf, which at v1.3 cannot encode
// the oneofs of code from protoc-gen-go >= 1.20; forcing this codec on every
// call works with old and new grpc-go alike. The wire format is the same
// ("application/grpc+proto").
type protoCodec struct{}

func (protoCodec) Marshal(v interface{}) ([]byte, error) {
	m, ok := v.(proto.Message)
	if !ok {
		return nil, fmt.Errorf("kvrelay: codec: %T is not a proto.Message", v)
	}
	return proto.Marshal(m)
}

func (protoCodec) Unmarshal(data []byte, v interface{}) error {
	m, ok := v.(proto.Message)
	if !ok {
		return fmt.Errorf("kvrelay: codec: %T is not a proto.Message", v)
	}
	return proto.Unmarshal(data, m)
}

func (protoCodec) Name() string { return "proto" }

"""kvrelay: Python client of the kvrelay relay (proto/kvrelay/v1/relay.proto).

    import kvrelay
    c = kvrelay.Client("127.0.0.1:50051")
    r = c.publish(turn, session="s1", sender="planner", recipients=["critic"],
                  policy="h2o-head:k=32+obf:p=8")
    m = c.fetch("s1", "critic", timeout=30)
    c.ack("s1", "critic", m.message_id)

The generated stubs are the subpackage kvrelay.v1. The client (and grpc) is
imported on first use of Client and its companions, so offline use (Turn,
safetensors, dequantize_layer, ...) needs neither; nothing here imports torch
(kvrelay.hf does, when imported).
"""
from kvrelay._crc32c import crc32c, crc32c_combine
from kvrelay.types import (Accounting, Message, MessageLayer, PublishResult,
                           QuantizedLayer, Stats, Turn, TurnLayer, bf16_to_f32,
                           dequantize_layer, f32_to_bf16, hadamard_f32)
from kvrelay import safetensors

_CLIENT_NAMES = ("Client", "RelayError", "PublishError", "MAX_CHUNK_BYTES", "new_message_id", "TOKEN_ENV")


def __getattr__(name):  # PEP 562: the client on first use
    if name in _CLIENT_NAMES:
        from kvrelay import client
        return getattr(client, name)
    raise AttributeError(f"module 'kvrelay' has no attribute {name!r}")

__all__ = [
    "Client", "RelayError", "PublishError", "Turn", "TurnLayer", "Message", "MessageLayer", "QuantizedLayer",
    "Accounting", "PublishResult", "Stats", "MAX_CHUNK_BYTES", "new_message_id",
    "crc32c", "crc32c_combine", "f32_to_bf16", "bf16_to_f32", "dequantize_layer",
    "hadamard_f32", "safetensors",
]

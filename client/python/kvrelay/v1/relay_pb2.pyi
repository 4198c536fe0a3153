from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_F32: _ClassVar[DType]
    DTYPE_F16: _ClassVar[DType]
    DTYPE_BF16: _ClassVar[DType]

class Part(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PART_UNSPECIFIED: _ClassVar[Part]
    PART_PROMPT_K: _ClassVar[Part]
    PART_PROMPT_V: _ClassVar[Part]
    PART_GEN_K: _ClassVar[Part]
    PART_GEN_V: _ClassVar[Part]
    PART_PROMPT_SCORE: _ClassVar[Part]
    PART_HISTORY_K: _ClassVar[Part]
    PART_HISTORY_V: _ClassVar[Part]
    PART_HISTORY_POS: _ClassVar[Part]
    PART_GEN_Q: _ClassVar[Part]
    PART_HISTORY_SCORE: _ClassVar[Part]
    PART_K: _ClassVar[Part]
    PART_V: _ClassVar[Part]
    PART_POS: _ClassVar[Part]
    PART_K_CODES: _ClassVar[Part]
    PART_K_SCALE: _ClassVar[Part]
    PART_K_ZERO: _ClassVar[Part]
    PART_V_CODES: _ClassVar[Part]
    PART_V_SCALE: _ClassVar[Part]
    PART_V_ZERO: _ClassVar[Part]
    PART_ACC: _ClassVar[Part]
    PART_DEMOTED_K_CODES: _ClassVar[Part]
    PART_DEMOTED_K_NORM: _ClassVar[Part]
    PART_DEMOTED_V_CODES: _ClassVar[Part]
    PART_DEMOTED_V_NORM: _ClassVar[Part]

class QuantScheme(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    QUANT_SCHEME_INT: _ClassVar[QuantScheme]
    QUANT_SCHEME_LLOYD: _ClassVar[QuantScheme]

class RecipientState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RECIPIENT_STATE_UNSPECIFIED: _ClassVar[RecipientState]
    RECIPIENT_STATE_QUEUED: _ClassVar[RecipientState]
    RECIPIENT_STATE_COMMITTED: _ClassVar[RecipientState]
    RECIPIENT_STATE_DELIVERED: _ClassVar[RecipientState]
    RECIPIENT_STATE_ACKED: _ClassVar[RecipientState]
    RECIPIENT_STATE_DEAD_LETTERED: _ClassVar[RecipientState]
DTYPE_UNSPECIFIED: DType
DTYPE_F32: DType
DTYPE_F16: DType
DTYPE_BF16: DType
PART_UNSPECIFIED: Part
PART_PROMPT_K: Part
PART_PROMPT_V: Part
PART_GEN_K: Part
PART_GEN_V: Part
PART_PROMPT_SCORE: Part
PART_HISTORY_K: Part
PART_HISTORY_V: Part
PART_HISTORY_POS: Part
PART_GEN_Q: Part
PART_HISTORY_SCORE: Part
PART_K: Part
PART_V: Part
PART_POS: Part
PART_K_CODES: Part
PART_K_SCALE: Part
PART_K_ZERO: Part
PART_V_CODES: Part
PART_V_SCALE: Part
PART_V_ZERO: Part
PART_ACC: Part
PART_DEMOTED_K_CODES: Part
PART_DEMOTED_K_NORM: Part
PART_DEMOTED_V_CODES: Part
PART_DEMOTED_V_NORM: Part
QUANT_SCHEME_INT: QuantScheme
QUANT_SCHEME_LLOYD: QuantScheme
RECIPIENT_STATE_UNSPECIFIED: RecipientState
RECIPIENT_STATE_QUEUED: RecipientState
RECIPIENT_STATE_COMMITTED: RecipientState
RECIPIENT_STATE_DELIVERED: RecipientState
RECIPIENT_STATE_ACKED: RecipientState
RECIPIENT_STATE_DEAD_LETTERED: RecipientState

class TurnGeometry(_message.Message):
    __slots__ = ("layers", "kv_heads", "score_heads", "head_dim", "dtype", "n_prompt", "n_gen", "n_history", "first_agent", "prompt_pos0", "query_dtype", "softmax_scale", "history_anchors", "history_score_tokens")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    SCORE_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    N_PROMPT_FIELD_NUMBER: _ClassVar[int]
    N_GEN_FIELD_NUMBER: _ClassVar[int]
    N_HISTORY_FIELD_NUMBER: _ClassVar[int]
    FIRST_AGENT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_POS0_FIELD_NUMBER: _ClassVar[int]
    QUERY_DTYPE_FIELD_NUMBER: _ClassVar[int]
    SOFTMAX_SCALE_FIELD_NUMBER: _ClassVar[int]
    HISTORY_ANCHORS_FIELD_NUMBER: _ClassVar[int]
    HISTORY_SCORE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    layers: int
    kv_heads: int
    score_heads: int
    head_dim: int
    dtype: DType
    n_prompt: int
    n_gen: int
    n_history: int
    first_agent: bool
    prompt_pos0: int
    query_dtype: DType
    softmax_scale: float
    history_anchors: _containers.RepeatedScalarFieldContainer[int]
    history_score_tokens: int
    def __init__(self, layers: _Optional[int] = ..., kv_heads: _Optional[int] = ..., score_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., n_prompt: _Optional[int] = ..., n_gen: _Optional[int] = ..., n_history: _Optional[int] = ..., first_agent: _Optional[bool] = ..., prompt_pos0: _Optional[int] = ..., query_dtype: _Optional[_Union[DType, str]] = ..., softmax_scale: _Optional[float] = ..., history_anchors: _Optional[_Iterable[int]] = ..., history_score_tokens: _Optional[int] = ...) -> None: ...

class PublishHeader(_message.Message):
    __slots__ = ("session_id", "message_id", "sender", "recipients", "role", "policy", "parent_id", "geometry")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    RECIPIENTS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    PARENT_ID_FIELD_NUMBER: _ClassVar[int]
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    message_id: str
    sender: str
    recipients: _containers.RepeatedScalarFieldContainer[str]
    role: str
    policy: str
    parent_id: str
    geometry: TurnGeometry
    def __init__(self, session_id: _Optional[str] = ..., message_id: _Optional[str] = ..., sender: _Optional[str] = ..., recipients: _Optional[_Iterable[str]] = ..., role: _Optional[str] = ..., policy: _Optional[str] = ..., parent_id: _Optional[str] = ..., geometry: _Optional[_Union[TurnGeometry, _Mapping]] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("layer", "part", "offset", "data", "crc32c")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    layer: int
    part: Part
    offset: int
    data: bytes
    crc32c: int
    def __init__(self, layer: _Optional[int] = ..., part: _Optional[_Union[Part, str]] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., crc32c: _Optional[int] = ...) -> None: ...

class Trailer(_message.Message):
    __slots__ = ("chunks", "bytes", "crc32c")
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    chunks: int
    bytes: int
    crc32c: int
    def __init__(self, chunks: _Optional[int] = ..., bytes: _Optional[int] = ..., crc32c: _Optional[int] = ...) -> None: ...

class PublishRequest(_message.Message):
    __slots__ = ("header", "chunk", "commit")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    header: PublishHeader
    chunk: Chunk
    commit: Trailer
    def __init__(self, header: _Optional[_Union[PublishHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., commit: _Optional[_Union[Trailer, _Mapping]] = ...) -> None: ...

class Accounting(_message.Message):
    __slots__ = ("received_bytes", "full_bytes", "sent_bytes", "ratio", "compress_seconds", "commit_seconds", "policy", "attention_error")
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    FULL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    RATIO_FIELD_NUMBER: _ClassVar[int]
    COMPRESS_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMMIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_ERROR_FIELD_NUMBER: _ClassVar[int]
    received_bytes: int
    full_bytes: int
    sent_bytes: int
    ratio: float
    compress_seconds: float
    commit_seconds: float
    policy: str
    attention_error: float
    def __init__(self, received_bytes: _Optional[int] = ..., full_bytes: _Optional[int] = ..., sent_bytes: _Optional[int] = ..., ratio: _Optional[float] = ..., compress_seconds: _Optional[float] = ..., commit_seconds: _Optional[float] = ..., policy: _Optional[str] = ..., attention_error: _Optional[float] = ...) -> None: ...

class PublishResponse(_message.Message):
    __slots__ = ("message_id", "accounting", "duplicate")
    MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    ACCOUNTING_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    message_id: str
    accounting: Accounting
    duplicate: bool
    def __init__(self, message_id: _Optional[str] = ..., accounting: _Optional[_Union[Accounting, _Mapping]] = ..., duplicate: _Optional[bool] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("session_id", "agent", "auto_ack")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_FIELD_NUMBER: _ClassVar[int]
    AUTO_ACK_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    agent: str
    auto_ack: bool
    def __init__(self, session_id: _Optional[str] = ..., agent: _Optional[str] = ..., auto_ack: _Optional[bool] = ...) -> None: ...

class MessageHeader(_message.Message):
    __slots__ = ("message_id", "session_id", "sender", "role", "parent_id", "layers", "kv_heads", "head_dim", "dtype", "n_history", "n_anchor", "n_kept", "n_gen", "quant_bits", "quant_group", "quant_rotate", "accounting", "delivery_attempt", "next_pos", "anchor_pos", "acc_tokens", "quant_scheme", "quant_keys_channel", "quant_seed", "n_demoted", "demote_bits")
    MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    PARENT_ID_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    N_HISTORY_FIELD_NUMBER: _ClassVar[int]
    N_ANCHOR_FIELD_NUMBER: _ClassVar[int]
    N_KEPT_FIELD_NUMBER: _ClassVar[int]
    N_GEN_FIELD_NUMBER: _ClassVar[int]
    QUANT_BITS_FIELD_NUMBER: _ClassVar[int]
    QUANT_GROUP_FIELD_NUMBER: _ClassVar[int]
    QUANT_ROTATE_FIELD_NUMBER: _ClassVar[int]
    ACCOUNTING_FIELD_NUMBER: _ClassVar[int]
    DELIVERY_ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    NEXT_POS_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_POS_FIELD_NUMBER: _ClassVar[int]
    ACC_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUANT_SCHEME_FIELD_NUMBER: _ClassVar[int]
    QUANT_KEYS_CHANNEL_FIELD_NUMBER: _ClassVar[int]
    QUANT_SEED_FIELD_NUMBER: _ClassVar[int]
    N_DEMOTED_FIELD_NUMBER: _ClassVar[int]
    DEMOTE_BITS_FIELD_NUMBER: _ClassVar[int]
    message_id: str
    session_id: str
    sender: str
    role: str
    parent_id: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: DType
    n_history: int
    n_anchor: int
    n_kept: int
    n_gen: int
    quant_bits: int
    quant_group: int
    quant_rotate: bool
    accounting: Accounting
    delivery_attempt: int
    next_pos: int
    anchor_pos: _containers.RepeatedScalarFieldContainer[int]
    acc_tokens: int
    quant_scheme: QuantScheme
    quant_keys_channel: bool
    quant_seed: int
    n_demoted: int
    demote_bits: int
    def __init__(self, message_id: _Optional[str] = ..., session_id: _Optional[str] = ..., sender: _Optional[str] = ..., role: _Optional[str] = ..., parent_id: _Optional[str] = ..., layers: _Optional[int] = ..., kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., n_history: _Optional[int] = ..., n_anchor: _Optional[int] = ..., n_kept: _Optional[int] = ..., n_gen: _Optional[int] = ..., quant_bits: _Optional[int] = ..., quant_group: _Optional[int] = ..., quant_rotate: _Optional[bool] = ..., accounting: _Optional[_Union[Accounting, _Mapping]] = ..., delivery_attempt: _Optional[int] = ..., next_pos: _Optional[int] = ..., anchor_pos: _Optional[_Iterable[int]] = ..., acc_tokens: _Optional[int] = ..., quant_scheme: _Optional[_Union[QuantScheme, str]] = ..., quant_keys_channel: _Optional[bool] = ..., quant_seed: _Optional[int] = ..., n_demoted: _Optional[int] = ..., demote_bits: _Optional[int] = ...) -> None: ...

class FetchResponse(_message.Message):
    __slots__ = ("header", "chunk", "trailer")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    header: MessageHeader
    chunk: Chunk
    trailer: Trailer
    def __init__(self, header: _Optional[_Union[MessageHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., trailer: _Optional[_Union[Trailer, _Mapping]] = ...) -> None: ...

class AckRequest(_message.Message):
    __slots__ = ("session_id", "agent", "message_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    agent: str
    message_id: str
    def __init__(self, session_id: _Optional[str] = ..., agent: _Optional[str] = ..., message_id: _Optional[str] = ...) -> None: ...

class AckResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id", "propagated")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROPAGATED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    propagated: bool
    def __init__(self, session_id: _Optional[str] = ..., propagated: _Optional[bool] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ("messages_freed",)
    MESSAGES_FREED_FIELD_NUMBER: _ClassVar[int]
    messages_freed: int
    def __init__(self, messages_freed: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("messages_committed", "messages_failed", "messages_delivered", "messages_acked", "received_bytes", "full_bytes", "sent_bytes", "sessions", "mailbox_messages", "mailbox_bytes", "inflight_bytes", "version", "store_bytes")
    MESSAGES_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FAILED_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_DELIVERED_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_ACKED_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    FULL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAILBOX_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    MAILBOX_BYTES_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STORE_BYTES_FIELD_NUMBER: _ClassVar[int]
    messages_committed: int
    messages_failed: int
    messages_delivered: int
    messages_acked: int
    received_bytes: int
    full_bytes: int
    sent_bytes: int
    sessions: int
    mailbox_messages: int
    mailbox_bytes: int
    inflight_bytes: int
    version: str
    store_bytes: int
    def __init__(self, messages_committed: _Optional[int] = ..., messages_failed: _Optional[int] = ..., messages_delivered: _Optional[int] = ..., messages_acked: _Optional[int] = ..., received_bytes: _Optional[int] = ..., full_bytes: _Optional[int] = ..., sent_bytes: _Optional[int] = ..., sessions: _Optional[int] = ..., mailbox_messages: _Optional[int] = ..., mailbox_bytes: _Optional[int] = ..., inflight_bytes: _Optional[int] = ..., version: _Optional[str] = ..., store_bytes: _Optional[int] = ...) -> None: ...

class CompressHeader(_message.Message):
    __slots__ = ("policy", "geometry")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    policy: str
    geometry: TurnGeometry
    def __init__(self, policy: _Optional[str] = ..., geometry: _Optional[_Union[TurnGeometry, _Mapping]] = ...) -> None: ...

class CompressRequest(_message.Message):
    __slots__ = ("header", "chunk", "commit")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    header: CompressHeader
    chunk: Chunk
    commit: Trailer
    def __init__(self, header: _Optional[_Union[CompressHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., commit: _Optional[_Union[Trailer, _Mapping]] = ...) -> None: ...

class CompressResponse(_message.Message):
    __slots__ = ("header", "chunk", "trailer")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    header: MessageHeader
    chunk: Chunk
    trailer: Trailer
    def __init__(self, header: _Optional[_Union[MessageHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., trailer: _Optional[_Union[Trailer, _Mapping]] = ...) -> None: ...

class MessageStatusRequest(_message.Message):
    __slots__ = ("session_id", "message_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    message_id: str
    def __init__(self, session_id: _Optional[str] = ..., message_id: _Optional[str] = ...) -> None: ...

class RecipientStatus(_message.Message):
    __slots__ = ("agent", "state", "relay", "reason", "attempts")
    AGENT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    agent: str
    state: RecipientState
    relay: str
    reason: str
    attempts: int
    def __init__(self, agent: _Optional[str] = ..., state: _Optional[_Union[RecipientState, str]] = ..., relay: _Optional[str] = ..., reason: _Optional[str] = ..., attempts: _Optional[int] = ...) -> None: ...

class MessageStatusResponse(_message.Message):
    __slots__ = ("sender", "recipients", "forwarded_by")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    RECIPIENTS_FIELD_NUMBER: _ClassVar[int]
    FORWARDED_BY_FIELD_NUMBER: _ClassVar[int]
    sender: str
    recipients: _containers.RepeatedCompositeFieldContainer[RecipientStatus]
    forwarded_by: str
    def __init__(self, sender: _Optional[str] = ..., recipients: _Optional[_Iterable[_Union[RecipientStatus, _Mapping]]] = ..., forwarded_by: _Optional[str] = ...) -> None: ...

class ForwardHeader(_message.Message):
    __slots__ = ("protocol_version", "origin", "message", "recipients", "requested_policy", "geometry", "ancestor_id", "ancestor_tokens")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RECIPIENTS_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_POLICY_FIELD_NUMBER: _ClassVar[int]
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    ANCESTOR_ID_FIELD_NUMBER: _ClassVar[int]
    ANCESTOR_TOKENS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    origin: str
    message: MessageHeader
    recipients: _containers.RepeatedScalarFieldContainer[str]
    requested_policy: str
    geometry: TurnGeometry
    ancestor_id: str
    ancestor_tokens: int
    def __init__(self, protocol_version: _Optional[int] = ..., origin: _Optional[str] = ..., message: _Optional[_Union[MessageHeader, _Mapping]] = ..., recipients: _Optional[_Iterable[str]] = ..., requested_policy: _Optional[str] = ..., geometry: _Optional[_Union[TurnGeometry, _Mapping]] = ..., ancestor_id: _Optional[str] = ..., ancestor_tokens: _Optional[int] = ...) -> None: ...

class ForwardCommit(_message.Message):
    __slots__ = ("trailer", "accounting", "next_pos")
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    ACCOUNTING_FIELD_NUMBER: _ClassVar[int]
    NEXT_POS_FIELD_NUMBER: _ClassVar[int]
    trailer: Trailer
    accounting: Accounting
    next_pos: int
    def __init__(self, trailer: _Optional[_Union[Trailer, _Mapping]] = ..., accounting: _Optional[_Union[Accounting, _Mapping]] = ..., next_pos: _Optional[int] = ...) -> None: ...

class ForwardRequest(_message.Message):
    __slots__ = ("header", "chunk", "commit")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    header: ForwardHeader
    chunk: Chunk
    commit: ForwardCommit
    def __init__(self, header: _Optional[_Union[ForwardHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., commit: _Optional[_Union[ForwardCommit, _Mapping]] = ...) -> None: ...

class ForwardResult(_message.Message):
    __slots__ = ("agent", "code", "message", "duplicate")
    AGENT_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    agent: str
    code: int
    message: str
    duplicate: bool
    def __init__(self, agent: _Optional[str] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., duplicate: _Optional[bool] = ...) -> None: ...

class ForwardResponse(_message.Message):
    __slots__ = ("ancestor_missing", "results")
    ANCESTOR_MISSING_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    ancestor_missing: bool
    results: _containers.RepeatedCompositeFieldContainer[ForwardResult]
    def __init__(self, ancestor_missing: _Optional[bool] = ..., results: _Optional[_Iterable[_Union[ForwardResult, _Mapping]]] = ...) -> None: ...

class ReportRecipientRequest(_message.Message):
    __slots__ = ("session_id", "message_id", "agent", "state")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    message_id: str
    agent: str
    state: RecipientState
    def __init__(self, session_id: _Optional[str] = ..., message_id: _Optional[str] = ..., agent: _Optional[str] = ..., state: _Optional[_Union[RecipientState, str]] = ...) -> None: ...

class ReportRecipientResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

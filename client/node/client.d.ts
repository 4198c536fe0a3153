// TypeScript declarations of client.js: the kvrelay.v1.Relay client.
// Every name client.js exports is declared here, and nothing else
// (tests/client/node/test_node_client.py compares the two lists).
//
// Message fields are as @grpc/proto-loader gives them with the options of
// loadRelayService: camelCase names, enums as their names ('DTYPE_F32'),
// 64-bit integers as numbers, every field present (its default when unset).

/// <reference types="node" />
import type * as grpc from '@grpc/grpc-js';

// ---- turns (what publish and compress upload) ---------------------------------

/** The K/V dtype of a turn. */
export type KvDtype = 'F32' | 'F16' | 'BF16';

/**
 * Little-endian tensor bytes: a Uint8Array or Buffer, or another typed array
 * or DataView, taken as its bytes (BF16 as its 16-bit patterns, scores F32,
 * positions I32).
 */
export type TensorBytes = ArrayBufferView;

/** One layer of a turn. The attention input is exactly one of promptScore and genQ, the same one in every layer. */
export interface TurnLayer {
  /** [kvHeads, nPrompt, headDim] in the turn's dtype. */
  promptK: TensorBytes;
  promptV: TensorBytes;
  /** [kvHeads, nGen, headDim] in the turn's dtype. */
  genK: TensorBytes;
  genV: TensorBytes;
  /** F32 [scoreHeads, nPrompt]: the attention mass on each prompt token (without queryDtype). */
  promptScore?: TensorBytes | null;
  /** [scoreHeads, nGen, headDim] in queryDtype: the generated steps' post-RoPE queries (with queryDtype). */
  genQ?: TensorBytes | null;
  /** F32 [scoreHeads, historyScoreTokens]: the attention mass on each history token, in every layer or none. */
  historyScore?: TensorBytes | null;
  /** [kvHeads, nHistory, headDim] in the turn's dtype, with nHistory > 0. */
  historyK?: TensorBytes | null;
  historyV?: TensorBytes | null;
  /** I32 [kvHeads, nHistory]: the history's position ids. */
  historyPos?: TensorBytes | null;
}

/**
 * One agent turn, as publish() and compress() upload it and readTurnFile()
 * reads it. Sizes are integers 0..2^32-1. See planUpload in client.js for
 * the rules the client checks before any call.
 */
export interface Turn {
  dtype: KvDtype;
  kvHeads: number;
  scoreHeads: number;
  headDim: number;
  nPrompt: number;
  nGen: number;
  /** Unset: 0. */
  nHistory?: number | null;
  /** Unset: nHistory === 0 (the chain's first agent). publish() with parentId sends false. */
  firstAgent?: boolean | null;
  /** Position id of the first prompt token; unset: after the history or the parent. */
  promptPos0?: number | null;
  /** 'F32' or the K/V dtype: the layers carry genQ; unset (or ''): they carry promptScore. */
  queryDtype?: KvDtype | '' | null;
  /** The logit scale for genQ, in [1e-6, 1e3]; unset: 1/sqrt(headDim). */
  softmaxScale?: number | null;
  /** Position ids of the chain's anchors the uploaded history holds, ascending (a header's anchorPos). */
  historyAnchors?: ArrayLike<number> | null;
  /** Columns of historyScore: nHistory (its default), or with a parentId the parent's tokens per head. */
  historyScoreTokens?: number | null;
  layers: TurnLayer[];
}

/** Upload part names of relay.proto's Part enum. */
export type UploadPart =
  | 'PART_PROMPT_K' | 'PART_PROMPT_V' | 'PART_GEN_K' | 'PART_GEN_V' | 'PART_PROMPT_SCORE' | 'PART_GEN_Q'
  | 'PART_HISTORY_SCORE' | 'PART_HISTORY_K' | 'PART_HISTORY_V' | 'PART_HISTORY_POS';

/** Delivery part names of relay.proto's Part enum (a message's tensors). */
export type MessagePart =
  | 'PART_K' | 'PART_V' | 'PART_POS' | 'PART_K_CODES' | 'PART_K_SCALE' | 'PART_K_ZERO' | 'PART_V_CODES'
  | 'PART_V_SCALE' | 'PART_V_ZERO';

/** relay.proto's DType enum as proto-loader names it. */
export type DTypeName = 'DTYPE_UNSPECIFIED' | 'DTYPE_F32' | 'DTYPE_F16' | 'DTYPE_BF16';

/** relay.proto's TurnGeometry as planUpload() builds it (optional fields only when set). */
export interface TurnGeometry {
  layers: number;
  kvHeads: number;
  scoreHeads: number;
  headDim: number;
  dtype: DTypeName;
  nPrompt: number;
  nGen: number;
  nHistory: number;
  firstAgent: boolean;
  promptPos0?: number;
  queryDtype?: DTypeName;
  softmaxScale?: number;
  historyAnchors?: number[];
  historyScoreTokens?: number;
}

/** One tensor of an upload, in upload order. */
export interface UploadTensor {
  layer: number;
  part: UploadPart;
  data: Uint8Array;
}

/** What planUpload() returns. */
export interface UploadPlan {
  geometry: TurnGeometry;
  tensors: UploadTensor[];
}

/** relay.proto's Chunk as proto-loader gives it. */
export interface Chunk {
  layer: number;
  part: string;
  offset: number;
  data: Uint8Array;
  crc32c: number;
}

/** relay.proto's Trailer. */
export interface Trailer {
  chunks: number;
  bytes: number;
  crc32c: number;
}

/** The requests chunkRequests() yields: every chunk, then the commit. */
export type UploadRequest = { chunk: Chunk } | { commit: Trailer };

// ---- messages (what fetch and compress resolve to) ----------------------------

/**
 * relay.proto's Accounting (docs/FORMAT.md, "Byte accounting"), as this
 * client hands it out.
 */
export interface Accounting {
  receivedBytes: number;
  fullBytes: number;
  sentBytes: number;
  /** fullBytes / sentBytes */
  ratio: number;
  compressSeconds: number;
  commitSeconds: number;
  /** The canonical pipeline spec that was applied. */
  policy: string;
  /** The fidelity figure for a turn with queries (genQ), 0 included; null for a turn with scores. */
  attentionError: number | null;
}

/** relay.proto's MessageHeader. */
export interface MessageHeader {
  messageId: string;
  sessionId: string;
  sender: string;
  role: string;
  parentId: string;
  layers: number;
  kvHeads: number;
  headDim: number;
  dtype: DTypeName;
  nHistory: number;
  nAnchor: number;
  nKept: number;
  nGen: number;
  /** 0: dense PART_K/PART_V; else 2, 4 or 8 with packed parts. */
  quantBits: number;
  quantGroup: number;
  quantRotate: boolean;
  /** Set by every relay; null only if a relay sent none. */
  accounting: Accounting | null;
  /** 1 on first delivery. */
  deliveryAttempt: number;
  nextPos: number;
  anchorPos: number[];
  accTokens: number;
}

/** Safetensors dtype of a delivered tensor. */
export type MessageDtype = KvDtype | 'I32' | 'U8';

/** One tensor of a delivered message, named as in the message file format (docs/FORMAT.md). */
export interface MessageTensor {
  /** 'layer.0.k', 'layer.0.k.codes', ... */
  name: string;
  layer: number;
  part: MessagePart;
  dtype: MessageDtype;
  shape: number[];
  /** Little-endian bytes. */
  data: Buffer;
}

/** A delivered message: what fetch() and compress() resolve to. */
export interface Message {
  header: MessageHeader;
  /** In delivery order; quantized messages stay packed. */
  tensors: MessageTensor[];
  /** The position id the receiver's own tokens start at (see nextPos()). */
  nextPos: number;
}

/** relay.proto's StatsResponse: the relay's counters. */
export interface StatsResponse {
  messagesCommitted: number;
  messagesFailed: number;
  messagesDelivered: number;
  messagesAcked: number;
  receivedBytes: number;
  fullBytes: number;
  sentBytes: number;
  sessions: number;
  mailboxMessages: number;
  mailboxBytes: number;
  inflightBytes: number;
  version: string;
  storeBytes: number;
}

// ---- errors ---------------------------------------------------------------------

/** A gRPC status code's name: 'OK', 'INVALID_ARGUMENT', ... */
export type StatusName = keyof typeof grpc.status;

/**
 * An error this client detected itself, shaped like a gRPC status error:
 * DATA_LOSS for every malformed delivery (out of order or missing chunks,
 * bad sizes, a header that describes no valid message, a sentBytes, CRC32C
 * or trailer mismatch), INVALID_ARGUMENT, before any call, for an argument
 * that cannot be sent.
 */
export declare class RelayError extends Error {
  constructor(code: grpc.status, details: string);
  name: 'RelayError';
  code: grpc.status;
  details: string;
  /** Set on every error publish() rejects with. */
  messageId?: string;
}

/**
 * What every method of RelayClient rejects with: the relay's gRPC status
 * error or a RelayError. Nothing is retried.
 */
export type RelayStatusError = RelayError | grpc.ServiceError;

/**
 * What publish() rejects with: it carries the message id the publish used
 * (yours or the generated one); retry with it when the outcome is unknown.
 */
export type PublishError = RelayStatusError & { messageId: string };

// ---- the client -----------------------------------------------------------------

/** PEM bytes, or the path of a PEM file. */
export type PemOption = string | Buffer | Uint8Array;

/** The TLS options of channelCredentials() and RelayClient. */
export interface TlsOptions {
  /** Turns TLS on, verifying the relay's certificate against this CA. */
  tlsCa?: PemOption | null;
  /** The client certificate and key: both or neither, with tlsCa. */
  tlsCert?: PemOption | null;
  tlsKey?: PemOption | null;
}

export interface RelayClientOptions extends TlsOptions {
  /** relay.proto to load; default DEFAULT_PROTO_PATH. */
  protoPath?: string;
  /** The name the relay's certificate is verified for (default: the host of the address). */
  tlsServerName?: string;
  /** Sent as `authorization: Bearer TOKEN` on every call; unset or empty: process.env.KVRELAY_TOKEN. */
  token?: string;
  /** Channel credentials instead of the tls* options (not both). */
  credentials?: grpc.ChannelCredentials;
  /** Options of the gRPC client (channel options, interceptors, ...). */
  channelOptions?: grpc.ClientOptions;
}

/** Options of every call: its deadline from now, in milliseconds (> 0). */
export interface CallOptions {
  timeoutMs?: number;
}

export interface PublishOptions extends CallOptions {
  sessionId: string;
  /** The publishing agent. */
  sender: string;
  /** 1..64 agents; one agent id may be given as a string. */
  recipients: string | string[];
  /** The idempotency key; empty or unset: newMessageId(). */
  messageId?: string;
  /** A pipeline spec; '' (default): the relay's default for role. */
  policy?: string;
  role?: string;
  /** Passes history by reference: the turn then carries none and goes with firstAgent = false. */
  parentId?: string;
}

/** What publish() resolves to. */
export interface PublishResult {
  messageId: string;
  /** The id was already committed; nothing changed. */
  duplicate: boolean;
  /** Set by every relay; null only if a relay sent none. */
  accounting: Accounting | null;
}

export interface FetchOptions extends CallOptions {
  /** The relay acknowledges once it sent the trailer, before this client checked it. */
  autoAck?: boolean;
}

/**
 * A client of one relay. Every method returns a promise; errors are
 * RelayStatusError (publish: PublishError). Bad options throw a RelayError
 * (INVALID_ARGUMENT) naming the option.
 */
export declare class RelayClient {
  /** @param address "HOST:PORT" or "unix:PATH" */
  constructor(address: string, options?: RelayClientOptions);
  /** Closes the channel and cancels the calls in flight (they reject with CANCELLED). */
  close(): void;
  /** Uploads `turn` for the recipients. Timeout default 120 s. */
  publish(turn: Turn, options: PublishOptions): Promise<PublishResult>;
  /**
   * The oldest unacknowledged message for (sessionId, agent), waiting for
   * one (DEADLINE_EXCEEDED when none came). Timeout default 30 s.
   */
  fetch(sessionId: string, agent: string, options?: FetchOptions): Promise<Message>;
  /** Stateless compression with a required pipeline spec; the relay stores nothing. Timeout default 120 s. */
  compress(turn: Turn, policy: string, options?: CallOptions): Promise<Message>;
  /**
   * Acknowledges a delivered message (NOT_FOUND: unknown, FAILED_PRECONDITION:
   * not yet delivered). Timeout default 10 s.
   */
  ack(sessionId: string, agent: string, messageId: string, options?: CallOptions): Promise<void>;
  /** Frees a session; resolves to the number of messages freed. Idempotent. Timeout default 10 s. */
  closeSession(sessionId: string, options?: CallOptions): Promise<number>;
  /** The relay's counters. Timeout default 10 s. */
  stats(options?: CallOptions): Promise<StatsResponse>;
}

// ---- constants and helpers ------------------------------------------------------

/** A Chunk carries 1 .. MAX_CHUNK_BYTES (1 MiB) of tensor bytes. */
export declare const MAX_CHUNK_BYTES: number;
/** The relay.proto loaded by default: the package's copy (in the source tree: the repository's). */
export declare const DEFAULT_PROTO_PATH: string;
/** The environment variable the token comes from when the `token` option is unset. */
export declare const TOKEN_ENV: 'KVRELAY_TOKEN';

/** The Relay service constructor from relay.proto (default DEFAULT_PROTO_PATH). */
export declare function loadRelayService(protoPath?: string): grpc.ServiceClientConstructor;
/** Insecure without tlsCa, else TLS verifying against tlsCa, with tlsCert/tlsKey when given. */
export declare function channelCredentials(options?: TlsOptions): grpc.ChannelCredentials;
/** An interceptor adding `authorization: Bearer TOKEN` to every call; the token is visible ASCII. */
export declare function bearerInterceptor(token: string): grpc.Interceptor;
/** The first line of a token file, whitespace trimmed; an empty first line throws. */
export declare function readTokenFile(file: string): string;
/** A fresh message id: "m-" and 24 random hex digits. */
export declare function newMessageId(): string;
/** 'INVALID_ARGUMENT', ... for an error with a gRPC status code; undefined otherwise. */
export declare function statusName(err: unknown): StatusName | undefined;
/** The TurnGeometry of `turn` and its tensors in upload order; throws a RelayError for what cannot be sent. */
export declare function planUpload(turn: Turn): UploadPlan;
/** An Accounting as proto-loader gives it, as this client hands it out (attentionError a number or null). */
export declare function accountingOf<T extends object | null | undefined>(
  accounting: T): T extends object ? Accounting : T;
/** The requests after an upload's header: every chunk of `tensors` (at most MAX_CHUNK_BYTES each), then the commit. */
export declare function chunkRequests(
  tensors: Iterable<{ layer: number; part: string; data: Uint8Array }>): Generator<UploadRequest, void, undefined>;

/** The writing side of an upload call (a Publish or Compress stream). */
export interface UploadCall {
  write(request: object): boolean;
  on(event: 'drain', listener: () => void): unknown;
  off(event: 'drain', listener: () => void): unknown;
  end(): void;
  cancel(): void;
}

/**
 * Writes `first`, the chunks of `tensors` and the commit to `call`, honouring
 * its flow control, and stops as soon as `reply` (the call's answer) settles.
 * Resolves or rejects as `reply` does.
 */
export declare function writeUpload<T>(
  call: UploadCall, reply: Promise<T>, first: object,
  tensors: Iterable<{ layer: number; part: string; data: Uint8Array }>): Promise<T>;

/** A response of a Fetch or Compress stream, as proto-loader gives it (oneofs: true). */
export type DeliveryResponse =
  | { kind: 'header'; header: Omit<MessageHeader, 'accounting'> & { accounting: object | null } }
  | { kind: 'chunk'; chunk: Chunk }
  | { kind: 'trailer'; trailer: Trailer };

/**
 * Rebuilds a message from a delivery stream (header, chunks, trailer),
 * checking order, offsets, sizes, CRC32Cs and the trailer. Memory follows
 * the data received, not what the header announces.
 */
export declare class Assembler {
  constructor();
  /** The stream has ended with a valid trailer. */
  done: boolean;
  /** Takes the next response; throws a RelayError (DATA_LOSS) when it does not fit the delivery. */
  add(response: DeliveryResponse): void;
  /** The message, once the trailer came; else throws a RelayError (DATA_LOSS). */
  message(): Message;
}

export { nextPos } from './safetensors';

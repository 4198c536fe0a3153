// TypeScript declarations of safetensors.js: safetensors I/O for kvrelay
// turn and message files (docs/FORMAT.md).

/// <reference types="node" />
import type { Message, Turn } from './client';

/** Bytes per element of each safetensors dtype kvrelay uses. */
export declare const DTYPE_SIZE: Readonly<{ F32: 4; F16: 2; BF16: 2; I32: 4; U8: 1 }>;

/** A safetensors dtype kvrelay uses. */
export type SafetensorsDtype = keyof typeof DTYPE_SIZE;

/** One tensor as readSafetensors() gives it: `data` is a view into one buffer holding the whole file. */
export interface SafetensorsTensor {
  dtype: SafetensorsDtype;
  shape: number[];
  data: Buffer;
}

/** What readSafetensors() resolves to. */
export interface SafetensorsFile {
  metadata: Record<string, string>;
  tensors: Map<string, SafetensorsTensor>;
}

/** One tensor for writeSafetensors(): any typed array or DataView, written as its bytes. */
export interface NamedTensor {
  name: string;
  dtype: string;
  shape: readonly number[];
  data: ArrayBufferView;
}

/** Parses a safetensors file; errors name the file and what is wrong. */
export declare function readSafetensors(path: string): Promise<SafetensorsFile>;
/** Writes a safetensors file, tensors in the given order. */
export declare function writeSafetensors(path: string, tensors: readonly NamedTensor[],
                                         metadata?: Record<string, string>): Promise<void>;
/**
 * Reads a turn file (docs/FORMAT.md, "Turn") into the turn that
 * RelayClient.publish takes; checks names, dtypes and shapes.
 */
export declare function readTurnFile(path: string): Promise<Turn>;
/**
 * Writes a fetched message as a message file (docs/FORMAT.md, "Message"),
 * with the delivery in its metadata like `kvrelayctl fetch --out`.
 */
export declare function writeMessageFile(path: string, message: Message): Promise<void>;
/**
 * Where the receiver's own tokens start: header.nextPos, and at least 1 +
 * every position id the message's PART_POS tensors hold.
 */
export declare function nextPos(message: {
  header?: { nextPos?: number | null } | null;
  tensors: Iterable<{ part: string; data: ArrayBufferView }>;
}): number;

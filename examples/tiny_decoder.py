"""A tiny randomly initialised Llama/Qwen-style decoder in plain torch.

Used by examples/latentmas_chain.py and tests/client/python/hf/ as a stand-in
for a transformers causal LM (no download, no transformers needed). Same
shape of computation as Llama/Qwen2: token embedding, per layer RMSNorm ->
grouped-query attention with rotary position embeddings (RoPE applied to
queries and keys before the keys are cached) -> residual -> RMSNorm ->
SwiGLU MLP -> residual; final RMSNorm and an LM head. Eager attention, with
the softmax in float32 like transformers' eager path.

Interface (the part of a transformers model the examples use):

    out = model(input_ids=None | [1, q] long, inputs_embeds=None | [1, q, hidden],
                past_key_values=None | legacy tuple ((k, v) per layer, [1, kv_heads, n, head_dim]),
                position_ids=None | [1, q] long,     # default: n, n+1, ... (n = cached rows)
                attention_mask=None | [1, n + q],    # 1 = visible; default all visible
                output_attentions=False, output_hidden_states=False)
    out.logits            [1, q, vocab]
    out.past_key_values   legacy tuple, the cache with the q new tokens appended
    out.attentions        tuple over layers of [1, q_heads, q, n + q] (with output_attentions)
    out.hidden_states     (with output_hidden_states) tuple of [1, q, hidden]: the
                          embeddings, each layer's output, the last one after the
                          final norm (as transformers returns them)

The vocabulary is bytes (vocab_size 256), so `encode`/`decode` are UTF-8.
"""
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

CONFIG = {
    "vocab_size": 256,
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "init_std": 0.08,
}


def encode(text):
    """Byte-level 'tokenizer': [1, n] long tensor of UTF-8 bytes."""
    return torch.tensor([list(text.encode("utf-8"))], dtype=torch.long)


def decode(ids):
    return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")


def _legacy(cache):
    """A transformers DynamicCache's (key, value) per layer: `.layers[i].keys
    /.values` (transformers >= 4.56), `.key_cache/.value_cache` (older)."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return tuple((l.keys, l.values) for l in layers)
    if hasattr(cache, "key_cache"):
        return tuple(zip(cache.key_cache, cache.value_cache))
    return cache.to_legacy_cache()


@dataclass
class DecoderOutput:
    logits: torch.Tensor
    past_key_values: Any
    attentions: Optional[tuple]
    hidden_states: Optional[tuple]


class RMSNorm(torch.nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dt = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dt)


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Attention(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.nh, self.nkv, self.hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        if self.nh % self.nkv:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        h = c["hidden_size"]
        self.q_proj = torch.nn.Linear(h, self.nh * self.hd, bias=True)   # Qwen2: q/k/v biases
        self.k_proj = torch.nn.Linear(h, self.nkv * self.hd, bias=True)
        self.v_proj = torch.nn.Linear(h, self.nkv * self.hd, bias=True)
        self.o_proj = torch.nn.Linear(self.nh * self.hd, h, bias=False)

    def forward(self, x, cos, sin, past, mask, output_attentions):
        b, q, _ = x.shape
        qs = self.q_proj(x).view(b, q, self.nh, self.hd).transpose(1, 2)
        ks = self.k_proj(x).view(b, q, self.nkv, self.hd).transpose(1, 2)
        vs = self.v_proj(x).view(b, q, self.nkv, self.hd).transpose(1, 2)
        qs = qs * cos + rotate_half(qs) * sin
        ks = ks * cos + rotate_half(ks) * sin          # RoPE before caching the keys
        if past is not None:
            ks = torch.cat([past[0], ks], dim=2)
            vs = torch.cat([past[1], vs], dim=2)
        group = self.nh // self.nkv                     # query head i uses KV head i // group
        kr = ks.repeat_interleave(group, dim=1)
        vr = vs.repeat_interleave(group, dim=1)
        scores = torch.matmul(qs, kr.transpose(2, 3)) / math.sqrt(self.hd) + mask
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(qs.dtype)
        out = torch.matmul(probs, vr).transpose(1, 2).reshape(b, q, self.nh * self.hd)
        return self.o_proj(out), (ks, vs), (probs if output_attentions else None)


class Block(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        h, m = c["hidden_size"], c["intermediate_size"]
        self.input_layernorm = RMSNorm(h, c["rms_norm_eps"])
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(h, c["rms_norm_eps"])
        self.gate_proj = torch.nn.Linear(h, m, bias=False)
        self.up_proj = torch.nn.Linear(h, m, bias=False)
        self.down_proj = torch.nn.Linear(m, h, bias=False)

    def forward(self, x, cos, sin, past, mask, output_attentions):
        a, kv, probs = self.self_attn(self.input_layernorm(x), cos, sin, past, mask, output_attentions)
        x = x + a
        y = self.post_attention_layernorm(x)
        x = x + self.down_proj(torch.nn.functional.silu(self.gate_proj(y)) * self.up_proj(y))
        return x, kv, probs


class TinyDecoder(torch.nn.Module):
    """TinyDecoder(config dict, seed): deterministic random weights."""

    def __init__(self, config=None, seed=0):
        super().__init__()
        self.config = c = dict(CONFIG, **(config or {}))
        self.embed_tokens = torch.nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = torch.nn.ModuleList(Block(c) for _ in range(c["num_hidden_layers"]))
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.lm_head = torch.nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if "norm" in name:
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
                else:
                    p.copy_(c["init_std"] * torch.randn(p.shape, generator=g))
        hd = c["head_dim"]
        self.register_buffer("inv_freq", 1.0 / (c["rope_theta"] ** (
            torch.arange(0, hd, 2, dtype=torch.float64) / hd)), persistent=False)

    @property
    def dtype(self):
        return self.embed_tokens.weight.dtype

    def rope(self, position_ids, dtype):
        # float64 angles, then cast: the same cos/sin for the same position id.
        freqs = position_ids.to(torch.float64)[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]        # [1, 1, q, head_dim]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @torch.no_grad()
    def forward(self, input_ids=None, inputs_embeds=None, past_key_values=None,
                position_ids=None, attention_mask=None, output_attentions=False,
                output_hidden_states=False, **_):
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds.to(self.dtype)
        b, q, _ = x.shape
        past = past_key_values
        if past is not None and not isinstance(past, (tuple, list)):
            past = _legacy(past)  # a transformers DynamicCache
        n = 0 if not past else past[0][0].shape[2]
        if position_ids is None:
            position_ids = torch.arange(n, n + q).unsqueeze(0)
        cos, sin = self.rope(position_ids, x.dtype)
        # Causal among the new tokens; every cached row visible (unless masked).
        mask = torch.zeros(q, n + q, dtype=torch.float32)
        mask[:, n:] = torch.triu(torch.full((q, q), float("-inf")), diagonal=1)
        if attention_mask is not None:
            if attention_mask.shape[-1] != n + q:
                raise ValueError(f"attention_mask: {attention_mask.shape[-1]} columns, "
                                 f"expected cached + new = {n + q}")
            mask = mask + torch.where(attention_mask.reshape(1, n + q) > 0, 0.0, float("-inf"))
        mask = mask.to(x.dtype)[None, None]
        cache, attns, hidden = [], [], [x]
        for i, layer in enumerate(self.layers):
            x, kv, probs = layer(x, cos, sin, past[i] if past else None, mask, output_attentions)
            cache.append(kv)
            attns.append(probs)
            hidden.append(x)
        hidden[-1] = x = self.norm(x)
        logits = self.lm_head(x).float()
        return DecoderOutput(logits=logits, past_key_values=tuple(cache),
                             attentions=tuple(attns) if output_attentions else None,
                             hidden_states=tuple(hidden) if output_hidden_states else None)

    def get_input_embeddings(self):
        return self.embed_tokens

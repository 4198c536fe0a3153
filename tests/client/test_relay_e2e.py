#!/usr/bin/python3
"""kvrelayctl's relay verbs against a real kvrelay-server on 127.0.0.1:0.

Checks: health, full round trip bit-exact against the input turn, compressed
deliveries bit-exact against `kvrelayctl compress` offline (and the relay's
Compress call), fan-out, ack and redelivery, idempotent re-publish, a chain
with parents, session close, stats, the demo (one relay; and the flags and table
of the several-relay demo), `status`, and bad inputs with their exit codes and
status names. Stdlib only. Exit 77 (skipped) without a server binary.
"""
import argparse
import os
import random
import re
import shutil
import struct
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "testlib"))
from kvrelay_testlib import FAILURES, Ctl, Server, check, read_st  # noqa: E402
from lang_cases import write_st  # noqa: E402

SKIP = 77
def kv_line(out):
    return dict(re.findall(r"(\w+)=(\S+)", out))


def same_tensors(a, b, what):
    ma, ta = read_st(a)
    mb, tb = read_st(b)
    # acc (accumulated importance) is relay-side state: a delivery does not
    # carry it, an offline compression writes it.
    ta = {k: v for k, v in ta.items() if not k.endswith(".acc")}
    tb = {k: v for k, v in tb.items() if not k.endswith(".acc")}
    check(sorted(ta) == sorted(tb), f"{what}: tensor names differ")
    for name in ta:
        if name in tb and ta[name] != tb[name]:
            check(False, f"{what}: tensor {name} differs")
            return
    for key in ("format", "policy", "dtype", "n_history", "n_anchor", "n_kept", "n_gen", "anchor_pos",
                "full_bytes", "sent_bytes", "quant_bits", "quant_group", "quant_rotate"):
        check(ma.get(key) == mb.get(key), f"{what}: metadata {key} {ma.get(key)} vs {mb.get(key)}")


def test_full_is_bit_exact(ctl, turn):
    r = ctl.ok("publish", "--session", "full", "--from", "a", "--to", "b", "--policy", "full",
               "--in", turn)
    out = ctl.path("full.msg")
    f = ctl.ok("fetch", "--session", "full", "--agent", "b", "--out", out, "--wait", "10")
    if not f:
        return
    check(f["message_id"] == r.get("message_id"), "full: fetched id is the published id")
    meta, msg = read_st(out)
    tmeta, t = read_st(turn)
    check(meta.get("message_id") == r.get("message_id"), "full: metadata message_id")
    check(meta.get("session") == "full", "full: metadata session")
    check(meta.get("from") == "a", "full: metadata from")
    check(meta.get("policy") == "full", "full: metadata policy")
    for key in ("received_bytes", "ratio", "compress_seconds", "commit_seconds"):
        check(key in meta, f"full: metadata {key}")
    layers = len([n for n in t if n.endswith(".prompt.k")])
    for l in range(layers):
        for part in ("k", "v"):
            dt, (H, n_p, d), pb = t[f"layer.{l}.prompt.{part}"]
            _, (_, n_g, _), gb = t[f"layer.{l}.gen.{part}"]
            mdt, mshape, mb = msg[f"layer.{l}.{part}"]
            check(mdt == dt and mshape == (H, n_p + n_g, d), f"full: layer.{l}.{part} shape")
            row = d * (4 if dt == "F32" else 2)
            want = b"".join(pb[h * n_p * row:(h + 1) * n_p * row] + gb[h * n_g * row:(h + 1) * n_g * row]
                            for h in range(H))
            check(mb == want, f"full: layer.{l}.{part} bit-exact with the turn")
        _, pshape, pos = msg[f"layer.{l}.pos"]
        H, n = pshape
        want = struct.pack(f"<{n}i", *range(n)) * H
        check(pos == want, f"full: layer.{l}.pos is 0..n-1")
    offline = ctl.path("full.offline")
    ctl.ok("compress", "--policy", "full", "--in", turn, "--out", offline, addr=False)
    same_tensors(out, offline, "full vs offline")


def test_compressed_equals_offline(ctl, turn):
    for i, policy in enumerate(["h2o-head:k=32+obf:p=8", "h2o-layer:k=16+obf:p=4,mode=fast",
                                "h2o-head:k=16+int4:rotate=hadamard", "gen"]):
        s = f"cmp{i}"
        r = ctl.ok("publish", "--session", s, "--from", "a", "--to", "b", "--policy", policy,
                   "--in", turn)
        out, offline, remote = ctl.path(f"{s}.msg"), ctl.path(f"{s}.off"), ctl.path(f"{s}.rpc")
        f = ctl.ok("fetch", "--session", s, "--agent", "b", "--out", out, "--wait", "10")
        if not f:
            continue
        ctl.ok("compress", "--policy", policy, "--in", turn, "--out", offline, addr=False)
        same_tensors(out, offline, f"{policy}: relay vs offline")
        ctl.ok("compress", "--policy", policy, "--in", turn, "--out", remote)
        same_tensors(remote, offline, f"{policy}: Compress RPC vs offline")
        check(r.get("full_bytes") == read_st(offline)[0]["full_bytes"], f"{policy}: accounting full_bytes")
        check(r.get("sent_bytes") == read_st(offline)[0]["sent_bytes"], f"{policy}: accounting sent_bytes")


def test_fan_out(ctl, turn):
    r = ctl.ok("publish", "--session", "fan", "--from", "a", "--to", "c", "--to", "d",
               "--policy", "h2o-head:k=8", "--in", turn)
    got = []
    for agent in ("c", "d"):
        out = ctl.path(f"fan.{agent}")
        f = ctl.ok("fetch", "--session", "fan", "--agent", agent, "--out", out, "--wait", "10")
        got.append(f.get("message_id"))
        check(f.get("delivery_attempt") == "1", f"fan-out: {agent} first delivery")
    check(got == [r.get("message_id")] * 2, f"fan-out: both recipients got {r.get('message_id')}: {got}")
    same_tensors(ctl.path("fan.c"), ctl.path("fan.d"), "fan-out: same message")
    rc, _, err = ctl.run("fetch", "--session", "fan", "--agent", "c", "--out", ctl.path("x"),
                         "--wait", "0.5")
    check(rc == 1 and "DEADLINE_EXCEEDED" in err, f"fan-out: c's mailbox is empty after ack: {rc} {err}")


def test_redelivery_and_ack(ctl, turn):
    r = ctl.ok("publish", "--session", "redo", "--from", "a", "--to", "e", "--policy", "gen",
               "--in", turn)
    f1 = ctl.ok("fetch", "--session", "redo", "--agent", "e", "--out", ctl.path("r1"), "--no-ack")
    f2 = ctl.ok("fetch", "--session", "redo", "--agent", "e", "--out", ctl.path("r2"), "--no-ack")
    check(f1.get("message_id") == r.get("message_id") == f2.get("message_id"),
          "redelivery: same message until acked")
    check(f1.get("delivery_attempt") == "1" and f2.get("delivery_attempt") == "2",
          f"redelivery: attempts {f1.get('delivery_attempt')}, {f2.get('delivery_attempt')}")
    check(f1.get("acked") == "false", "redelivery: --no-ack")
    ctl.ok("ack", "--session", "redo", "--agent", "e", "--id", r.get("message_id", "x"))
    rc, _, err = ctl.run("fetch", "--session", "redo", "--agent", "e", "--out", ctl.path("r3"),
                         "--wait", "0.5")
    check(rc == 1 and "DEADLINE_EXCEEDED" in err, f"redelivery: gone after ack: {rc} {err}")
    rc, _, err = ctl.run("ack", "--session", "redo", "--agent", "e", "--id", "no-such-message")
    check(rc == 1 and "NOT_FOUND" in err, f"ack of an unknown message: {rc} {err}")


def test_idempotent_publish(ctl, turn):
    a = ctl.ok("publish", "--session", "idem", "--from", "a", "--to", "b", "--id", "fixed-1",
               "--policy", "h2o-head:k=8", "--in", turn)
    b = ctl.ok("publish", "--session", "idem", "--from", "a", "--to", "b", "--id", "fixed-1",
               "--policy", "h2o-head:k=8", "--in", turn)
    check(a.get("message_id") == b.get("message_id") == "fixed-1", "idempotent: same id")
    check(a.get("duplicate") == "false" and b.get("duplicate") == "true", "idempotent: duplicate flag")
    check(a.get("sent_bytes") == b.get("sent_bytes"), "idempotent: original accounting")
    ctl.ok("fetch", "--session", "idem", "--agent", "b", "--out", ctl.path("i1"))
    rc, _, err = ctl.run("fetch", "--session", "idem", "--agent", "b", "--out", ctl.path("i2"),
                         "--wait", "0.5")
    check(rc == 1 and "DEADLINE_EXCEEDED" in err, f"idempotent: delivered once: {rc} {err}")


def test_chain_with_parent(ctl, turn, turn2):
    r1 = ctl.ok("publish", "--session", "chain", "--from", "planner", "--to", "critic",
                "--policy", "h2o-head:k=16", "--in", turn)
    ctl.ok("fetch", "--session", "chain", "--agent", "critic", "--out", ctl.path("c1"))
    r2 = ctl.ok("publish", "--session", "chain", "--from", "critic", "--to", "refiner",
                "--policy", "h2o-head:k=16", "--parent", r1.get("message_id", "x"), "--in", turn2)
    f2 = ctl.ok("fetch", "--session", "chain", "--agent", "refiner", "--out", ctl.path("c2"))
    check(f2.get("parent") == r1.get("message_id"), "chain: parent id delivered")
    m1, t1 = read_st(ctl.path("c1"))
    m2, t2 = read_st(ctl.path("c2"))
    n1 = int(m1["n_history"]) + int(m1["n_anchor"]) + int(m1["n_kept"]) + int(m1["n_gen"])
    check(int(m2.get("n_history", -1)) == n1, f"chain: history of the second is the first ({n1})")
    for part in ("k", "v", "pos"):
        _, s1, b1 = t1[f"layer.0.{part}"]
        _, s2, b2 = t2[f"layer.0.{part}"]
        H = s1[0]
        rb1, rb2 = len(b1) // (H * s1[1]), len(b2) // (H * s2[1])
        ok = rb1 == rb2 and all(b2[h * s2[1] * rb2:h * s2[1] * rb2 + n1 * rb2] == b1[h * s1[1] * rb1:(h + 1) * s1[1] * rb1]
                                for h in range(H))
        check(ok, f"chain: layer.0.{part} starts with the parent's tokens")
    # A turn file that says first_agent=true (make-turn's default) published
    # with a parent is sent as a later agent's turn: no anchors of its own.
    r3 = ctl.ok("publish", "--session", "chain", "--from", "refiner", "--to", "judger",
                "--policy", "h2o-head:k=16", "--parent", r2.get("message_id", "x"), "--in", turn)
    ctl.ok("fetch", "--session", "chain", "--agent", "judger", "--out", ctl.path("c3"))
    m3, _ = read_st(ctl.path("c3"))
    check(bool(r3.get("message_id")) and m3.get("n_anchor") == "0",
          f"chain: first_agent file with --parent: {m3.get('n_anchor')} anchors")
    # A parent the sender may not see (neither its sender nor a recipient)
    # and one that does not exist: the same NOT_FOUND.
    rc, _, err = ctl.run("publish", "--session", "chain", "--from", "judger", "--to", "x",
                         "--parent", r1.get("message_id", "x"), "--in", turn2)
    check(rc == 1 and "NOT_FOUND" in err and "visible to agent" in err, f"chain: foreign parent: {rc} {err}")
    rc, _, err = ctl.run("publish", "--session", "chain", "--from", "critic", "--to", "x",
                         "--parent", "no-such-parent", "--in", turn2)
    check(rc == 1 and "NOT_FOUND" in err and "visible to agent" in err, f"chain: unknown parent: {rc} {err}")
    rc, out, err = ctl.run("close", "--session", "chain")
    check(rc == 0 and "messages_freed=" in out, f"close: {rc} {out} {err}")
    rc, out, err = ctl.run("close", "--session", "chain")
    check(rc == 0, f"close is idempotent: {rc} {err}")


def test_history_budget_chain(ctl):
    """8 rounds of planner -> critic -> refiner -> judger -> planner in one
    session with hist=64: the history stops growing, so the bytes per hop
    stay flat; every delivered message is bit-exact with `kvrelayctl
    compress --parent` of the offline chain. The relay keeps acc to itself,
    so the kept history tokens agreeing hop after hop is what shows that its
    acc is the offline one. Every other turn carries queries (gen.q); the
    others carry scores and, from the second hop on, this agent's mass on
    the parent's tokens (history.score, as PART_HISTORY_SCORE): both add to
    acc."""
    policy = "h2o-head:k=16,hist=64+obf:p=4"
    agents = ["planner", "critic", "refiner", "judger"]
    geo = ["--layers", "2", "--kv-heads", "2", "--score-heads", "4", "--head-dim", "32",
           "--prompt", "96", "--gen", "12"]
    parent_id, offline_prev, sent = "", None, []
    for i in range(32):
        frm, to = agents[i % 4], agents[(i + 1) % 4]
        turn = ctl.path(f"hc-turn-{i}.st")
        ctl.ok("make-turn", "--out", turn, "--seed", str(100 + i), *geo,
               *(["--queries"] if i % 2 else []), addr=False)
        if offline_prev and i % 2 == 0:
            pm, _ = read_st(offline_prev)
            n = sum(int(pm[k]) for k in ("n_history", "n_anchor", "n_kept", "n_gen"))
            meta, tensors = read_st(turn)
            rng = random.Random(i)
            for layer in range(2):  # heavy on a few tokens, light elsewhere
                mass = [rng.expovariate(1.0) * (40.0 if rng.random() < 0.1 else 1.0) for _ in range(4 * n)]
                tensors[f"layer.{layer}.history.score"] = ("F32", (4, n), struct.pack(f"<{4 * n}f", *mass))
            if i == 4:  # the mass must matter: without it another history is kept
                bare = ctl.path("hc-bare.st")
                write_st(bare, meta, {k: v for k, v in tensors.items() if ".history.score" not in k})
            write_st(turn, meta, tensors)
        args = ["publish", "--session", "histchain", "--from", frm, "--to", to, "--policy", policy, "--in", turn]
        r = ctl.ok(*args, *(["--parent", parent_id] if parent_id else []))
        got = ctl.path(f"hc-got-{i}.st")
        ctl.ok("fetch", "--session", "histchain", "--agent", to, "--out", got)
        offline = ctl.path(f"hc-off-{i}.st")
        ctl.ok("compress", "--policy", policy, "--in", turn, "--out", offline, "--threads", "1",
               *(["--parent", offline_prev] if offline_prev else []), addr=False)
        same_tensors(got, offline, f"hist chain hop {i + 1}")
        if i == 4:
            ctl.ok("compress", "--policy", policy, "--in", ctl.path("hc-bare.st"), "--out", ctl.path("hc-bare-off.st"),
                   "--threads", "1", "--parent", offline_prev, addr=False)
            _, with_score = read_st(offline)
            _, without = read_st(ctl.path("hc-bare-off.st"))
            check(with_score["layer.0.pos"] != without["layer.0.pos"],
                  "hist chain hop 5: history.score changes the history kept")
        meta, tensors = read_st(offline)
        check("layer.0.acc" in tensors, f"hist chain hop {i + 1}: the offline message has acc")
        sent.append(int(r.get("sent_bytes", 0)))
        parent_id, offline_prev = r.get("message_id", "x"), offline
    m, _ = read_st(ctl.path("hc-got-31.st"))
    check(m.get("anchor_pos") == "0,1,2,3", f"hist chain: the first agent's anchors travel: {m.get('anchor_pos')}")
    check(int(m.get("n_history", -1)) == 4 + 64, f"hist chain: history capped at anchors + 64: {m.get('n_history')}")
    # From the fourth hop on the history is at its cap: flat.
    check(len(set(sent[3:])) == 1, f"hist chain: sent bytes per hop flat: {sent}")
    print(f"hist chain: sent bytes per hop {sent}", flush=True)
    ctl.ok("close", "--session", "histchain")


def test_bad_inputs(ctl, turn, turn_hist):
    cases = [
        (["publish", "--session", "bad", "--from", "a", "--to", "b", "--policy", "h2o-head:k=8+bogus",
          "--in", turn], 1, "INVALID_ARGUMENT"),
        (["publish", "--session", "bad", "--from", "a", "--to", "b", "--policy", "h2o-head:k=x",
          "--in", turn], 1, "INVALID_ARGUMENT"),
        (["publish", "--session", "bad", "--from", "a", "--to", "b", "--parent", "p",
          "--in", turn_hist], 1, "n_history"),
        (["publish", "--session", "bad session", "--from", "a", "--to", "b", "--in", turn], 1,
         "INVALID_ARGUMENT"),
        (["publish", "--session", "bad", "--from", "a", "--in", turn], 2, "missing required flag --to"),
        (["publish", "--session", "bad", "--from", "a", "--to", "b"], 2, "missing required flag --in"),
        (["publish", "--session", "bad", "--from", "a", "--to", "b", "--in", ctl.path("nope")], 1,
         "nope"),
        (["fetch", "--session", "bad", "--agent", "b", "--out", ctl.path("o"), "--wait", "x"], 2,
         "--wait"),
        (["fetch", "--session", "bad", "--agent", "b", "--out", ctl.path("o"), "--bogus"], 2,
         "unknown flag --bogus"),
        (["fetch", "--session", "bad", "--agent", "b", "--out", ctl.path("o"), "--wait", "0.3"], 1,
         "DEADLINE_EXCEEDED"),
        (["stats", "extra"], 2, "unexpected argument"),
    ]
    for args, want_rc, want_err in cases:
        rc, _, err = ctl.run(*args)
        check(rc == want_rc and want_err in err,
              f"bad input {args[:3]}...: rc={rc} (want {want_rc}) stderr={err.strip()!r} (want {want_err!r})")
    # Nothing became visible in the session the bad publishes named.
    rc, _, err = ctl.run("fetch", "--session", "bad", "--agent", "b", "--out", ctl.path("o"),
                         "--wait", "0.3")
    check(rc == 1 and "DEADLINE_EXCEEDED" in err, f"bad inputs left nothing: {rc} {err}")
    rc, _, err = ctl.run("health", addr=False)
    check(rc == 2 and "--addr" in err, f"health without --addr: {rc} {err}")
    rc, out, err = ctl.run("health", "--addr", "127.0.0.1:1", "--timeout", "2", addr=False)
    check(rc == 1 and "UNAVAILABLE" in err, f"health of a closed port: {rc} {err}")
    # Addresses gRPC would take otherwise (port modulo 65536; a missing port as 443), and
    # geometry checked before anything is dialled (127.0.0.1:1 would be UNAVAILABLE, exit 1).
    port = int(ctl.addr.rsplit(":", 1)[1])
    for verb in (["health"], ["stats"], ["fetch", "--session", "s", "--agent", "b", "--out", ctl.path("o")]):
        for addr in (f"127.0.0.1:{port + 65536}", "127.0.0.1", "127.0.0.1:0", "", f"http://127.0.0.1:{port}",
                     f"DNS:///127.0.0.1:{port}", "unix:", "dns:"):
            rc, _, err = ctl.run(*verb, "--addr", addr, addr=False, timeout=30)
            check(rc == 2 and "flag --addr" in err, f"{verb[0]} --addr {addr!r}: rc={rc} {err.strip()!r}")
    rc, out, err = ctl.run("health", "--addr", f"dns:///127.0.0.1:{port}", addr=False)
    check(rc == 0 and out.strip() == "SERVING", f"health via a gRPC target URI: {rc} {out} {err}")
    big = ["--layers", "1024", "--kv-heads", "1024", "--head-dim", "1024", "--prompt", "16777216"]
    rc, out, err = ctl.run("demo", *big, addr="127.0.0.1:1", timeout=30)
    check(rc == 2 and "flags --layers" in err and "16 GiB" in err and "kvrelay demo" not in out,
          f"demo with a 72 PB turn: a usage error before connecting: rc={rc} {err.strip()!r}")
    rc, out, err = ctl.run("compress", "--policy", "full", "--in", turn, "--out", ctl.path("c"), "--threads", "2")
    check(rc == 2 and "--threads" in err, f"compress --addr with --threads: rc={rc} {err.strip()!r}")
    rc, out, err = ctl.run("compress", "--policy", "full", "--in", turn, "--out", ctl.path("c"), "--addr", "",
                           addr=False)
    check(rc == 2 and "flag --addr: empty value" in err, f"compress --addr '': rc={rc} {err.strip()!r}")
    r = ctl.ok("compress", "--policy", "full", "--in", turn, "--out", ctl.path("c"))
    check(r.get("relay") == "true" and "threads" not in r, f"compress via the relay names no threads: {r}")


def test_demo(ctl, small):
    args = ["demo", "--rounds", "2", "--session", "demo-test"]
    if small:
        args += ["--layers", "4", "--kv-heads", "2", "--score-heads", "4", "--head-dim", "64",
                 "--prompt", "128", "--gen", "8"]
    rc, out, err = ctl.run(*args, timeout=600)
    if not check(rc == 0, f"demo: rc={rc} {err}"):
        return
    rows = re.findall(r"^\s*(\d)\s+(\w+) -> (\w+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\S+)\s+(\S+)\s+(\S+)$", out, re.M)
    check(len(rows) == 6, f"demo: 3 hops x 2 rounds, got {len(rows)}:\n{out}")
    check([r[1] for r in rows[:3]] == ["planner", "critic", "refiner"], "demo: chain order")
    tot = kv_line(re.search(r"^totals:.*$", out, re.M).group(0)) if "totals:" in out else {}
    delta = kv_line(re.search(r"^relay stats delta:.*$", out, re.M).group(0)) if "delta:" in out else {}
    check(tot.get("full_bytes") == str(sum(int(r[4]) for r in rows)), "demo: totals add up")
    check(delta.get("full_bytes") == tot.get("full_bytes") and delta.get("sent_bytes") == tot.get("sent_bytes"),
          f"demo: relay stats match the totals: {tot} vs {delta}")
    # More sent than full (int8 scales on a tiny head): saved is 0, as the relay counts it.
    rc, out2, err = ctl.run("demo", "--layers", "1", "--kv-heads", "1", "--head-dim", "1", "--prompt", "8",
                            "--gen", "2", "--policy", "full+int8", "--session", "demo-neg", timeout=120)
    tot2 = kv_line(re.search(r"^totals:.*$", out2, re.M).group(0)) if "totals:" in out2 else {}
    check(rc == 0 and int(tot2.get("sent_bytes", 0)) > int(tot2.get("full_bytes", 0)) and
          tot2.get("saved_bytes") == "0", f"demo with sent > full: saved_bytes 0: rc={rc} {tot2} {err}")
    # History grows along the chain: each hop holds more tokens than the last.
    toks = [int(r[3]) for r in rows[:3]]
    check(toks[0] < toks[1] < toks[2], f"demo: history composed by reference: tokens {toks}")
    print(out, flush=True)


def test_demo_addresses(ctl):
    """--addr once per agent or --addrs: checked before anything is dialled."""
    tiny = ["--layers", "1", "--kv-heads", "1", "--head-dim", "8", "--prompt", "8", "--gen", "2"]
    closed = [f"127.0.0.1:{p}" for p in (1, 2, 3, 4)]
    usage = [
        (["--addrs", ",".join(closed[:3])], "flag --addrs: 3 addresses, expected 1"),
        (["--addr", closed[0], "--addr", closed[1]], "flag --addr: 2 addresses, expected 1"),
        (["--addr", closed[0]] * 5, "flag --addr: 5 addresses"),
        (["--addr", closed[0], "--addrs", ",".join(closed)], "flags --addr and --addrs both given"),
        (["--addrs", f"{closed[0]},,{closed[2]},{closed[3]}"], "flag --addrs address 2 (critic): empty value"),
        (["--addrs", ",".join(closed[:3] + ["127.0.0.1:70000"])], "flag --addrs address 4 (judger): "),
        (["--addr", closed[0], "--addr", closed[1], "--addr", "127.0.0.1", "--addr", closed[3]],
         "flag --addr address 3 (refiner): "),
        ([], "demo: missing required flag --addr (or --addrs)"),
        (["--addr", ""], "flag --addr: empty value"),
    ]
    for args, want in usage:
        rc, out, err = ctl.run("demo", *args, *tiny, addr=False, timeout=30)
        check(rc == 2 and want in err and "kvrelay demo" not in out,
              f"demo {args}: usage error naming the flag: rc={rc} {err.strip()!r} (want {want!r})")
    # Accepted, then a clean connection failure (exit 1) before the demo starts.
    for args in (sum((["--addr", a] for a in closed), []), ["--addrs", ",".join(closed)]):
        rc, out, err = ctl.run("demo", *args, *tiny, addr=False, timeout=60)
        check(rc == 1 and "stats of 127.0.0.1:1: UNAVAILABLE" in err and "kvrelay demo" not in out,
              f"demo {args[:2]}...: exit 1, unreachable relay named: rc={rc} {err.strip()!r}")
    # Four times the same relay is one relay: today's output, no forward column.
    rc, out, err = ctl.run("demo", "--addrs", ",".join([ctl.addr] * 4), *tiny, "--session", "demo-4x",
                           addr=False, timeout=120)
    rows = re.findall(r"^\s*(\d)\s+(\w+) -> (\w+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\S+)\s+(\S+)\s+(\S+)$", out, re.M)
    check(rc == 0 and len(rows) == 3 and "to_next_relay" not in out and out.count("relay stats delta:") == 1,
          f"demo --addrs with one relay 4 times: the one-relay demo: rc={rc} {err}\n{out}")
    # Two spellings of one relay's address count as two relays: the several-relay output
    # (format only; no forward happens). to_next_relay is sent_bytes where the address changes.
    other = "ipv4:" + ctl.addr
    rc, out, err = ctl.run("demo", "--addrs", ",".join([ctl.addr, other, ctl.addr, ctl.addr]), *tiny,
                           "--session", "demo-2x", addr=False, timeout=120)
    rows = re.findall(r"^\s*(\d)\s+(\w+) -> (\w+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\d+)$",
                      out, re.M)
    tot = kv_line(re.search(r"^totals:.*$", out, re.M).group(0)) if "totals:" in out else {}
    deltas = re.findall(r"^relay stats delta at (\S+): committed=(\d+) ", out, re.M)
    check(rc == 0 and re.search(r"^hop .* hop_latency_ms\s+to_next_relay$", out, re.M) is not None and
          [r[9] for r in rows] == [rows[0][5], rows[1][5], "0"] and
          tot.get("to_next_relay_bytes") == str(int(rows[0][5]) + int(rows[1][5])) and
          deltas == [(ctl.addr, "3"), (other, "3")] and
          f"planner={ctl.addr} critic={other} refiner={ctl.addr} judger={ctl.addr}," in out,
          f"demo over two relay addresses: the several-relay table: rc={rc} {err}\n{out}")


def status_lines(out):
    """sender and the recipient lines of `kvrelayctl status`, parsed strictly."""
    lines = out.splitlines()
    sender = re.fullmatch(r"sender=(\S*)", lines[0]).group(1) if lines else None
    recipients = []
    for line in lines[1:]:
        m = re.fullmatch(r'agent=(\S+) state=(\w+) relay=(\S*) attempts=(\d+) reason="((?:[^"\\]|\\.)*)"', line)
        check(m is not None, f"status: malformed line {line!r}")
        if m:
            recipients.append(m.groups())
    return sender, recipients


def test_status(ctl, turn):
    for args, want in [(["status", "--session", "s"], "missing required flag --id"),
                       (["status", "--id", "m"], "missing required flag --session"),
                       (["status", "--session", "s", "--id", "m", "extra"], "unexpected argument")]:
        rc, _, err = ctl.run(*args)
        check(rc == 2 and want in err, f"{args}: rc={rc} {err.strip()!r} (want {want!r})")
    rc, _, err = ctl.run("status", "--session", "s", "--id", "m", addr=False)
    check(rc == 2 and "--addr" in err, f"status without --addr: rc={rc} {err.strip()!r}")
    rc, _, err = ctl.run("status", "--session", "s", "--id", "m", "--timeout", "2", addr="127.0.0.1:1")
    check(rc == 1 and "status: UNAVAILABLE" in err, f"status of a closed port: rc={rc} {err.strip()!r}")
    rc, _, err = ctl.run("status", "--session", "st", "--id", "m-none")
    check(rc == 1 and "status: NOT_FOUND" in err, f"status of an unknown message: rc={rc} {err.strip()!r}")
    r = ctl.ok("publish", "--session", "st", "--from", "a", "--to", "b", "--to", "c", "--policy", "full",
               "--in", turn)
    rc, out, err = ctl.run("status", "--session", "st", "--id", r.get("message_id", "?"))
    check(rc == 0, f"status: rc={rc} {err}")
    sender, rows = status_lines(out)
    check(sender == "a" and [x[0] for x in rows] == ["b", "c"] and
          all(x[1:] == ("committed", "", "0", "") for x in rows),
          f"status after publish: both committed here, no attempts, no reason:\n{out}")
    ctl.ok("fetch", "--session", "st", "--agent", "b", "--out", ctl.path("st.msg"), "--wait", "10")
    rc, out, err = ctl.run("status", "--session", "st", "--id", r.get("message_id", "?"))
    _, rows = status_lines(out)
    check(rc == 0 and [x[:2] for x in rows] == [("b", "acked"), ("c", "committed")],
          f"status after b fetched and acked: {out}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvrelayctl", required=True)
    ap.add_argument("--server", default="")
    ap.add_argument("--full-demo", action="store_true", help="demo with Qwen3-14B geometry")
    args = ap.parse_args()
    server_bin = args.server
    if not server_bin or not os.path.exists(server_bin):
        print(f"SKIP: no kvrelay-server binary at {server_bin!r}")
        return SKIP
    work = tempfile.mkdtemp(prefix="kvrelay_e2e_")
    server = Server(server_bin, work, name="server")
    try:
        ctl = Ctl(args.kvrelayctl, work, addr=server.addr)
        rc, out, err = ctl.run("health")
        check(rc == 0 and out.strip() == "SERVING", f"health: {rc} {out} {err}")
        turn, turn2, turn_hist = ctl.path("t.st"), ctl.path("t2.st"), ctl.path("th.st")
        geo = ["--layers", "3", "--kv-heads", "2", "--score-heads", "4", "--head-dim", "64",
               "--prompt", "200", "--gen", "10"]
        ctl.ok("make-turn", "--out", turn, "--seed", "1", *geo, addr=False)
        ctl.ok("make-turn", "--out", turn2, "--seed", "2", "--first-agent", "false", *geo, addr=False)
        ctl.ok("make-turn", "--out", turn_hist, "--seed", "3", "--history", "20", *geo, addr=False)
        for name, fn in [("full", lambda: test_full_is_bit_exact(ctl, turn)),
                         ("compressed", lambda: test_compressed_equals_offline(ctl, turn)),
                         ("fan-out", lambda: test_fan_out(ctl, turn)),
                         ("redelivery", lambda: test_redelivery_and_ack(ctl, turn)),
                         ("idempotent", lambda: test_idempotent_publish(ctl, turn)),
                         ("chain", lambda: test_chain_with_parent(ctl, turn, turn2)),
                         ("hist chain", lambda: test_history_budget_chain(ctl)),
                         ("bad inputs", lambda: test_bad_inputs(ctl, turn, turn_hist)),
                         ("demo", lambda: test_demo(ctl, not args.full_demo)),
                         ("demo addresses", lambda: test_demo_addresses(ctl)),
                         ("status", lambda: test_status(ctl, turn))]:
            before = len(FAILURES)
            try:
                fn()
            except Exception as e:  # keep going: report every failure
                check(False, f"{name}: exception {e!r}")
            print(f"{name}: {'ok' if len(FAILURES) == before else 'FAILED'}", flush=True)
        rc, out, err = ctl.run("stats")
        st = dict(re.findall(r"^(\w+): (\S+)$", out, re.M))
        check(rc == 0 and int(st.get("messages_committed", 0)) >= 10, f"stats: {rc} {out} {err}")
        check(int(st.get("store_bytes", -1)) >= int(st.get("mailbox_bytes", 0)), f"stats store_bytes: {out}")
    finally:
        code = server.stop()
    check(code is not None, "server stopped")
    if FAILURES:
        print(f"{len(FAILURES)} failure(s); server log in {work}/server.log")
        return 1
    shutil.rmtree(work, ignore_errors=True)
    print("all relay end-to-end checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())

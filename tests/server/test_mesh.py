#!/usr/bin/env python3
"""Several kvrelay-server processes on loopback forming a mesh.

Each agent talks only to its own relay; the relays forward compressed
messages to each other. Checked against real processes:
  - a four-agent chain with parents and a history budget (hist=, so acc
    travels relay to relay), each agent on its own relay, every
    message bit-exact with what one relay composes (and the first hop with
    kvrelayctl compress of the same turn);
  - fan-out to recipients on two relays and on the same relay;
  - a retried publish (same id) is no second message anywhere;
  - a destination down at publish time and started later: delivered once,
    after retries (kvrelayctl status shows the attempts);
  - a destination that refuses: dead-lettered, the reason in kvrelayctl status;
  - CloseSession propagating to every relay, and refusing later forwards;
  - ancestor elision in a 6-round debate: bytes per forward flat, every
    message bit-exact with one relay's;
  - a destination that lost the ancestor (restart): the message goes whole;
  - the route file re-read when it changes, a bad one keeping the last table;
  - the outbox bound refusing a publish, SIGTERM logging what it left;
  - kvrelayctl demo across four relays;
  - a publish that fails after its first layers were forwarded (cut-through)
    leaves nothing at the destination;
  - metrics on the relays matching the accounting.
"""
import argparse
import os
import re
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "testlib"))
import kvrelay_testlib as tl  # noqa: E402
from kvrelay_testlib import (FAILURES, Ctl, check, free_port, metric_total as metric, read_st,  # noqa: E402
                             same_message, wait_for)
from mesh import Mesh, fetch, metrics, single_relay_chain, status_lines  # noqa: E402


def test_chain(ctl, mesh, turns, server_bin, work):
    agents = ["planner", "critic", "refiner", "judger"]
    # hist=8: each hop keeps 8 of its history by acc, which therefore has to
    # travel relay to relay intact for the messages to match one relay's.
    policy = "h2o-head:k=16,hist=8"
    expect = single_relay_chain(ctl, server_bin, work, turns[:3], agents, policy, "chain")
    parent, sent_total, full_total = None, 0, 0
    for i in range(3):
        src, dst = mesh.relays[agents[i]], mesh.relays[agents[i + 1]]
        args = ["publish", "--session", "chain", "--from", agents[i], "--to", agents[i + 1], "--policy", policy,
                "--in", turns[i]]
        if parent:
            args += ["--parent", parent]
        r = ctl.ok(*args, addr=src.addr)
        sent_total += int(r.get("sent_bytes", 0))
        full_total += int(r.get("full_bytes", 0))
        f = ctl.path(f"chain-{i}.st")
        got = fetch(ctl, dst, "chain", agents[i + 1], f)
        check(got.get("message_id") == r.get("message_id"), f"chain hop {i}: the published message arrives")
        same_message(f, expect[i], f"chain hop {i} vs one relay")
        parent = r.get("message_id")
    offline = ctl.path("offline-0.st")
    ctl.ok("compress", "--policy", policy, "--in", turns[0], "--out", offline, addr=False)
    same_message(ctl.path("chain-0.st"), offline, "chain hop 0 vs kvrelayctl compress")
    # Metrics: what the senders forwarded is what the publishes sent, plus
    # each message's acc (relay-side state, 4 bytes per position id, which
    # forwards carry and deliveries do not).
    acc_total = sum(len(raw) for i in range(3)
                    for name, (_, _, raw) in read_st(ctl.path(f"chain-{i}.st"))[1].items() if name.endswith(".pos"))
    fwd = sum(metric(metrics(mesh.relays[a]), "kvrelay_forward_bytes_total") for a in agents)
    check(fwd == sent_total + acc_total,
          f"chain: forwarded bytes {fwd} == the publishes' sent bytes {sent_total} + acc {acc_total}")
    outcomes = sum(metric(metrics(mesh.relays[a]), "kvrelay_forwards_total", outcome="committed") for a in agents)
    check(outcomes == 3, f"chain: 3 forwards committed, metrics say {outcomes}")
    full = sum(metric(metrics(mesh.relays[a]), "kvrelay_forward_full_bytes_total") for a in agents)
    check(full == full_total > 0, f"chain: full-KV bytes of the forwards {full} == the publishes' {full_total}")
    for a in agents[1:]:
        got = metric(metrics(mesh.relays[a]), "kvrelay_forwards_received_total", outcome="committed")
        check(got == 1, f"chain: {a}'s relay received one forward ({got})")


def test_chain_lloyd_demote(ctl, mesh, turns, server_bin, work):
    """Lloyd codes and demoted tokens cross relays as held and reach agents
    decoded: each hop equals one relay's, and hop 0 `kvrelayctl compress
    --decode` of the same turn, bit for bit."""
    agents = ["planner", "critic", "refiner", "judger"]
    policy = "h2o-head:k=16,hist=8+demote:bits=2+lloyd:bits=3,seed=5"
    expect = single_relay_chain(ctl, server_bin, work, turns[:3], agents, policy, "lloyd")
    parent = None
    for i in range(3):
        src, dst = mesh.relays[agents[i]], mesh.relays[agents[i + 1]]
        args = ["publish", "--session", "lloyd", "--from", agents[i], "--to", agents[i + 1], "--policy", policy,
                "--in", turns[i]]
        if parent:
            args += ["--parent", parent]
        r = ctl.ok(*args, addr=src.addr)
        f = ctl.path(f"lloyd-{i}.st")
        got = fetch(ctl, dst, "lloyd", agents[i + 1], f)
        check(got.get("message_id") == r.get("message_id"), f"lloyd hop {i}: the published message arrives")
        meta, _ = read_st(f)
        check("quant_bits" not in meta and meta.get("n_kept") == str(96 - (4 if i == 0 else 0)),
              f"lloyd hop {i}: delivered dense with the demoted tokens among the kept (n_kept {meta.get('n_kept')})")
        same_message(f, expect[i], f"lloyd hop {i} vs one relay")
        parent = r.get("message_id")
    offline = ctl.path("lloyd-offline-0.st")
    ctl.ok("compress", "--policy", policy, "--in", turns[0], "--out", offline, "--decode", addr=False)
    same_message(ctl.path("lloyd-0.st"), offline, "lloyd hop 0 vs kvrelayctl compress --decode")


def test_fan_out(ctl, mesh, turns):
    a, b, c = mesh.relays["planner"], mesh.relays["critic"], mesh.relays["refiner"]
    r = ctl.ok("publish", "--session", "fan", "--from", "planner", "--to", "critic", "--to", "critic2",
               "--to", "refiner", "--to", "local1", "--policy", "h2o-layer:k=16", "--in", turns[0], addr=a.addr)
    files = {}
    for agent, relay in (("critic", b), ("critic2", b), ("refiner", c), ("local1", a)):
        files[agent] = ctl.path(f"fan-{agent}.st")
        got = fetch(ctl, relay, "fan", agent, files[agent])
        check(got.get("message_id") == r.get("message_id"), f"fan-out: {agent} got it")
    for agent in ("critic2", "refiner", "local1"):
        same_message(files[agent], files["critic"], f"fan-out {agent} vs critic")
    # critic and critic2 share relay B: one forward there.
    st = status_lines(ctl, a, "fan", r.get("message_id", "x"))
    check(st.get("critic", {}).get("relay") == mesh.target("critic"), f"fan-out status: {st}")
    check(st.get("local1", {}).get("relay", "") in ("", '""'), f"fan-out: local1 is local: {st.get('local1')}")
    n_b = metric(metrics(b), "kvrelay_forwards_received_total", outcome="committed")
    check(n_b >= 1, f"fan-out: B received the forward ({n_b})")


def test_retry_no_duplicate(ctl, mesh, turns):
    a, b = mesh.relays["planner"], mesh.relays["critic"]
    for attempt in range(2):
        r = ctl.ok("publish", "--session", "dup", "--from", "planner", "--to", "critic", "--id", "m-dup-1",
                   "--policy", "h2o-head:k=16", "--in", turns[0], addr=a.addr)
        check(r.get("duplicate", "false") == ("true" if attempt else "false"), f"dup: attempt {attempt}: {r}")
    fetch(ctl, b, "dup", "critic", ctl.path("dup.st"))
    rc, _, err = ctl.run("fetch", "--session", "dup", "--agent", "critic", "--out", ctl.path("dup2.st"),
                         "--wait", "2", addr=b.addr)
    check(rc == 1 and "DEADLINE_EXCEEDED" in err, f"dup: no second message at the destination: {rc} {err}")


def test_destination_down(ctl, mesh, turns):
    a = mesh.relays["planner"]
    mesh.stop("refiner")
    r = ctl.ok("publish", "--session", "down", "--from", "planner", "--to", "refiner", "--policy", "h2o-head:k=16",
               "--in", turns[0], addr=a.addr)
    mid = r.get("message_id", "x")

    def queued():
        # Queued after a failed attempt: the message is queued from its
        # commit on, before the forwarder's first attempt.
        st = status_lines(ctl, a, "down", mid)
        r = st.get("refiner", {})
        return st if r.get("state") == "queued" and int(r.get("attempts", 0)) >= 1 else None

    st = wait_for(queued, 10) or status_lines(ctl, a, "down", mid)
    check(st.get("refiner", {}).get("state") == "queued" and int(st["refiner"].get("attempts", 0)) >= 1,
          f"down: queued after a failed attempt while the destination is down: {st}")
    c = mesh.start("refiner")
    got = fetch(ctl, c, "down", "refiner", ctl.path("down.st"), wait=30)
    check(got.get("message_id") == mid, "down: delivered after the destination came up")
    rc, _, err = ctl.run("fetch", "--session", "down", "--agent", "refiner", "--out", ctl.path("down2.st"),
                         "--wait", "2", addr=c.addr)
    check(rc == 1 and "DEADLINE_EXCEEDED" in err, f"down: delivered once: {rc} {err}")
    deadline = time.time() + 10
    while time.time() < deadline:
        st = status_lines(ctl, a, "down", mid)
        if st.get("refiner", {}).get("state") == "acked":
            break
        time.sleep(0.2)
    check(st.get("refiner", {}).get("state") == "acked", f"down: the ack was reported back: {st}")
    check(int(st.get("refiner", {}).get("attempts", 0)) >= 2, f"down: retried: {st}")


def test_refused(ctl, mesh, turns):
    a, d = mesh.relays["planner"], mesh.relays["judger"]
    # The destination already holds this id with another header.
    ctl.ok("publish", "--session", "ref", "--from", "judger", "--to", "judger", "--id", "m-taken",
           "--policy", "full", "--in", turns[0], addr=d.addr)
    ctl.ok("publish", "--session", "ref", "--from", "planner", "--to", "judger", "--id", "m-taken",
           "--policy", "h2o-head:k=16", "--in", turns[0], addr=a.addr)
    deadline, st = time.time() + 15, {}
    while time.time() < deadline:
        st = status_lines(ctl, a, "ref", "m-taken")
        if st.get("judger", {}).get("state") == "dead_lettered":
            break
        time.sleep(0.2)
    j = st.get("judger", {})
    check(j.get("state") == "dead_lettered" and "ALREADY_EXISTS" in j.get("reason", ""), f"refused: {st}")
    check(metric(metrics(a), "kvrelay_dead_letters_total", code="ALREADY_EXISTS") >= 1, "refused: dead letter counted")


def test_close_propagates(ctl, mesh, turns):
    names = ["planner", "critic", "refiner", "judger"]
    r = ctl.ok("publish", "--session", "cls", "--from", "planner", "--to", "critic", "--to", "refiner",
               "--policy", "h2o-head:k=16", "--in", turns[0], addr=mesh.relays["planner"].addr)
    fetch(ctl, mesh.relays["critic"], "cls", "critic", ctl.path("cls.st"))
    r2 = ctl.ok("publish", "--session", "cls", "--from", "critic", "--to", "judger", "--parent",
                r.get("message_id", "x"), "--policy", "h2o-head:k=16", "--in", turns[1],
                addr=mesh.relays["critic"].addr)
    fetch(ctl, mesh.relays["judger"], "cls", "judger", ctl.path("cls2.st"), wait=20)
    check(bool(r2), "close: second hop published")
    # Close at the judger's relay: it passes the close on to critic's, which
    # passes it on to planner's, which passes it on to refiner's.
    ctl.ok("close", "--session", "cls", addr=mesh.relays["judger"].addr)
    held = {"planner": [r], "critic": [r, r2], "refiner": [r], "judger": [r2]}
    deadline, open_on = time.time() + 10, names
    while time.time() < deadline and open_on:
        open_on = []
        for n in names:
            for msg in held[n]:
                rc, out, err = ctl.run("status", "--session", "cls", "--id", msg.get("message_id", "x"),
                                       addr=mesh.relays[n].addr)
                if not (rc == 1 and "NOT_FOUND" in err):
                    open_on.append(n)
        time.sleep(0.2)
    check(not open_on, f"close: the session is closed on every relay (still open on {open_on})")
    # A later forward of the closed session is refused at the destination.
    ctl.ok("publish", "--session", "cls", "--from", "planner", "--to", "critic", "--policy", "full",
           "--id", "m-after-close", "--in", turns[0], addr=mesh.relays["planner"].addr)
    rc, _, err = ctl.run("fetch", "--session", "cls", "--agent", "critic", "--out", ctl.path("cls3.st"), "--wait",
                         "2", addr=mesh.relays["critic"].addr)
    check(rc == 1, f"close: nothing delivered after the close: {rc} {err}")


def test_debate_elision(ctl, mesh, turns, server_bin, work):
    rounds = 6
    agents = ["planner" if i % 2 == 0 else "critic" for i in range(rounds + 1)]
    policy = "full"
    expect = single_relay_chain(ctl, server_bin, work, turns[:rounds], agents, policy, "debate")
    parent, per_forward, elided = None, [], []
    for i in range(rounds):
        src, dst = mesh.relays[agents[i]], mesh.relays[agents[i + 1]]
        before = metrics(src)
        args = ["publish", "--session", "debate", "--from", agents[i], "--to", agents[i + 1], "--policy", policy,
                "--in", turns[i]]
        if parent:
            args += ["--parent", parent]
        r = ctl.ok(*args, addr=src.addr)
        f = ctl.path(f"debate-{i}.st")
        fetch(ctl, dst, "debate", agents[i + 1], f)
        same_message(f, expect[i], f"debate round {i} vs one relay")
        deadline = time.time() + 5
        while time.time() < deadline:
            after = metrics(src)
            if metric(after, "kvrelay_forwards_total", outcome="committed") > \
                    metric(before, "kvrelay_forwards_total", outcome="committed"):
                break
            time.sleep(0.1)
        per_forward.append(metric(after, "kvrelay_forward_bytes_total") - metric(before, "kvrelay_forward_bytes_total"))
        elided.append(metric(after, "kvrelay_forward_elided_bytes_total")
                      - metric(before, "kvrelay_forward_elided_bytes_total"))
        parent = r.get("message_id")
    sizes = [int(read_st(f)[0].get("sent_bytes", 0) or 0) for f in expect]
    print(f"debate: bytes per forward {per_forward}, elided {elided}, message sizes {sizes}", flush=True)
    check(all(e > 0 for e in elided[1:]), f"debate: every round after the first elides ({elided})")
    check(max(per_forward[1:]) <= 1.05 * min(per_forward[1:]), f"debate: bytes per forward flat: {per_forward}")
    check(per_forward[-1] < 0.5 * (per_forward[-1] + elided[-1]), f"debate: the last forward sends under half "
                                                                 f"its message ({per_forward[-1]} + {elided[-1]})")



def test_ancestor_missing(ctl, mesh, turns, server_bin, work):
    """The destination lost the ancestor (restart): the message goes whole."""
    expect = single_relay_chain(ctl, server_bin, work, turns[:2], ["planner", "critic", "planner"], "full", "anc")
    a, b = mesh.relays["planner"], mesh.relays["critic"]
    r1 = ctl.ok("publish", "--session", "anc", "--from", "planner", "--to", "critic", "--policy", "full",
                "--in", turns[0], addr=a.addr)
    fetch(ctl, b, "anc", "critic", ctl.path("anc-1.st"))
    mesh.stop("planner")  # planner's relay forgets m1
    a = mesh.start("planner")
    before = metric(metrics(b), "kvrelay_forwards_total", outcome="whole")
    ctl.ok("publish", "--session", "anc", "--from", "critic", "--to", "planner", "--policy", "full",
           "--parent", r1.get("message_id", "x"), "--in", turns[1], addr=b.addr)
    got = fetch(ctl, a, "anc", "planner", ctl.path("anc-2.st"))
    check(got.get("parent") == r1.get("message_id"), f"ancestor missing: delivered with its parent id ({got})")
    same_message(ctl.path("anc-2.st"), expect[1], "ancestor missing: the whole message vs one relay")
    after = metric(metrics(b), "kvrelay_forwards_total", outcome="whole")
    check(after == before + 1, f"ancestor missing: one forward resent whole ({before} -> {after})")


def test_route_file_reload(ctl, mesh, turns):
    """A route file rewritten by rename takes effect; a bad one keeps the last good table."""
    a, c = mesh.relays["planner"], mesh.relays["refiner"]
    routes = dict(mesh.routes)
    reloaded = "reloaded --route-file="

    def rewrite(write, logged, count, what):
        before = a.log().count(logged)
        write()
        check(wait_for(lambda: a.log().count(logged) >= before + count, 15),
              f"route file: {what}: '{logged}' logged within 15 s (polled every second)")

    rewrite(lambda: mesh.write_routes(routes | {"critic2": "refiner"}), reloaded, 1, "critic2 added")
    r = ctl.ok("publish", "--session", "reload", "--from", "planner", "--to", "critic2", "--policy",
               "h2o-head:k=16", "--in", turns[0], addr=a.addr)
    got = fetch(ctl, c, "reload", "critic2", ctl.path("reload.st"))
    check(got.get("message_id") == r.get("message_id"), "route file: critic2 now on refiner's relay")
    rewrite(lambda: mesh.write_file('{"critic2": 42}'), "keeping the last good table", 1, "a bad file")
    r = ctl.ok("publish", "--session", "reload", "--from", "planner", "--to", "critic2", "--policy",
               "h2o-head:k=16", "--in", turns[0], addr=a.addr)
    got = fetch(ctl, c, "reload", "critic2", ctl.path("reload2.st"))
    check(got.get("message_id") == r.get("message_id"), "route file: the last good table stays after a bad file")
    rewrite(lambda: mesh.write_routes(routes), reloaded, 1, "the routes restored")


def test_outbox_and_shutdown(ctl, mesh, turns):
    """--max-outbox-bytes-per-destination refuses a publish; SIGTERM logs what it could not forward."""
    edge = mesh.start("edge", "--max-outbox-bytes-per-destination", "64KiB", "--shutdown-grace-seconds", "2")
    rc, _, err = ctl.run("publish", "--session", "box", "--from", "edge-agent", "--to", "far", "--policy", "full",
                         "--retries", "0", "--in", turns[0], addr=edge.addr)
    check(rc == 1 and "RESOURCE_EXHAUSTED" in err and "--max-outbox-bytes-per-destination" in err,
          f"outbox: a message over the bound is refused naming it: {rc} {err.strip()}")
    r = ctl.ok("publish", "--session", "box", "--from", "edge-agent", "--to", "far", "--policy", "h2o-head:k=16",
               "--in", turns[0], addr=edge.addr)
    st = status_lines(ctl, edge, "box", r.get("message_id", "x"))
    check(st.get("far", {}).get("state") == "queued", f"outbox: queued for a dead destination: {st}")
    rc, took = edge.terminate(timeout=20)
    mesh.relays.pop("edge", None)
    check(rc == 0 and took < 10, f"shutdown: exits within the grace ({rc}, {took:.1f} s)")
    check(f"message={r.get('message_id')}" in edge.log() and "not forwarded" in edge.log(),
          "shutdown: the message it could not forward is logged")


def test_demo_across_relays(ctl, mesh):
    addrs = ",".join(mesh.relays[n].addr for n in ("planner", "critic", "refiner", "judger"))
    rc, out, err = ctl.run("demo", "--addrs", addrs, "--rounds", "1", "--session", "demo", "--layers", "2",
                           "--kv-heads", "2", "--score-heads", "2", "--head-dim", "64", "--prompt", "64", "--gen",
                           "8", "--policy", "h2o-head:k=16", addr=False, timeout=180)
    check(rc == 0 and "to_next_relay" in out, f"demo across relays: rc={rc} {err.strip()[-300:]}")
    m = re.search(r"to_next_relay_bytes=(\d+)", out)
    check(bool(m) and int(m.group(1)) > 0, f"demo: bytes went to the next relays ({out[-400:]})")

def test_failed_publish_leaves_nothing(mesh):
    """Cut-through: the first layers are forwarded while the upload runs, but a
    publish that fails (a chunk of its last layer fails its CRC32C) never becomes
    visible at the destination, and nothing is committed there."""
    try:
        import grpc
        import numpy as np
        from kvrelay import client as kc
        from kvrelay.types import Turn, TurnLayer
        from kvrelay.v1 import relay_pb2 as pb, relay_pb2_grpc as pbg
    except ImportError as e:
        check(False, f"failed publish: the Python client and its stubs are needed ({e}); set PYTHONPATH as ctest does")
        return
    a, b = mesh.relays["planner"], mesh.relays["critic"]
    rng = np.random.default_rng(7)
    L, H, d, n, g = 4, 2, 64, 96, 8
    layers = [TurnLayer(*(rng.standard_normal((H, m, d)).astype(np.float32) for m in (n, n, g, g)),
                        rng.random((H, n)).astype(np.float32)) for _ in range(L)]
    turn = Turn(layers)
    header = pb.PublishHeader(session_id="nan", message_id="m-broken", sender="planner", recipients=["critic"],
                              policy="full", geometry=kc._geometry(turn))

    def requests():
        for req in kc._upload(turn, pb.PublishRequest, pb.PublishRequest(header=header)):
            if req.HasField("chunk") and req.chunk.layer == L - 1:
                req.chunk.crc32c ^= 1  # the last layer arrives corrupted
                time.sleep(0.5)        # while the first layers are forwarded
            yield req

    before = metric(metrics(b), "kvrelay_forwards_received_total", outcome="committed")
    with grpc.insecure_channel(a.addr) as ch:
        try:
            pbg.RelayStub(ch).Publish(requests(), timeout=30)
            check(False, "failed publish: the corrupted upload was accepted")
        except grpc.RpcError as e:
            check(e.code() == grpc.StatusCode.DATA_LOSS, f"failed publish: DATA_LOSS ({e.code()} {e.details()})")
    rc, _, err = tl.run([mesh.ctl.binary, "fetch", "--session", "nan", "--agent", "critic", "--out",
                         mesh.ctl.path("nan-out.st"), "--wait", "3", "--addr", b.addr])
    check(rc == 1 and "DEADLINE_EXCEEDED" in err, f"failed publish: nothing at the destination ({rc} {err.strip()})")
    after = metric(metrics(b), "kvrelay_forwards_received_total", outcome="committed")
    check(after == before, f"failed publish: no forward committed at the destination ({before} -> {after})")
    check("forward dropped session=nan message=m-broken" in a.log(), "failed publish: its forward was dropped")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--kvrelayctl", required=True)
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="kvrelay_mesh_")
    ctl = Ctl(args.kvrelayctl, work)
    names = ["planner", "critic", "refiner", "judger"]
    mesh = Mesh(args.server, work, names)
    mesh.ctl = ctl
    mesh.ports["edge"] = free_port()
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    base_routes = {"planner": "planner", "critic": "critic", "critic2": "critic", "refiner": "refiner",
                   "judger": "judger"}
    mesh.raw_routes = {"far": dead}
    mesh.write_routes(base_routes)
    geo = ["--layers", "3", "--kv-heads", "2", "--score-heads", "4", "--head-dim", "64", "--prompt", "96",
           "--gen", "8"]
    turns = []
    for i in range(6):
        t = ctl.path(f"t{i}.st")
        ctl.ok("make-turn", "--out", t, "--seed", str(i + 1), "--first-agent", "true" if i == 0 else "false", *geo,
               addr=False)
        turns.append(t)
    try:
        for n in names:
            mesh.start(n)
        for name, fn in [("chain", lambda: test_chain(ctl, mesh, turns, args.server, work)),
                         ("chain-lloyd-demote", lambda: test_chain_lloyd_demote(ctl, mesh, turns, args.server, work)),
                         ("fan-out", lambda: test_fan_out(ctl, mesh, turns)),
                         ("retry", lambda: test_retry_no_duplicate(ctl, mesh, turns)),
                         ("destination down", lambda: test_destination_down(ctl, mesh, turns)),
                         ("refused", lambda: test_refused(ctl, mesh, turns)),
                         ("debate", lambda: test_debate_elision(ctl, mesh, turns, args.server, work)),
                         ("close", lambda: test_close_propagates(ctl, mesh, turns)),
                         ("ancestor missing", lambda: test_ancestor_missing(ctl, mesh, turns, args.server, work)),
                         ("route file reload", lambda: test_route_file_reload(ctl, mesh, turns)),
                         ("outbox and shutdown", lambda: test_outbox_and_shutdown(ctl, mesh, turns)),
                         ("demo across relays", lambda: test_demo_across_relays(ctl, mesh)),
                         ("failed publish", lambda: test_failed_publish_leaves_nothing(mesh))]:
            before = len(FAILURES)
            try:
                fn()
            except Exception as e:  # keep going: report every failure
                check(False, f"{name}: exception {e!r}")
            print(f"{name}: {'ok' if len(FAILURES) == before else 'FAILED'}", flush=True)
    finally:
        mesh.stop_all()
    if FAILURES:
        print(f"{len(FAILURES)} failure(s); logs in {work}")
        return 1
    shutil.rmtree(work, ignore_errors=True)
    print("all mesh checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())

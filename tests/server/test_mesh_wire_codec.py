#!/usr/bin/env python3
"""The wire codec across real relays (kvrelay-server processes on loopback).

Relays A (--wire-codec rans), B (--wire-codec none), C (rans) and D (rans),
and in front of C a stand-in for a relay that speaks Forward protocol 1
only: it answers protocol 2 with FAILED_PRECONDITION naming
header.protocol_version, as relays without the wire codec do, and passes
protocol 1 forwards through to C unchanged.

Checked:
  - single messages over every link (A->B rans, B->C none through the old
    relay, A->D rans, D->A rans) for several policies, each fetched message
    bit-identical to kvrelayctl compress of the same turn;
  - A forwarding to the old relay falls back to protocol 1 at once (its log
    says so, the message arrives once, bit-identical), and remembers it;
  - a chain with parents planner(A) -> critic(B) -> refiner(C, old) ->
    judger(D), then back to A, each message bit-exact with what one relay
    composes;
  - kvrelay_wire_bytes_total: below the tensor bytes on rans links, equal on
    none.
"""
import argparse
import os
import queue
import shutil
import sys
import tempfile
import threading
import time
from concurrent import futures

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "testlib"))
from kvrelay_testlib import FAILURES, Ctl, check, free_port, metric_total as metric, same_message  # noqa: E402
from mesh import Mesh, fetch, metrics, single_relay_chain  # noqa: E402

import grpc  # noqa: E402
from kvrelay.v1 import relay_pb2 as pb  # noqa: E402


class OldRelay:
    """A Forward endpoint that speaks protocol 1 only, in front of `target`."""

    def __init__(self, port, target):
        self.refused = 0
        self.passed = 0
        self.channel = grpc.insecure_channel(target)
        self.forward = self.channel.stream_unary("/kvrelay.v1.Relay/Forward",
                                                 request_serializer=pb.ForwardRequest.SerializeToString,
                                                 response_deserializer=pb.ForwardResponse.FromString)
        handler = grpc.method_handlers_generic_handler("kvrelay.v1.Relay", {
            "Forward": grpc.stream_unary_rpc_method_handler(
                self._forward, request_deserializer=pb.ForwardRequest.FromString,
                response_serializer=pb.ForwardResponse.SerializeToString)})
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8),
                                  options=[("grpc.max_receive_message_length", 64 << 20)])
        self.server.add_generic_rpc_handlers((handler,))
        self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.server.start()

    def _forward(self, request_iterator, context):
        first = next(request_iterator)
        v = first.header.protocol_version
        if v != 1:
            self.refused += 1
            for _ in request_iterator:  # what an old relay does: the header decides
                break
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"header.protocol_version: {v}, this relay speaks 1")
        self.passed += 1
        q = queue.Queue()

        def pump():
            q.put(first)
            for r in request_iterator:
                q.put(r)
            q.put(None)
        threading.Thread(target=pump, daemon=True).start()
        try:
            return self.forward(iter(q.get, None), timeout=60)
        except grpc.RpcError as e:
            context.abort(e.code(), e.details())

    def stop(self):
        self.server.stop(0)
        self.channel.close()


def wait_log(server, needle, seconds=15):
    deadline = time.time() + seconds
    while time.time() < deadline:
        if needle in server.log():
            return True
        time.sleep(0.1)
    return False


def test_links(ctl, mesh, old, turns):
    links = [("planner", "critic", "A->B rans"), ("critic", "refiner", "B->C none via the old relay"),
             ("planner", "judger", "A->D rans"), ("judger", "planner2", "D->A rans")]
    i = 0
    # Lloyd and demoted messages cross relays as held and reach agents
    # decoded: they compare with kvrelayctl compress --decode.
    for policy in ("full", "h2o-head:k=8+int4", "h2o-layer:k=8+obf:p=4", "full+int8",
                   "h2o-head:k=8+int2:rotate=hadamard", "full+lloyd:bits=2",
                   "h2o-head:k=8+demote:bits=1+lloyd:bits=3"):
        decode = ["--decode"] if "lloyd" in policy or "demote" in policy else []
        for src, dst, what in links:
            session = f"link{i}"
            turn = turns[i % len(turns)]
            i += 1
            r = ctl.ok("publish", "--session", session, "--from", src, "--to", dst, "--policy", policy,
                       "--in", turn, addr=mesh.relays[mesh.home[src]].addr)
            f = ctl.path(f"{session}.st")
            got = fetch(ctl, mesh.relays[mesh.home[dst]], session, dst, f)
            check(got.get("message_id") == r.get("message_id"), f"{what} {policy}: arrives")
            offline = ctl.path(f"{session}-offline.st")
            ctl.ok("compress", "--policy", policy, "--in", turn, "--out", offline, *decode, addr=False)
            same_message(f, offline, f"{what} {policy} vs kvrelayctl compress {' '.join(decode)}")


def test_fallback_remembered(ctl, mesh, old, turns):
    before_refused, before_passed = old.refused, old.passed
    for k in range(2):
        session = f"fallback{k}"
        r = ctl.ok("publish", "--session", session, "--from", "planner", "--to", "refiner", "--policy",
                   "h2o-head:k=8+int4", "--in", turns[k], addr=mesh.relays["A"].addr)
        f = ctl.path(f"{session}.st")
        got = fetch(ctl, mesh.relays["C"], session, "refiner", f)
        check(got.get("message_id") == r.get("message_id"), f"fallback {k}: arrives through the old relay")
        offline = ctl.path(f"{session}-offline.st")
        ctl.ok("compress", "--policy", "h2o-head:k=8+int4", "--in", turns[k], "--out", offline, addr=False)
        same_message(f, offline, f"fallback {k} vs kvrelayctl compress")
    check(wait_log(mesh.relays["A"], "does not speak protocol 2"), "A fell back to protocol 1 for the old relay")
    check(old.passed - before_passed == 2, f"both went through as protocol 1 ({old.passed - before_passed})")
    check(old.refused - before_refused == 1, f"protocol 2 refused once ({old.refused - before_refused}): "
          "the fallback is remembered for the second")


def test_chain(ctl, mesh, turns, server_bin, work):
    agents = ["planner", "critic", "refiner", "judger", "planner2"]
    policy = "h2o-head:k=16,hist=8"
    expect = single_relay_chain(ctl, server_bin, work, turns[:4], agents, policy, "chain")
    parent = None
    for i in range(4):
        src, dst = agents[i], agents[i + 1]
        args = ["publish", "--session", "chain", "--from", src, "--to", dst, "--policy", policy, "--in", turns[i]]
        if parent:
            args += ["--parent", parent]
        r = ctl.ok(*args, addr=mesh.relays[mesh.home[src]].addr)
        f = ctl.path(f"chain-{i}.st")
        got = fetch(ctl, mesh.relays[mesh.home[dst]], "chain", dst, f)
        check(got.get("message_id") == r.get("message_id"), f"chain hop {i}: arrives")
        same_message(f, expect[i], f"chain hop {i} ({src} -> {dst}) vs one relay")
        parent = r.get("message_id")


def test_metrics(mesh):
    a, b = metrics(mesh.relays["A"]), metrics(mesh.relays["B"])
    wire_a, fwd_a = metric(a, "kvrelay_wire_bytes_total"), metric(a, "kvrelay_forward_bytes_total")
    wire_b, fwd_b = metric(b, "kvrelay_wire_bytes_total"), metric(b, "kvrelay_forward_bytes_total")
    check(0 < wire_a < fwd_a, f"A (rans, some forwards at protocol 1): wire {wire_a} < tensor bytes {fwd_a}")
    check(wire_b == fwd_b > 0, f"B (none): wire {wire_b} == tensor bytes {fwd_b}")
    print(f"metrics: A wire/tensor = {wire_a:.0f}/{fwd_a:.0f} = {wire_a / fwd_a:.3f}; "
          f"B {wire_b:.0f}/{fwd_b:.0f}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--kvrelayctl", required=True)
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="kvrelay_mesh_wire_")
    ctl = Ctl(args.kvrelayctl, work)
    mesh = Mesh(args.server, work, ["A", "B", "C", "D"],
                extra={"A": ["--wire-codec", "rans"], "B": ["--wire-codec", "none"], "D": []})
    mesh.extra["C"] = ["--route", f"refiner={mesh.target('C')}"]  # local on C itself
    old_port = free_port()
    mesh.home = {"planner": "A", "planner2": "A", "critic": "B", "refiner": "C", "judger": "D"}
    routes = {a: r for a, r in mesh.home.items() if a != "refiner"}
    mesh.raw_routes = {"refiner": f"127.0.0.1:{old_port}"}  # everyone reaches C through the old relay
    mesh.write_routes(routes)
    geo = ["--layers", "2", "--kv-heads", "2", "--score-heads", "4", "--head-dim", "64", "--prompt", "80",
           "--gen", "8"]
    turns = []
    for i in range(5):
        t = ctl.path(f"t{i}.st")
        ctl.ok("make-turn", "--out", t, "--seed", str(i + 11), "--first-agent", "true" if i == 0 else "false",
               *geo, addr=False)
        turns.append(t)
    old = None
    try:
        for n in ("A", "B", "C", "D"):
            mesh.start(n)
        old = OldRelay(old_port, mesh.target("C"))
        for name, fn in [("links", lambda: test_links(ctl, mesh, old, turns)),
                         ("fallback remembered", lambda: test_fallback_remembered(ctl, mesh, old, turns)),
                         ("chain", lambda: test_chain(ctl, mesh, turns, args.server, work)),
                         ("metrics", lambda: test_metrics(mesh))]:
            before = len(FAILURES)
            try:
                fn()
            except Exception as e:  # keep going: report every failure
                check(False, f"{name}: exception {e!r}")
            print(f"{name}: {'ok' if len(FAILURES) == before else 'FAILED'}", flush=True)
    finally:
        mesh.stop_all()
        if old:
            old.stop()
    if FAILURES:
        print(f"{len(FAILURES)} failure(s); logs in {work}")
        return 1
    shutil.rmtree(work, ignore_errors=True)
    print("all wire codec mesh checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())

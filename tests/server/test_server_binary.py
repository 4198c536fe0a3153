#!/usr/bin/python3
"""The kvrelay-server binary end to end, on 127.0.0.1 with port 0.

Checks:
  1. the ready line, that both printed ports accept connections, and
     `kvrelayctl health` (SERVING, also for the service kvrelay.v1.Relay);
  2. after a few publishes/fetches and a small demo, a live /metrics scrape
     passes `promtool check metrics`, and its counters equal the accounting
     the publishes returned (received, full, sent and saved bytes per family,
     committed/delivered/acked messages, histogram counts, zero gauges);
  3. gRPC server reflection: a raw HTTP/2 call (stdlib sockets, no gRPC
     library) lists kvrelay.v1.Relay, grpc.health.v1.Health and reflection,
     and returns relay.proto's descriptor for the symbol kvrelay.v1.Relay;
  4. SIGTERM while a Fetch waits: exit status 0 within the grace period
     + 5 s, health no longer SERVING, both ports closed; the waiting fetch
     ends; bad flags exit 2 naming the flag; --help exits 0;
  5. configuration: KVRELAY_LISTEN / KVRELAY_METRICS_LISTEN without flags,
     --config FILE (JSON) and KVRELAY_CONFIG, precedence flag > env > file,
     bad environment values exit 2 naming the variable;
  6. --listen twice (TCP and unix:PATH): the ready line lists both, each
     serves (a publish on one, its fetch on the other, bit-exact with
     `kvrelayctl compress`), the socket is mode 0666 and gone after SIGTERM;
     a stale socket is replaced, a socket in use and a regular file are
     refused (exit 1, the file intact), a Unix socket alone serves too.

Stdlib only (run with /usr/bin/python3). promtool is required: it is
installed by scripts/install_deps.sh, so a missing promtool is a failure.
Every child process has a bounded timeout and every server started is
killed at the end.
"""
import argparse
import json
import os
import re
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "testlib"))
import kvrelay_testlib as tl  # noqa: E402
from kvrelay_testlib import FAILURES, Ctl, Server, check, clean_env, port_open, run  # noqa: E402

def policy_family(spec):
    """server/metrics/metrics.cc PolicyFamily: the stage names joined by '+'."""
    return "+".join(stage.split(":", 1)[0] for stage in spec.split("+"))


# ---------------------------------------------------------------- exposition


def parse_exposition(text):
    """{(name, frozenset(labels.items())): value} of a text-format scrape; an
    unparsable line is a failure."""
    return tl.parse_exposition(text, on_bad_line=lambda line: check(False, f"metrics: unparsable line {line!r}"))


def metric(samples, name, **labels):
    return samples.get((name, frozenset(labels.items())))


def metric_sum(samples, name):
    return sum(v for (n, _), v in samples.items() if n == name)


def metric_by(samples, name, label):
    return {dict(ls).get(label): v for (n, ls), v in samples.items() if n == name}


# ---------------------------------------------------- raw HTTP/2 reflection


def _frame(ftype, flags, stream, payload=b""):
    return (struct.pack(">I", len(payload))[1:] + bytes([ftype, flags]) +
            struct.pack(">I", stream) + payload)


def _hpack_literal(name, value):
    """Literal header field without indexing, new name, no Huffman (RFC 7541 6.2.2)."""
    def s(x):
        b = x.encode()
        assert len(b) < 127
        return bytes([len(b)]) + b
    return b"\x00" + s(name) + s(value)


def _varint(buf, i):
    shift = result = 0
    while True:
        b = buf[i]
        i += 1
        result |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return result, i


def pb_fields(buf):
    """Protobuf wire format -> [(field, value)]; LEN values as bytes."""
    out, i = [], 0
    while i < len(buf):
        key, i = _varint(buf, i)
        field, wt = key >> 3, key & 7
        if wt == 0:
            v, i = _varint(buf, i)
        elif wt == 1:
            v, i = buf[i:i + 8], i + 8
        elif wt == 2:
            n, i = _varint(buf, i)
            v, i = buf[i:i + n], i + n
        elif wt == 5:
            v, i = buf[i:i + 4], i + 4
        else:
            raise ValueError(f"wire type {wt}")
        out.append((field, v))
    return out


def pb_string(field, s):
    b = s.encode()
    assert len(b) < 128
    return bytes([(field << 3) | 2, len(b)]) + b


def grpc_raw_call(hostport, path, requests, timeout=10.0):
    """One gRPC call over cleartext HTTP/2 with hand-made frames.

    Sends `requests` (serialized messages) and half-closes; returns
    (response messages, error or None). Response headers are not decoded
    (HPACK); the responses come from the DATA frames."""
    host, port = hostport.rsplit(":", 1)
    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
    sock.settimeout(timeout)
    headers = b"".join(_hpack_literal(n, v) for n, v in [
        (":method", "POST"), (":scheme", "http"), (":path", path), (":authority", hostport),
        ("content-type", "application/grpc"), ("te", "trailers")])
    body = b"".join(b"\x00" + struct.pack(">I", len(r)) + r for r in requests)
    try:
        sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(4, 0, 0) +
                     _frame(1, 0x4, 1, headers) + _frame(0, 0x1, 1, body))
        buf, data, deadline = b"", b"", time.monotonic() + timeout
        while time.monotonic() < deadline:
            while len(buf) >= 9:
                n = int.from_bytes(buf[:3], "big")
                if len(buf) < 9 + n:
                    break
                ftype, flags, stream = buf[3], buf[4], int.from_bytes(buf[5:9], "big") & 0x7FFFFFFF
                payload, buf = buf[9:9 + n], buf[9 + n:]
                if ftype == 4 and not flags & 0x1:  # SETTINGS: acknowledge
                    sock.sendall(_frame(4, 0x1, 0))
                elif ftype == 6 and not flags & 0x1:  # PING: answer
                    sock.sendall(_frame(6, 0x1, 0, payload))
                elif ftype == 0 and stream == 1:  # DATA
                    if flags & 0x8:  # PADDED
                        payload = payload[1:len(payload) - payload[0]]
                    data += payload
                    if payload:  # keep the windows open
                        inc = struct.pack(">I", len(payload))
                        sock.sendall(_frame(8, 0, 0, inc) + _frame(8, 0, 1, inc))
                    if flags & 0x1:
                        return _grpc_messages(data), None
                elif ftype == 1 and stream == 1 and flags & 0x1:  # trailers
                    return _grpc_messages(data), None
                elif ftype == 3 and stream == 1:  # RST_STREAM
                    return _grpc_messages(data), f"RST_STREAM {int.from_bytes(payload, 'big')}"
                elif ftype == 7:  # GOAWAY
                    return _grpc_messages(data), f"GOAWAY {payload[4:8].hex()}"
            chunk = sock.recv(65536)
            if not chunk:
                return _grpc_messages(data), "connection closed"
            buf += chunk
        return _grpc_messages(data), "timed out"
    except OSError as e:
        return [], f"socket error {e!r}"
    finally:
        sock.close()


def _grpc_messages(data):
    msgs, i = [], 0
    while i + 5 <= len(data):
        n = int.from_bytes(data[i + 1:i + 5], "big")
        msgs.append(data[i + 5:i + 5 + n])
        i += 5 + n
    return msgs


def test_reflection(server):
    requests = [pb_string(7, "*"),                       # list_services
                pb_string(4, "kvrelay.v1.Relay")]        # file_containing_symbol
    msgs, err = [], None
    for version in ("v1alpha", "v1"):
        msgs, err = grpc_raw_call(server.addr, f"/grpc.reflection.{version}.ServerReflection/"
                                  "ServerReflectionInfo", requests)
        if len(msgs) == 2:
            print(f"reflection: grpc.reflection.{version} answered", flush=True)
            break
    if not check(len(msgs) == 2, f"reflection: 2 responses expected, got {len(msgs)} ({err})"):
        return
    services = []
    for field, v in pb_fields(msgs[0]):
        if field == 6:  # list_services_response
            for f2, svc in pb_fields(v):
                if f2 == 1:
                    services += [n.decode() for f3, n in pb_fields(svc) if f3 == 1]
        elif field == 7:
            check(False, f"reflection: list_services error {v!r}")
    print(f"reflection: services {services}", flush=True)
    check("kvrelay.v1.Relay" in services, f"reflection lists kvrelay.v1.Relay: {services}")
    check("grpc.health.v1.Health" in services,
          f"reflection lists grpc.health.v1.Health: {services}")
    check(any(s.startswith("grpc.reflection.") for s in services),
          f"reflection lists itself: {services}")
    # The descriptor of relay.proto: package kvrelay.v1, service Relay and its RPCs.
    files = [fd for field, v in pb_fields(msgs[1]) if field == 4
             for f2, fd in pb_fields(v) if f2 == 1]
    methods = None
    for fd in files:
        fields = pb_fields(fd)
        if (2, b"kvrelay.v1") not in fields:
            continue
        for field, svc in fields:
            if field == 6 and (1, b"Relay") in pb_fields(svc):
                methods = [dict(pb_fields(m)).get(1, b"").decode()
                           for f2, m in pb_fields(svc) if f2 == 2]
    check(methods is not None, f"reflection: descriptor of kvrelay.v1.Relay ({len(files)} files)")
    if methods is not None:
        print(f"reflection: kvrelay.v1.Relay methods {methods}", flush=True)
        for rpc in ("Publish", "Fetch", "Ack", "CloseSession", "Compress", "Stats"):
            check(rpc in methods, f"reflection: kvrelay.v1.Relay has {rpc}: {methods}")


# --------------------------------------------------------------------- tests


def test_ready_and_health(ctl, server):
    check(re.fullmatch(r"127\.0\.0\.1:\d+", server.addr) and not server.addr.endswith(":0"),
          f"ready line: grpc is the bound 127.0.0.1 port: {server.ready_line}")
    check(re.fullmatch(r"127\.0\.0\.1:\d+", server.metrics) and not server.metrics.endswith(":0"),
          f"ready line: metrics is the bound 127.0.0.1 port: {server.ready_line}")
    check(server.addr != server.metrics, "ready line: two different ports")
    check(port_open(server.addr), f"grpc port {server.addr} accepts connections")
    check(port_open(server.metrics), f"metrics port {server.metrics} accepts connections")
    rc, out, err = ctl.run("health", "--timeout", "5", addr=server.addr)
    check(rc == 0 and out.strip() == "SERVING", f"health: rc={rc} out={out!r} err={err!r}")
    rc, out, err = ctl.run("health", "--service", "kvrelay.v1.Relay", "--timeout", "5",
                           addr=server.addr)
    check(rc == 0 and out.strip() == "SERVING", f"health kvrelay.v1.Relay: rc={rc} {out!r} {err!r}")
    rc, out, err = ctl.run("health", "--service", "no.such.Service", "--timeout", "5", addr=server.addr)
    check(rc == 1 and out.strip() == "SERVICE_UNKNOWN", f"health no.such.Service: rc={rc} {out!r} {err!r}")
    # The probe built into the server binary (the Dockerfile's HEALTHCHECK).
    rc, out, err = run([server.binary, "health", "--addr", server.addr, "--timeout", "5"], timeout=20)
    check(rc == 0 and out.strip() == "SERVING", f"kvrelay-server health: rc={rc} {out!r} {err!r}")
    rc, out, err = run([server.binary, "health", "--timeout", "0"], timeout=20)
    check(rc == 2 and "--timeout=0" in err, f"kvrelay-server health --timeout 0: rc={rc} {err!r}")
    rc, out, err = run([server.binary, "health", f"--addr={server.addr}", "--timeout=5"], timeout=20)
    check(rc == 0 and out.strip() == "SERVING", f"kvrelay-server health --addr=HOST:PORT: rc={rc} {out!r} {err!r}")
    port = int(server.addr.rsplit(":", 1)[1])
    rc, out, err = run([server.binary, "health", "--addr", f"127.0.0.1:{port + 65536}"], timeout=20)
    check(rc == 2 and "--addr" in err and "1..65535" in err,
          f"kvrelay-server health with port {port + 65536} (gRPC would dial {port}): rc={rc} {out!r} {err!r}")


def scrape(metrics_addr, timeout=10):
    with urllib.request.urlopen(f"http://{metrics_addr}/metrics", timeout=timeout) as r:
        check(r.status == 200, f"/metrics: HTTP {r.status}")
        ctype = r.headers.get("Content-Type", "")
        check(ctype.startswith("text/plain"), f"/metrics: content type {ctype!r}")
        return r.read().decode()


def test_metrics(ctl, server, promtool, turn, turn2):
    addr = server.addr
    # Publishes with several policy families, one fan-out, one chain with a
    # parent, one duplicate (not counted again), every delivery fetched and acked.
    published = []
    for i, policy in enumerate(["full", "h2o-head:k=8", "h2o-layer:k=8+obf:p=4,mode=fast",
                                "h2o-head:k=8+obf:p=4+int4:rotate=hadamard", "gen"]):
        r = ctl.ok("publish", "--session", f"m{i}", "--from", "a", "--to", "b", "--policy",
                   policy, "--in", turn, addr=addr)
        published.append(r)
        ctl.ok("fetch", "--session", f"m{i}", "--agent", "b", "--out", ctl.path(f"m{i}.msg"),
               "--wait", "10", addr=addr)
    deliveries = len(published)
    r = ctl.ok("publish", "--session", "fan", "--from", "a", "--to", "b", "--to", "c",
               "--id", "fan-1", "--policy", "h2o-head:k=4", "--in", turn, addr=addr)
    published.append(r)
    dup = ctl.ok("publish", "--session", "fan", "--from", "a", "--to", "b", "--to", "c",
                 "--id", "fan-1", "--policy", "h2o-head:k=4", "--in", turn, addr=addr)
    check(dup.get("duplicate") == "true", f"metrics: re-publish is a duplicate: {dup.get('_out')}")
    for agent in ("b", "c"):
        ctl.ok("fetch", "--session", "fan", "--agent", agent, "--out", ctl.path(f"fan.{agent}"),
               "--wait", "10", addr=addr)
    deliveries += 2
    r1 = ctl.ok("publish", "--session", "chain", "--from", "planner", "--to", "critic",
                "--policy", "h2o-head:k=8", "--in", turn, addr=addr)
    published.append(r1)
    ctl.ok("fetch", "--session", "chain", "--agent", "critic", "--out", ctl.path("c1"),
           "--wait", "10", addr=addr)
    r2 = ctl.ok("publish", "--session", "chain", "--from", "critic", "--to", "refiner",
                "--policy", "h2o-head:k=8", "--parent", r1.get("message_id", "x"), "--in", turn2,
                addr=addr)
    published.append(r2)
    ctl.ok("fetch", "--session", "chain", "--agent", "refiner", "--out", ctl.path("c2"),
           "--wait", "10", addr=addr)
    deliveries += 2
    # A small demo: 3 hops, each published with its parent, fetched and acked.
    rc, out, err = ctl.run("demo", "--rounds", "1", "--session", "metrics-demo", "--layers", "3",
                           "--kv-heads", "2", "--score-heads", "4", "--head-dim", "64",
                           "--prompt", "96", "--gen", "8", addr=addr, timeout=300)
    demo = {}
    if check(rc == 0, f"demo: rc={rc} {err}"):
        m = re.search(r"^totals:.*$", out, re.M)
        demo = dict(re.findall(r"(\w+)=(\S+)", m.group(0))) if m else {}
        check(demo.get("hops") == "3", f"demo: 3 hops: {out}")
        deliveries += 3
    demo_policy = "h2o-head:k=32+obf:p=8,mode=fast"

    if not check(all(published) and demo, "metrics: every publish succeeded"):
        return
    want = {"received": 0, "committed": 0, "full": {}, "sent": {}}
    for r in published:
        fam = policy_family(r["policy"])
        want["received"] += int(r["received_bytes"])
        want["committed"] += 1
        want["full"][fam] = want["full"].get(fam, 0) + int(r["full_bytes"])
        want["sent"][fam] = want["sent"].get(fam, 0) + int(r["sent_bytes"])
    # The duplicate's upload is received too (it is streamed before the relay
    # knows it is a duplicate), but it commits nothing.
    dup_received = int(dup.get("received_bytes", 0))
    fam = policy_family(demo_policy)
    want["received"] += int(demo["received_bytes"])
    want["committed"] += int(demo["hops"])
    want["full"][fam] = want["full"].get(fam, 0) + int(demo["full_bytes"])
    want["sent"][fam] = want["sent"].get(fam, 0) + int(demo["sent_bytes"])
    print(f"metrics: expecting {want}", flush=True)

    # promtool on two live scrapes (the second one has the exposer's own
    # scrape metrics filled in): no problems at all, warnings included.
    for i in (1, 2):
        text = scrape(server.metrics)
        with open(ctl.path(f"scrape{i}.txt"), "w") as f:
            f.write(text)
        try:
            p = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                               text=True, timeout=60)
            rc, out, err = p.returncode, p.stdout, p.stderr
        except subprocess.TimeoutExpired:
            rc, out, err = None, "", "promtool timed out"
        problems = (out + err).strip()
        if problems:
            print(f"promtool check metrics (scrape {i}) says:\n{problems}", flush=True)
        check(rc == 0 and not problems,
              f"promtool check metrics, scrape {i}: rc={rc}: {problems!r}")
        check(len(text) > 0 and "kvrelay_build_info" in text, f"scrape {i} has the relay's metrics")

    s = parse_exposition(text)
    received = metric(s, "kvrelay_received_bytes_total")
    check(received is not None and want["received"] <= received <= want["received"] + dup_received,
          f"kvrelay_received_bytes_total {received} == published {want['received']}"
          f" (+ duplicate upload {dup_received})")
    check(metric(s, "kvrelay_messages_total", outcome="committed") == want["committed"],
          f"kvrelay_messages_total{{outcome=committed}} "
          f"{metric(s, 'kvrelay_messages_total', outcome='committed')} == {want['committed']}")
    check(metric(s, "kvrelay_messages_total", outcome="duplicate") == 1,
          f"kvrelay_messages_total{{outcome=duplicate}} "
          f"{metric(s, 'kvrelay_messages_total', outcome='duplicate')} == 1")
    check(metric(s, "kvrelay_messages_total", outcome="delivered") == deliveries,
          f"kvrelay_messages_total{{outcome=delivered}} "
          f"{metric(s, 'kvrelay_messages_total', outcome='delivered')} == {deliveries}")
    check(metric(s, "kvrelay_messages_total", outcome="acked") == deliveries,
          f"kvrelay_messages_total{{outcome=acked}} "
          f"{metric(s, 'kvrelay_messages_total', outcome='acked')} == {deliveries}")
    for what in ("full", "sent"):
        name = f"kvrelay_{what}_bytes_total"
        got = metric_by(s, name, "family")
        check(got == {k: float(v) for k, v in want[what].items()},
              f"{name} by family {got} == {want[what]}")
        check(metric_sum(s, name) == sum(want[what].values()),
              f"{name} total {metric_sum(s, name)} == {sum(want[what].values())}")
    saved = metric_by(s, "kvrelay_saved_bytes_total", "family")
    check(saved == {k: float(want["full"][k] - want["sent"][k]) for k in want["full"]},
          f"kvrelay_saved_bytes_total {saved} == full - sent")
    for h in ("kvrelay_compress_seconds", "kvrelay_publish_visible_seconds"):
        check(metric(s, f"{h}_count") == want["committed"],
              f"{h}_count {metric(s, f'{h}_count')} == {want['committed']}")
        check(metric(s, f"{h}_bucket", le="+Inf") == metric(s, f"{h}_count"), f"{h}: +Inf bucket")
    # Observed at each recipient's first complete delivery (fan-out: one per recipient).
    check(metric(s, "kvrelay_publish_delivered_seconds_count") == deliveries,
          f"kvrelay_publish_delivered_seconds_count "
          f"{metric(s, 'kvrelay_publish_delivered_seconds_count')} == {deliveries}")
    check(metric(s, "kvrelay_inflight_bytes") == 0, "kvrelay_inflight_bytes is 0 when idle")
    check(metric(s, "kvrelay_fetches_waiting") == 0, "kvrelay_fetches_waiting is 0 when idle")
    check(metric(s, "kvrelay_mailbox_messages") == 0, "kvrelay_mailbox_messages is 0: all acked")
    check(metric(s, "kvrelay_mailbox_bytes") == 0, "kvrelay_mailbox_bytes is 0: all acked")
    build = [v for (n, _), v in s.items() if n == "kvrelay_build_info"]
    check(build == [1.0], f"kvrelay_build_info is 1: {build}")
    # Every publish that committed or was a duplicate finished OK; nothing
    # failed in this scenario, so every error series (pre-created) is 0.
    ok_publishes = metric(s, "kvrelay_rpcs_total", method="Publish", code="OK")
    check(ok_publishes == want["committed"] + 1,
          f"kvrelay_rpcs_total{{method=Publish,code=OK}} {ok_publishes} == "
          f"{want['committed']} committed + 1 duplicate")
    check(metric(s, "kvrelay_rpcs_total", method="Fetch", code="OK") == deliveries,
          f"kvrelay_rpcs_total{{method=Fetch,code=OK}} == {deliveries} deliveries")
    errors = metric_by(s, "kvrelay_errors_total", "code")
    check(errors and set(errors.values()) == {0.0} and "INVALID_ARGUMENT" in errors,
          f"kvrelay_errors_total pre-created and all 0: {errors}")
    # The Stats RPC agrees with the scrape.
    rc, out, err = ctl.run("stats", addr=addr)
    st = dict(re.findall(r"^(\w+): (\S+)$", out, re.M))
    check(rc == 0 and st.get("full_bytes") == str(sum(want["full"].values())) and
          st.get("sent_bytes") == str(sum(want["sent"].values())) and
          st.get("messages_committed") == str(want["committed"]),
          f"stats agrees with the scrape: {st}")


def test_sigterm(ctl, server_bin, work, turn):
    grace = 2.0
    server = Server(server_bin, work, ["--listen", "127.0.0.1:0", "--metrics-listen",
                                       "127.0.0.1:0", "--shutdown-grace-seconds", str(grace)],
                    name="sigterm")
    rc, out, _ = ctl.run("health", addr=server.addr)
    check(rc == 0 and out.strip() == "SERVING", f"sigterm server healthy: {rc} {out!r}")
    fetch = subprocess.Popen([ctl.binary, "fetch", "--addr", server.addr, "--session", "term",
                              "--agent", "b", "--out", ctl.path("term.msg"), "--wait", "30"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=clean_env())
    try:
        waiting = tl.wait_for(lambda: metric(parse_exposition(scrape(server.metrics)), "kvrelay_fetches_waiting") == 1,
                              timeout=15)
        check(waiting and fetch.poll() is None, "the background fetch is waiting (kvrelay_fetches_waiting 1)")
        # During the drain the relay must not report SERVING.
        rc_code, took = None, None
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        hrc, hout, herr = ctl.run("health", "--timeout", "1", addr=server.addr, timeout=10)
        check(hrc != 0 and hout.strip() != "SERVING",
              f"health during shutdown is not SERVING: rc={hrc} out={hout!r} err={herr.strip()!r}")
        print(f"sigterm: health during drain: rc={hrc} {hout.strip()} {herr.strip()}", flush=True)
        try:
            rc_code = server.proc.wait(timeout=max(0.1, grace + 5 - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            pass
        took = time.monotonic() - t0
        check(rc_code == 0, f"SIGTERM: exit status {rc_code} (want 0 within {grace + 5} s; "
                            f"took {took:.2f} s, log {server.log_path})")
        print(f"sigterm: exited {rc_code} after {took:.2f} s (grace {grace} s)", flush=True)
        try:
            fout, ferr = fetch.communicate(timeout=10)
            print(f"sigterm: waiting fetch ended rc={fetch.returncode} {ferr.strip()}", flush=True)
            check(fetch.returncode != 0, f"the waiting fetch got no message: {fout!r}")
        except subprocess.TimeoutExpired:
            check(False, "the waiting fetch ended within 10 s of the server's exit")
    finally:
        if fetch.poll() is None:
            fetch.kill()
            fetch.wait(timeout=10)
        server.kill()
    rc, out, err = ctl.run("health", "--timeout", "2", addr=server.addr, timeout=15)
    check(rc != 0 and out.strip() != "SERVING", f"health after exit: rc={rc} {out!r} {err!r}")
    rc, out, err = run([server.binary, "health", "--addr", server.addr, "--timeout", "2"], timeout=15)
    check(rc == 1 and "UNAVAILABLE" in err, f"kvrelay-server health after exit: rc={rc} {out!r} {err!r}")
    check(not port_open(server.addr), f"grpc port {server.addr} closed after exit")
    check(not port_open(server.metrics), f"metrics port {server.metrics} closed after exit")
    with open(server.log_path) as f:
        log = f.read()
    check("SIGTERM" in log and "stopped" in log, f"shutdown logged: {log[-500:]!r}")


def test_flags(server_bin):
    rc, out, err = run([server_bin, "--listen", "nonsense"], timeout=20)
    check(rc == 2 and "--listen" in err, f"--listen nonsense: rc={rc} stderr={err.strip()!r}")
    rc, out, err = run([server_bin, "--listen", "127.0.0.1:70000"], timeout=20)
    check(rc == 2 and "--listen" in err and "65535" in err,
          f"--listen port out of range: rc={rc} stderr={err.strip()!r}")
    rc, out, err = run([server_bin, "--bogus"], timeout=20)
    check(rc == 2 and "--bogus" in err, f"--bogus: rc={rc} stderr={err.strip()!r}")
    rc, out, err = run([server_bin, "--max-inflight-bytes", "lots"], timeout=20)
    check(rc == 2 and "--max-inflight-bytes" in err,
          f"--max-inflight-bytes lots: rc={rc} stderr={err.strip()!r}")
    rc, out, err = run([server_bin, "--default-policy", "h2o-head:k=8+bogus"], timeout=20)
    check(rc == 2 and "--default-policy" in err and "bogus" in err,
          f"bad --default-policy: rc={rc} stderr={err.strip()!r}")
    rc, out, err = run([server_bin, "--help"], timeout=20)
    check(rc == 0 and "--listen" in out and "--metrics-listen" in out and
          "--shutdown-grace-seconds" in out, f"--help: rc={rc} out={out[:200]!r} err={err!r}")


def test_config(ctl, server_bin, work, turn):
    # Environment fallback: no --listen / --metrics-listen at all.
    env = clean_env(KVRELAY_LISTEN="127.0.0.1:0", KVRELAY_METRICS_LISTEN="127.0.0.1:0",
                    KVRELAY_DEFAULT_POLICY="gen")
    s = Server(server_bin, work, [], env=env, name="env")
    try:
        check(s.addr.startswith("127.0.0.1:") and s.metrics.startswith("127.0.0.1:"),
              f"KVRELAY_LISTEN: {s.ready_line}")
        rc, out, _ = ctl.run("health", addr=s.addr)
        check(rc == 0 and out.strip() == "SERVING", f"KVRELAY_LISTEN server healthy: {rc} {out!r}")
        check(port_open(s.metrics), "KVRELAY_METRICS_LISTEN port open")
        r = ctl.ok("publish", "--session", "env", "--from", "a", "--to", "b", "--in", turn,
                   addr=s.addr)
        check(policy_family(r.get("policy", "")) == "gen",
              f"KVRELAY_DEFAULT_POLICY applies: {r.get('policy')}")
    finally:
        rc = s.stop()
    check(rc == 0, f"env server exit status {rc}")

    # --config FILE: keys are flag names, '-' or '_' alike.
    cfg = ctl.path("relay.json")
    with open(cfg, "w") as f:
        json.dump({"listen": "127.0.0.1:0", "metrics_listen": "off",
                   "default-policy": "h2o-layer:k=4", "shutdown_grace_seconds": 1,
                   "role-policy": {"critic": "full"}}, f)
    s = Server(server_bin, work, ["--config", cfg], name="config")
    try:
        check(s.addr.startswith("127.0.0.1:") and s.metrics == "off",
              f"--config: listen from the file, metrics off: {s.ready_line}")
        rc, out, _ = ctl.run("health", addr=s.addr)
        check(rc == 0 and out.strip() == "SERVING", f"--config server healthy: {rc} {out!r}")
        r = ctl.ok("publish", "--session", "cfg", "--from", "a", "--to", "b", "--in", turn,
                   addr=s.addr)
        check(r.get("policy", "").startswith("h2o-layer:k=4"),
              f"--config default-policy applies: {r.get('policy')}")
        r = ctl.ok("publish", "--session", "cfg", "--from", "a", "--to", "b", "--role", "critic",
                   "--in", turn, addr=s.addr)
        check(r.get("policy") == "full", f"--config role-policy applies: {r.get('policy')}")
    finally:
        rc = s.stop()
    check(rc == 0, f"config server exit status {rc}")

    # KVRELAY_CONFIG, with the environment over the file and a flag over both.
    env = clean_env(KVRELAY_CONFIG=cfg, KVRELAY_DEFAULT_POLICY="gen")
    s = Server(server_bin, work, [], env=env, name="config-env")
    try:
        check(s.metrics == "off", f"KVRELAY_CONFIG read: {s.ready_line}")
        r = ctl.ok("publish", "--session", "cfg", "--from", "a", "--to", "b", "--in", turn,
                   addr=s.addr)
        check(policy_family(r.get("policy", "")) == "gen",
              f"environment over the config file: {r.get('policy')}")
    finally:
        s.stop()
    s = Server(server_bin, work, ["--default-policy", "full"], env=env, name="config-flag")
    try:
        r = ctl.ok("publish", "--session", "cfg", "--from", "a", "--to", "b", "--in", turn,
                   addr=s.addr)
        check(r.get("policy") == "full", f"flag over environment: {r.get('policy')}")
    finally:
        s.stop()

    # Bad values name their source.
    rc, _, err = run([server_bin], env=clean_env(KVRELAY_LISTEN="nonsense"), timeout=20)
    check(rc == 2 and "KVRELAY_LISTEN" in err, f"KVRELAY_LISTEN=nonsense: rc={rc} {err.strip()!r}")
    bad = ctl.path("bad.json")
    with open(bad, "w") as f:
        f.write("{\"listen\": ")
    rc, _, err = run([server_bin, "--config", bad], timeout=20)
    check(rc == 2 and "--config" in err, f"--config with bad JSON: rc={rc} {err.strip()!r}")
    rc, _, err = run([server_bin, "--config", ctl.path("missing.json")], timeout=20)
    check(rc == 2 and "missing.json" in err, f"--config missing file: rc={rc} {err.strip()!r}")


def test_operations(ctl, server_bin, work, turn):
    """What an operator meets: a log reader that goes away, a port already
    in use, JSON logs, IPv6 for the metrics listener, bad timeouts."""
    # 1. stdout is a pipe whose reader exits after the ready line (| head):
    # the relay keeps serving (it used to die of SIGPIPE at its next log line).
    p = subprocess.Popen([server_bin, "--listen", "127.0.0.1:0", "--metrics-listen", "off"],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=clean_env())
    tl.STARTED.append(p)
    try:
        m = tl.READY_RE.search(p.stdout.readline().decode() + p.stdout.readline().decode())
        check(m is not None, "pipe: ready line read")
        p.stdout.close()  # the reader is gone
        addr = m.group(1) if m else "127.0.0.1:1"
        for i in range(2):
            ctl.ok("publish", "--session", "pipe", "--from", "a", "--to", "b", "--retries", "0",
                   "--in", turn, addr=addr)
        time.sleep(0.2)
        check(p.poll() is None, f"pipe: relay alive after its stdout reader left (exit {p.poll()})")

        # 2. A second relay on the same port fails instead of sharing it (the
        # kernel would split connections between two separate stores).
        rc, out, err = run([server_bin, "--listen", addr, "--metrics-listen", "off"], timeout=20)
        check(rc == 1 and "cannot listen" in err and "in use" in err,
              f"second relay on {addr}: rc={rc} {err.strip()[-200:]!r}")
        rc, out, _ = ctl.run("health", addr=addr)
        check(rc == 0 and out.strip() == "SERVING", f"first relay still serving: {rc} {out!r}")
    finally:
        p.terminate()
        p.wait(timeout=20)

    # 3. --log-json: every stdout line is a JSON object, the ready line too,
    # however odd the text a client sent (quotes, backslashes, control bytes).
    s = Server(server_bin, work, ["--listen", "127.0.0.1:0", "--metrics-listen", "off", "--log-json"],
               name="json")
    try:
        ctl.run("publish", "--session", "json", "--from", "a", "--to", "b", "--policy",
                'h2o-head:k="\\\t', "--in", turn, addr=s.addr)
        # A header whose role is not UTF-8: libprotobuf logs it, through the
        # relay's logger (it used to print its own line on stderr).
        bad_role = b"\x0a\x03" + b"\x2a\x01\xff"  # PublishRequest{header{role: "\xff"}}
        grpc_raw_call(s.addr, "/kvrelay.v1.Relay/Publish", [bad_role])
    finally:
        s.stop()
    lines = [l for l in s.log().splitlines() if l.strip()]
    bad = []
    for l in lines:
        try:
            json.loads(l)
        except ValueError:
            bad.append(l)
    check(not bad, f"--log-json: lines that are not JSON: {bad[:3]!r}")
    check(any(json.loads(l).get("msg", "").startswith("kvrelay-server ready grpc=") for l in lines if l not in bad),
          "--log-json: the ready line is a JSON record")
    check(any("publish failed" in l or "INVALID_ARGUMENT" in l for l in lines),
          f"--log-json: the refused publish is logged: {lines[-3:]!r}")
    check(any(json.loads(l).get("msg", "").startswith("protobuf: ") for l in lines if l not in bad),
          f"--log-json: libprotobuf's complaint is a JSON record: {lines[-4:]!r}")

    # 4. The metrics listener (civetweb) of Debian's build has no IPv6: an
    # IPv6 --metrics-listen is refused up front, naming the reason, as a
    # usage error (exit 2).
    p = subprocess.Popen([server_bin, "--listen", "127.0.0.1:0", "--metrics-listen", "[::1]:0"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=clean_env())
    tl.STARTED.append(p)
    try:
        err = p.communicate(timeout=10)[1]
        check(p.returncode == 2 and "IPv6" in err and "--metrics-listen" in err and "--help" in err,
              f"--metrics-listen [::1]:0: rc={p.returncode} {err.strip()!r}")
    except subprocess.TimeoutExpired:  # still serving: a civetweb with IPv6, fine too
        p.terminate()
        p.wait(timeout=20)

    # 5. Timeouts too short to mean anything, and an empty boolean variable.
    rc, _, err = run([server_bin, "--session-ttl-seconds", "1e-300"], timeout=20)
    check(rc == 2 and "--session-ttl-seconds" in err and "seconds in [0.01, 1e9]" in err,
          f"--session-ttl-seconds 1e-300: rc={rc} {err.strip()!r}")
    rc, _, err = run([server_bin, "--upload-idle-timeout-seconds", "0.001"], timeout=20)
    check(rc == 2 and "--upload-idle-timeout-seconds" in err, f"idle timeout 0.001: rc={rc} {err.strip()!r}")
    s = Server(server_bin, work, None, env=clean_env(KVRELAY_LOG_JSON=""), name="empty-bool")
    try:
        check(not s.log().lstrip().startswith("{"), f"KVRELAY_LOG_JSON='' is unset: {s.log()[:120]!r}")
    finally:
        s.stop()


def same_message(a, b, what):
    """The tensors and the compression metadata of two message files are equal."""
    tl.same_message(a, b, what, keys=("policy", "n_kept", "full_bytes", "sent_bytes"))


def test_listen(ctl, server_bin, work, turn):
    sock = os.path.join(work, "relay.sock")
    s = Server(server_bin, work, ["--listen", "127.0.0.1:0", "--listen", f"unix:{sock}",
                                  "--metrics-listen", "127.0.0.1:0"], name="listen-both")
    try:
        check(len(s.addrs) == 2 and re.fullmatch(r"127\.0\.0\.1:[1-9]\d*", s.addrs[0])
              and s.addrs[1] == f"unix:{sock}", f"ready line lists both addresses: {s.ready_line}")
        check(re.fullmatch(r"kvrelay-server ready grpc=127\.0\.0\.1:\d+,unix:\S+ metrics=127\.0\.0\.1:\d+",
                           s.ready_line or ""), f"ready line is one line, ',' between the addresses: {s.ready_line}")
        mode = os.stat(sock).st_mode
        check(stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o666, f"socket mode {oct(mode)}, expected 0666")
        for addr in s.addrs:
            check(port_open(addr), f"{addr} accepts connections")
            rc, out, err = ctl.run("health", "--timeout", "5", addr=addr)
            check(rc == 0 and out.strip() == "SERVING", f"health over {addr}: rc={rc} {out!r} {err!r}")
        rc, out, err = run([server_bin, "health", "--addr", f"unix:{sock}", "--timeout", "5"], timeout=20)
        check(rc == 0 and out.strip() == "SERVING", f"kvrelay-server health --addr unix:PATH: rc={rc} {out!r} {err!r}")
        offline = ctl.path("unix.offline")
        ctl.ok("compress", "--policy", "h2o-head:k=8+obf:p=4", "--in", turn, "--out", offline, addr=False)
        # Published over one address, fetched over the other: one relay.
        for i, (pub, fetch) in enumerate([(s.addrs[1], s.addrs[1]), (s.addrs[0], s.addrs[1]),
                                          (s.addrs[1], s.addrs[0])]):
            r = ctl.ok("publish", "--session", f"ux{i}", "--from", "a", "--to", "b", "--policy",
                       "h2o-head:k=8+obf:p=4", "--in", turn, addr=pub)
            out = ctl.path(f"ux{i}.msg")
            f = ctl.ok("fetch", "--session", f"ux{i}", "--agent", "b", "--out", out, "--wait", "10", addr=fetch)
            check(r.get("message_id") and f.get("message_id") == r.get("message_id"),
                  f"publish over {pub}, fetch over {fetch}: {r.get('message_id')} vs {f.get('message_id')}")
            if f:
                same_message(out, offline, f"publish over {pub}, fetch over {fetch}, vs offline")
        # A second relay on the same socket would take it over: refused.
        rc, out, err = run([server_bin, "--listen", f"unix:{sock}", "--metrics-listen", "off"], timeout=30)
        check(rc == 1 and f"--listen=unix:{sock}: another process is serving" in err,
              f"a socket in use is refused: rc={rc} {err.strip()!r}")
        check(port_open(f"unix:{sock}"), "the first relay still serves its socket")
    finally:
        rc = s.stop()
    check(rc == 0, f"listen-both exit status {rc}")
    check(not os.path.lexists(sock), f"the socket is removed on shutdown: {os.path.lexists(sock)}")

    # A stale socket (nobody accepts on it) does not prevent start-up.
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(sock)
    stale.close()
    s = Server(server_bin, work, ["--listen", f"unix:{sock}", "--metrics-listen", "off"], name="listen-stale")
    try:
        check(s.addrs == [f"unix:{sock}"], f"a Unix socket alone: {s.ready_line}")
        check("removed a stale socket" in s.log(), f"the stale socket's removal is logged: {s.log()[-500:]!r}")
        rc, out, err = ctl.run("health", "--timeout", "5", addr=f"unix:{sock}")
        check(rc == 0 and out.strip() == "SERVING", f"health after replacing a stale socket: {rc} {out!r} {err!r}")
    finally:
        check(s.stop() == 0, "listen-stale exit status 0")

    # A regular file is never removed.
    regular = os.path.join(work, "not-a-socket")
    with open(regular, "w") as f:
        f.write("keep me")
    rc, out, err = run([server_bin, "--listen", f"unix:{regular}", "--metrics-listen", "off"], timeout=30)
    check(rc == 1 and "exists and is not a socket" in err, f"a regular file is refused: rc={rc} {err.strip()!r}")
    with open(regular) as f:
        check(f.read() == "keep me", "the regular file is intact")

    # KVRELAY_LISTEN takes the list; a bad or repeated address exits 2.
    env = clean_env(KVRELAY_LISTEN=f"127.0.0.1:0,unix:{sock}", KVRELAY_METRICS_LISTEN="off")
    s = Server(server_bin, work, [], env=env, name="listen-env")
    try:
        check(len(s.addrs) == 2 and s.addrs[1] == f"unix:{sock}", f"KVRELAY_LISTEN list: {s.ready_line}")
    finally:
        check(s.stop() == 0, "listen-env exit status 0")
    for args, needle in ((["--listen", "unix:"], "--listen=unix:"),
                         (["--listen", f"unix:{sock}", "--listen", f"unix:{sock}"], "given twice")):
        rc, out, err = run([server_bin, *args], timeout=20)
        check(rc == 2 and needle in err, f"{args}: rc={rc} {err.strip()!r}")
    rc, out, err = run([server_bin, "--listen", "unix:/nonexistent-dir/r.sock", "--metrics-listen", "off"], timeout=30)
    check(rc == 1 and "--listen=unix:/nonexistent-dir/r.sock: cannot listen" in err,
          f"a socket in a missing directory: rc={rc} {err.strip()!r}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--kvrelayctl", required=True)
    ap.add_argument("--promtool", default=shutil.which("promtool") or "/usr/bin/promtool")
    args = ap.parse_args()
    for what, path in (("kvrelay-server", args.server), ("kvrelayctl", args.kvrelayctl),
                       ("promtool (scripts/install_deps.sh installs it)", args.promtool)):
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            print(f"FAIL: no {what} at {path!r}")
            return 1
    work = tempfile.mkdtemp(prefix="kvrelay_server_binary_")
    ctl = Ctl(args.kvrelayctl, work)
    try:
        turn, turn2 = ctl.path("t.st"), ctl.path("t2.st")
        geo = ["--layers", "2", "--kv-heads", "2", "--score-heads", "4", "--head-dim", "32",
               "--prompt", "64", "--gen", "8"]
        ctl.ok("make-turn", "--out", turn, "--seed", "1", *geo)
        ctl.ok("make-turn", "--out", turn2, "--seed", "2", "--first-agent", "false", *geo)
        server = Server(args.server, work, ["--listen", "127.0.0.1:0", "--metrics-listen",
                                            "127.0.0.1:0"], name="main")
        steps = [("ready and health", lambda: test_ready_and_health(ctl, server)),
                 ("metrics", lambda: test_metrics(ctl, server, args.promtool, turn, turn2)),
                 ("reflection", lambda: test_reflection(server)),
                 ("main server stops on SIGTERM", lambda: check(server.stop() == 0,
                                                                "main server exit status 0")),
                 ("sigterm", lambda: test_sigterm(ctl, args.server, work, turn)),
                 ("flags", lambda: test_flags(args.server)),
                 ("config", lambda: test_config(ctl, args.server, work, turn)),
                 ("listen", lambda: test_listen(ctl, args.server, work, turn)),
                 ("operations", lambda: test_operations(ctl, args.server, work, turn))]
        for name, fn in steps:
            before = len(FAILURES)
            try:
                fn()
            except Exception as e:  # keep going: report every failure
                check(False, f"{name}: exception {e!r}")
            print(f"{name}: {'ok' if len(FAILURES) == before else 'FAILED'}", flush=True)
    except Exception as e:
        check(False, f"exception {e!r}")
    finally:
        for pid in tl.kill_started():  # every server started, killed at the end
            check(False, f"server pid {pid} did not die")
    if FAILURES:
        print(f"{len(FAILURES)} failure(s); logs and scrape in {work}")
        return 1
    shutil.rmtree(work, ignore_errors=True)
    print("all kvrelay-server binary checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())

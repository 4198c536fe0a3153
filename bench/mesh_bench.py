#!/usr/bin/python3
"""Mesh benchmark: agent A on host 1 publishes to its own relay, which forwards
the compressed message across a shaped link to agent B's relay on host 2; the
figure is the time from A starting its publish until B holds the whole message.
In the same run, a raw TCP send of the uncompressed KV across the same link
(what a user without kvrelay would do), and the local hop (a `full` upload over
a Unix socket against a raw TCP loopback send of the same bytes).

Not a test: it judges the targets of the relay-mesh issue and reports, it never
fails on a missed target (exit 0), only on a broken run (exit 1) or bad usage (2).

    sudo /usr/bin/python3 bench/mesh_bench.py [--build build] [--reps 5] [--rates 1gbit,10gbit]
        [--policy SPEC]... [--topology mesh|fetch-remote] [--agent-transport unix|tcp]
        [--link-security plain,mtls] [--handshake-trials 5]
        [--skip-local-hop] [--raw-only] [--out mesh_bench.json] [--time-limit 1800]

Hosts are network namespaces made by tests/testlib/netns.py (root only), joined
through a hub bridge; each host's link is shaped with tc tbf in both directions.
Every process runs with PR_SET_PDEATHSIG, every wait is bounded, and the
namespaces are removed on every exit path (normal, exception, Ctrl-C, SIGTERM,
the --time-limit alarm). Bytes on the wire are host 1's eth0 tx_bytes over each
transfer (IPv6 is off in the namespaces, nothing else runs there).

Topologies: `mesh` (default) starts relay A on host 1 with --route b=B and relay
B on host 2 (--advertise itself); the agents talk to their own relay only, over
a Unix socket (--agent-transport unix) or 127.0.0.1. `fetch-remote` is today's
kvrelay without forwarding: one relay on host 1, agent B fetches from it across
the link (only compressed bytes cross there too).
"""
import argparse
import ctypes
import json
import os
import platform
import queue
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "testlib"))
import kvrelay_testlib as tl  # noqa: E402
import netns  # noqa: E402
from certs import TestPki  # noqa: E402

DEFAULT_POLICIES = [
    ("full", "full"),
    ("H", "h2o-head:k=32"),
    ("H-OBF fast", "h2o-head:k=32+obf:p=8,mode=fast"),
    ("H-OBF fast + int4", "h2o-head:k=32+obf:p=8,mode=fast+int4:group=32,rotate=hadamard"),
]
# (figure, policy spec, rate, target) of the issue's table: delivery ÷ raw.
RATIO_TARGETS = [
    ("H-OBF fast at 1 Gbit/s: delivery / raw full-KV send", "h2o-head:k=32+obf:p=8,mode=fast", "1gbit", 0.25),
    ("h2o-head:k=32 at 1 Gbit/s: delivery / raw full-KV send", "h2o-head:k=32", "1gbit", 0.2),
    ("h2o-head:k=32 at 10 Gbit/s: delivery / raw full-KV send", "h2o-head:k=32", "10gbit", 1.0),
    ("full at 10 Gbit/s: delivery / raw full-KV send", "full", "10gbit", 2.0),
]
# (figure, policy spec, rate, target) of the security issue: delivery with mTLS
# on the relay-to-relay link ÷ delivery over plaintext, same run.
TLS_TARGETS = [
    ("H-OBF fast at 10 Gbit/s: delivery mTLS / plaintext", "h2o-head:k=32+obf:p=8,mode=fast", "10gbit", 1.15),
]
LINK_SECURITY = ("plain", "mtls")
WIRE_TARGET = 1.05
LOCAL_HOP_TARGET = 1.3  # `full` over a Unix socket ÷ raw TCP loopback, wall, medians
RAW_JUDGED_FRACTION = 0.9
RELAY_PORT = 50051  # plaintext mesh; the mTLS mesh listens on RELAY_PORT + 1
HANDSHAKE_PORT = 50061  # the fresh relay pairs of the handshake figure (+1 with mTLS)
# The handshake figure's message: one small turn (a few KB), so its forward
# is dominated by the connection, not the bytes.
HANDSHAKE_TURN = ["--layers", "1", "--kv-heads", "1", "--score-heads", "1", "--head-dim", "64", "--prompt", "16",
                  "--gen", "4"]
STEP_TIMEOUT_S = 180  # any one transfer, process start to exit

PROCS = []  # every Popen this driver started (killed on every exit path)
_LIBC = ctypes.CDLL(None, use_errno=True)


class BenchError(RuntimeError):
    pass


class Interrupted(BaseException):
    """A signal (SIGTERM, SIGHUP, the --time-limit alarm) ends the run."""


def _die_with_parent():
    _LIBC.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: survives ip netns exec's exec


class Proc:
    """A process (possibly inside a namespace) whose stdout lines are queued."""

    def __init__(self, argv, name, log_dir):
        self.name, self.argv = name, argv
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self._log = open(self.log_path, "a")
        self._log.write(f"$ {' '.join(argv)}\n")
        self._log.flush()
        self.lines, self._q = [], queue.Queue()
        self.p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self._log, text=True, env=tl.clean_env(),
                                  preexec_fn=_die_with_parent)
        PROCS.append(self.p)
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self):
        for line in self.p.stdout:
            self.lines.append(line)
            self._log.write(line)
            self._log.flush()
            self._q.put(line)
        self._q.put(None)

    def expect(self, pattern, timeout):
        """The match of the first stdout line matching `pattern` (re.search on
        the line's text; --log-json records count by their msg)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BenchError(f"{self.name}: no line matching {pattern!r} within {timeout} s; {self.tail()}")
            try:
                line = self._q.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                self.p.wait(timeout=10)
                raise BenchError(f"{self.name} exited ({self.p.returncode}) before {pattern!r}; {self.tail()}")
            m = re.search(pattern, tl.ready_text(line))
            if m:
                return m

    def finish(self, timeout):
        """Waits for the exit; the key=value pairs of its last stdout line.
        BenchError on a timeout (the process is killed) or a non-zero exit."""
        try:
            self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise BenchError(f"{self.name}: still running after {timeout} s, killed; {self.tail()}")
        for _ in range(100):  # the drain thread reads the last line
            if self.p.stdout.closed or self._q.qsize() or self.lines:
                break
            time.sleep(0.01)
        time.sleep(0.02)
        if self.p.returncode != 0:
            raise BenchError(f"{self.name}: exit status {self.p.returncode}; {self.tail()}")
        last = self.lines[-1] if self.lines else ""
        return {k: v for k, v in re.findall(r"(\w+)=(\S+)", last)}

    def tail(self):
        try:
            with open(self.log_path) as f:
                return "log " + self.log_path + ":\n" + f.read()[-1500:]
        except OSError:
            return "log " + self.log_path

    def cpu_seconds(self):
        """utime + stime of the process so far (it is the exec'd binary:
        ip netns exec execs without forking)."""
        try:
            with open(f"/proc/{self.p.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            return float("nan")

    def kill(self):
        if self.p.poll() is None:
            self.p.kill()
            try:
                self.p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def stop(self, timeout=15):
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()


def kill_all():
    for p in PROCS:
        if p.poll() is None:
            p.kill()
    for p in PROCS:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            print(f"mesh_bench: pid {p.pid} did not exit after SIGKILL", file=sys.stderr)


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def kv_bytes(geo):
    return 2 * geo["layers"] * geo["kv_heads"] * (geo["prompt"] + geo["gen"]) * geo["head_dim"] * 2


class Bench:
    READY_TIMEOUT_S = 30  # a relay's start until its ready line (longer under valgrind: cost_bench.py)

    def __init__(self, args, hosts, run_dir):
        self.a, self.hosts, self.dir = args, hosts, run_dir
        self.agent, self.server = args.agent, args.server
        self.geo = dict(layers=args.layers, kv_heads=args.kv_heads, score_heads=args.score_heads,
                        head_dim=args.head_dim, prompt=args.prompt, gen=args.gen)
        self.turn_flags = []
        for k, v in self.geo.items():
            self.turn_flags += [f"--{k.replace('_', '-')}", str(v)]
        self.seq = 0
        self.notes = []
        self.pki = self.make_pki() if "mtls" in args.link_security else None

    def make_pki(self):
        """One CA; one certificate per host whose IP SAN is the address its
        peers dial (the --route and --advertise targets name IPs)."""
        pki = TestPki(os.path.join(self.dir, "pki"))
        ca = pki.ca("mesh-bench-ca")
        certs = {h: pki.issue(ca, f"relay-{h}", ips=[self.hosts.addr(h)]) for h in ("h1", "h2")}
        return {"ca": ca, "certs": certs}

    def security_flags(self, security, host, peer):
        """The relay flags of one link-security mode: plaintext needs --insecure
        for its non-loopback --listen; mtls presents the host's certificate,
        verifies peers against the CA and lets only the other relay forward."""
        if security == "plain":
            return ["--insecure"]
        cert = self.pki["certs"][host]
        return ["--tls-cert", cert.cert, "--tls-key", cert.key, "--tls-client-ca", self.pki["ca"].cert,
                "--peer-identity", self.hosts.addr(peer)]

    # ---- processes in hosts
    def start(self, host, argv, name):
        self.seq += 1
        return Proc(self.hosts.cmd(host, argv), f"{self.seq:03d}-{name}", self.dir)

    def agent_run(self, host, mode, flags, name, timeout=STEP_TIMEOUT_S):
        return self.start(host, [self.agent, mode, *flags], name).finish(timeout)

    def start_relay(self, host, name, listen, extra, local_listen=()):
        argv = [self.server, "--metrics-listen", "127.0.0.1:0", "--shutdown-grace-seconds", "1",
                "--session-ttl-seconds", "600"]
        for addr in listen:
            argv += ["--listen", addr]
        for addr in local_listen:
            argv += ["--local-listen", addr]
        proc = self.start(host, argv + extra, name)
        m = proc.expect(r"kvrelay-server ready grpc=(\S+) metrics=(\S+)", self.READY_TIMEOUT_S)
        proc.grpc, proc.metrics = m.group(1).split(","), m.group(2)
        return proc

    def scrape(self, host, relay):
        if relay.metrics in ("off", None):
            return {}
        code = ("import sys,urllib.request;"
                f"sys.stdout.write(urllib.request.urlopen('http://{relay.metrics}/metrics',timeout=10).read().decode())")
        p = subprocess.run(self.hosts.cmd(host, ["/usr/bin/python3", "-c", code]), capture_output=True, text=True,
                           timeout=30)
        if p.returncode != 0:
            raise BenchError(f"scraping {relay.name} at {relay.metrics}: {p.stderr.strip()[-300:]}")
        return tl.parse_exposition(p.stdout)

    def wait_quiet(self, host, quiet_s=0.2, limit_s=5.0):
        """Waits until host's tx counter stays put for quiet_s (at most limit_s);
        the counter. Records a note when it never settles."""
        deadline = time.monotonic() + limit_s
        last = self.hosts.tx_bytes(host)
        while time.monotonic() < deadline:
            time.sleep(quiet_s)
            now = self.hosts.tx_bytes(host)
            if now == last:
                return now
            last = now
        self.notes.append(f"{host}'s link never went quiet for {quiet_s} s within {limit_s} s")
        return last

    # ---- the local hop
    def local_hop(self):
        """`full` upload over a Unix socket (and over 127.0.0.1 gRPC) against a
        raw TCP loopback send of the same bytes, on host 1 with one relay."""
        sock = os.path.join(self.dir, "local.sock")
        out = {"policy": "full"}
        relay = None
        try:
            relay = self.start_relay("h1", "local-relay", [f"unix:{sock}", "127.0.0.1:0"], [])
        except BenchError as e:
            out["unix_error"] = f"this kvrelay-server did not start with --listen unix:PATH: {str(e)[:300]}"
            self.notes.append("local hop over a Unix socket not measured: " + out["unix_error"][:200])
            relay = self.start_relay("h1", "local-relay-tcp", ["127.0.0.1:0"], [])
        try:
            targets = [("unix", a) for a in relay.grpc if a.startswith("unix:")]
            targets += [("tcp", a) for a in relay.grpc if not a.startswith("unix")]
            for kind, addr in targets:
                r = self.start(self.hosts_first(), [self.agent, "local-hop", "--addr", addr, "--reps",
                                                    str(self.a.reps), "--session", f"local-{kind}",
                                                    *self.turn_flags], f"local-hop-{kind}").finish(STEP_TIMEOUT_S * 2)
                out[kind] = {k: float(v) if re.fullmatch(r"[\d.]+", v) else v for k, v in r.items()}
            if "unix" in out:
                u = out["unix"]
                out["ratio_publish"] = u["publish_ms"] / u["raw_ms"]
                out["ratio_upload"] = u["upload_ms"] / u["raw_ms"]
        finally:
            relay.stop()
        return out

    def hosts_first(self):
        return "h1"

    # ---- one transfer of each kind
    def raw_rep(self, tag):
        n = kv_bytes(self.geo)
        recv = self.start("h2", [self.agent, "raw-recv", "--listen", f"{self.hosts.addr('h2')}:0", "--bytes",
                                 str(n)], f"raw-recv-{tag}")
        port = recv.expect(r"listening port=(\d+)", 30).group(1)
        tx0, q0 = self.wait_quiet("h1"), self.hosts.qdisc_bytes("h1")
        send = self.start("h1", [self.agent, "raw-send", "--to", f"{self.hosts.addr('h2')}:{port}",
                                 *self.turn_flags], f"raw-send-{tag}")
        s = send.finish(STEP_TIMEOUT_S)
        r = recv.finish(STEP_TIMEOUT_S)
        tx1, q1 = self.hosts.tx_bytes("h1"), self.hosts.qdisc_bytes("h1")
        if int(r["bytes"]) != n or int(s["bytes"]) != n:
            raise BenchError(f"raw send: {s['bytes']} sent, {r['bytes']} received, {n} expected")
        ms = (int(r["done_ns"]) - int(s["start_ns"])) / 1e6
        return {"ms": ms, "bytes": n, "wire_bytes": tx1 - tx0, "qdisc_bytes": q1 - q0, "gbit_s": n * 8 / ms / 1e6,
                "cpu_s": {"sender": float(s["cpu_s"]), "receiver": float(r["cpu_s"])}}

    def mesh_rep(self, relays, agent_addr, spec, session):
        ra, rb = relays
        fetch = self.start("h2", [self.agent, "fetch", "--addr", agent_addr["h2"], "--session", session,
                                  "--agent", "b", "--wait-seconds", str(STEP_TIMEOUT_S)], f"fetch-{session}")
        fetch.expect(r"^waiting", 30)
        time.sleep(0.2)  # the Fetch reaches its relay and parks there
        tx0, q0 = self.wait_quiet("h1"), self.hosts.qdisc_bytes("h1")
        m0 = self.scrape("h1", ra)
        self.before_transfer(relays)
        cpu0 = [r.cpu_seconds() for r in relays if r]
        pub = self.start("h1", [self.agent, "publish", "--addr", agent_addr["h1"], "--session", session,
                                "--from", "a", "--to", "b", "--policy", spec, *self.turn_flags], f"publish-{session}")
        p = pub.finish(STEP_TIMEOUT_S)
        f = fetch.finish(STEP_TIMEOUT_S)
        time.sleep(0.05)
        tx1, q1 = self.hosts.tx_bytes("h1"), self.hosts.qdisc_bytes("h1")
        cpu1 = [r.cpu_seconds() for r in relays if r]
        self.after_transfer(relays)
        m1 = self.scrape("h1", ra)
        if f["message_id"] != p["message_id"]:
            raise BenchError(f"fetched {f['message_id']}, published {p['message_id']}")
        self.agent_run("h1", "close", ["--addr", agent_addr["h1"], "--session", session], f"close-{session}", 30)

        def delta(name, labels=None):
            key = (name, frozenset((labels or {}).items()))
            if key not in m1:
                return None
            return m1[key] - m0.get(key, 0.0)

        fwd_outcomes = {dict(k[1]).get("outcome", ""): v - m0.get(k, 0.0) for k, v in m1.items()
                        if k[0] == "kvrelay_forwards_total" and v - m0.get(k, 0.0)}
        ms = (int(f["done_ns"]) - int(p["start_ns"])) / 1e6
        sent = int(p["sent_bytes"])
        names = ["relay_a", "relay_b"][:len(cpu0)]
        cpu = {"publisher": float(p["cpu_s"]), "fetcher": float(f["cpu_s"])}
        cpu.update({n: c1 - c0 for n, c0, c1 in zip(names, cpu0, cpu1)})
        return {"ms": ms, "publish_ms": (int(p["end_ns"]) - int(p["start_ns"])) / 1e6,
                "sent_bytes": sent, "full_bytes": int(p["full_bytes"]), "received_bytes": int(p["received_bytes"]),
                "held_bytes": int(f["held_bytes"]), "compress_s": float(p["compress_s"]),
                "wire_bytes": tx1 - tx0, "wire_over_sent": (tx1 - tx0) / sent if sent else None,
                "qdisc_bytes": q1 - q0, "qdisc_over_sent": (q1 - q0) / sent if sent else None,
                "forward_bytes": delta("kvrelay_forward_bytes_total"),
                "forward_seconds_sum": delta("kvrelay_forward_seconds_sum"),
                "forwards": fwd_outcomes, "cpu_s": cpu, "cpu_total_s": sum(cpu.values())}

    def before_transfer(self, relays):
        """Hook: right before a transfer's relay CPU is first read (cost_bench.py)."""

    def after_transfer(self, relays):
        """Hook: right after a transfer's relay CPU is read again."""

    # ---- one link rate
    def rate(self, rate, policies):
        """Every link-security mode's mesh runs at once (ports apart); each rep
        is a raw send, then per policy one transfer per mode (the modes' order
        alternates from rep to rep)."""
        for h in ("h1", "h2"):
            self.hosts.shape(h, rate)
        rate_bps = netns.rate_bytes_per_second(rate) * 8
        modes = self.a.link_security
        out = {"rate": rate, "rate_bit_s": rate_bps, "raw": [],
               "links": {sec: {"policies": {spec: [] for _, spec in policies}, "warmup": {}} for sec in modes}}
        meshes = {}
        try:
            if not self.a.raw_only:
                for sec in modes:
                    relays, agent_addr = self.start_mesh(rate, sec)
                    if relays[0] is not None:
                        meshes[sec] = (relays, agent_addr)
            for sec, (relays, agent_addr) in meshes.items():
                warm = out["links"][sec]["warmup"]
                for _, spec in policies:  # the first forward opens the relay-to-relay channel
                    warm[spec] = self.mesh_rep(relays, agent_addr, spec, f"{rate}-{sec}-warm-{len(warm)}")
            if not meshes:
                self.raw_rep(f"{rate}-warm")
            for r in range(self.a.reps):
                out["raw"].append(self.raw_rep(f"{rate}-{r}"))
                print(f"  {rate} rep {r}: raw {out['raw'][-1]['ms']:.1f} ms "
                      f"({out['raw'][-1]['gbit_s']:.2f} Gbit/s)", flush=True)
                order = list(meshes.items())
                if r % 2:
                    order.reverse()  # neither mode always runs right after the other's transfer
                for pi, (_, spec) in enumerate(policies):
                    for sec, (relays, agent_addr) in order:
                        res = self.mesh_rep(relays, agent_addr, spec, f"{rate}-{sec}-{pi}-{r}")
                        out["links"][sec]["policies"][spec].append(res)
                        print(f"  {rate} rep {r}: {sec:5s} {spec}: {res['ms']:.1f} ms, wire "
                              f"{res['wire_bytes'] / 1e6:.2f} MB, sent {res['sent_bytes'] / 1e6:.2f} MB", flush=True)
        finally:
            for relays, _ in meshes.values():
                for rel in relays:
                    if rel is not None:
                        rel.stop()
            for h in ("h1", "h2"):
                self.hosts.unshape(h)
        return out

    def relay_pair(self, tag, security, port, routes=True):
        """Relay A on host 1 (--route b=B) and relay B on host 2 (--route
        a=A), both advertising themselves on `port`, agents on Unix sockets
        (local listeners, plaintext in every mode); mtls: the TCP listeners
        serve TLS and the link runs mTLS. (relays, {host: agent address})."""
        ip1, ip2 = self.hosts.addr("h1"), self.hosts.addr("h2")
        t1, t2 = f"{ip1}:{port}", f"{ip2}:{port}"
        relays, addrs = [], {}
        for host, peer, me, other, route in (("h1", "h2", t1, t2, "b"), ("h2", "h1", t2, t1, "a")):
            ip = self.hosts.addr(host)
            extra = ["--advertise", me, "--route", f"{route}={other}"] + self.security_flags(security, host, peer)
            if getattr(self.a, "wire_codec", None):  # cost_bench.py passes --relay-arg instead
                extra += ["--wire-codec", self.a.wire_codec]
            if self.a.agent_transport == "unix":
                sock = os.path.join(self.dir, f"{host}-{tag}.sock")
                listen, local, addrs[host] = [f"{ip}:{port}"], [f"unix:{sock}"], f"unix:{sock}"
            elif security == "plain":
                listen, local, addrs[host] = [f"0.0.0.0:{port}"], [], f"127.0.0.1:{port}"
            else:  # TLS on the host's address, plaintext on loopback for its agent
                listen, local, addrs[host] = [f"{ip}:{port}"], [f"127.0.0.1:{port}"], f"127.0.0.1:{port}"
            relays.append(self.start_relay(host, f"relay-{'ab'[len(relays)]}-{tag}", listen, extra, local))
        return tuple(relays), addrs

    def start_mesh(self, rate, security="plain"):
        """(relay A, relay B or None), {host: the address its agent uses}."""
        ip1 = self.hosts.addr("h1")
        t1 = f"{ip1}:{RELAY_PORT}"
        try:
            if self.a.topology == "fetch-remote":
                if self.a.agent_transport == "unix":
                    sock = os.path.join(self.dir, f"h1-{rate}.sock")
                    la, aa = [f"unix:{sock}", t1], f"unix:{sock}"
                else:
                    la, aa = [f"0.0.0.0:{RELAY_PORT}"], f"127.0.0.1:{RELAY_PORT}"
                ra = self.start_relay("h1", f"relay-a-{rate}", la, ["--insecure"])
                return (ra, None), {"h1": aa, "h2": t1}
            port = RELAY_PORT + LINK_SECURITY.index(security)
            return self.relay_pair(f"{rate}-{security}", security, port)
        except BenchError as e:
            self.notes.append(f"{rate}: {security} relays did not start ({self.a.topology}, agents over "
                              f"{self.a.agent_transport}); that mesh did not run: {str(e)[:400]}")
            print("  " + self.notes[-1], flush=True)
            for p in PROCS:
                if p.poll() is None and p.args and self.server in p.args:
                    p.kill()
            return (None, None), None

    # ---- the handshake cost
    def handshake(self, trials):
        """Per link-security mode and trial: a fresh relay pair (link
        unshaped); each relay first serves one local publish and fetch (its
        own first-call costs), then a small turn is forwarded A -> B twice.
        The first forward dials B (TCP, HTTP/2 and, with mtls, the TLS
        handshake); the second reuses the channel. Figures: delivery times of
        both, in ms, and first minus second."""
        out = {"turn": " ".join(HANDSHAKE_TURN), "policy": "full", "links": {}}
        for sec in self.a.link_security:
            out["links"][sec] = []
        for t in range(trials):
            for sec in self.a.link_security:
                tag = f"hs-{sec}-{t}"
                relays, addrs = self.relay_pair(tag, sec, HANDSHAKE_PORT + LINK_SECURITY.index(sec))
                try:
                    for host, agent in (("h1", "a"), ("h2", "b")):
                        self.agent_run(host, "publish", ["--addr", addrs[host], "--session", f"{tag}-local",
                                                         "--from", agent, "--to", agent + "2", "--policy", "full",
                                                         *HANDSHAKE_TURN], f"publish-{tag}-local-{host}", 60)
                        self.agent_run(host, "fetch", ["--addr", addrs[host], "--session", f"{tag}-local",
                                                       "--agent", agent + "2", "--wait-seconds", "30"],
                                       f"fetch-{tag}-local-{host}", 60)
                    ms = []
                    for i in range(2):
                        ms.append(self.small_forward(addrs, f"{tag}-{i}"))
                finally:
                    for rel in relays:
                        rel.stop()
                trial = {"first_ms": ms[0], "second_ms": ms[1], "cost_ms": ms[0] - ms[1]}
                out["links"][sec].append(trial)
                print(f"  handshake {sec:5s} trial {t}: first forward {ms[0]:.2f} ms, second {ms[1]:.2f} ms",
                      flush=True)
        for sec, trials_ in out["links"].items():
            out[sec] = {k: median(x[k] for x in trials_) for k in ("first_ms", "second_ms", "cost_ms")}
        if "plain" in out and "mtls" in out:
            out["mtls_minus_plain_cost_ms"] = out["mtls"]["cost_ms"] - out["plain"]["cost_ms"]
        return out

    def small_forward(self, addrs, session):
        fetch = self.start("h2", [self.agent, "fetch", "--addr", addrs["h2"], "--session", session, "--agent", "b",
                                  "--wait-seconds", "60"], f"fetch-{session}")
        fetch.expect(r"^waiting", 30)
        time.sleep(0.2)
        p = self.agent_run("h1", "publish", ["--addr", addrs["h1"], "--session", session, "--from", "a", "--to", "b",
                                             "--policy", "full", *HANDSHAKE_TURN], f"publish-{session}", 60)
        f = fetch.finish(60)
        if f["message_id"] != p["message_id"]:
            raise BenchError(f"fetched {f['message_id']}, published {p['message_id']}")
        return (int(f["done_ns"]) - int(p["start_ns"])) / 1e6


# ---- the report

def summarize(result, policies):
    rows, judged = [], []
    names = {spec: name for name, spec in policies}
    modes = result.get("link_security") or ["plain"]
    for rr in result["rates"]:
        raw_ms = median(x["ms"] for x in rr["raw"])
        raw_gbit = median(x["gbit_s"] for x in rr["raw"])
        raw_ok = raw_gbit is not None and raw_gbit * 1e9 >= RAW_JUDGED_FRACTION * rr["rate_bit_s"]
        rr["raw_median_ms"], rr["raw_median_gbit_s"], rr["raw_judged"] = raw_ms, raw_gbit, raw_ok
        rr["raw_wire_over_bytes"] = median(x["wire_bytes"] / x["bytes"] for x in rr["raw"])
        rr["raw_qdisc_over_bytes"] = median(x["qdisc_bytes"] / x["bytes"] for x in rr["raw"])
        for sec in modes:
            for spec, reps in rr["links"][sec]["policies"].items():
                if not reps:
                    continue
                row = {"rate": rr["rate"], "link": sec, "policy": spec, "name": names.get(spec, spec),
                       "ms": median(x["ms"] for x in reps), "publish_ms": median(x["publish_ms"] for x in reps),
                       "sent_mb": median(x["sent_bytes"] for x in reps) / 1e6,
                       "wire_mb": median(x["wire_bytes"] for x in reps) / 1e6,
                       "wire_over_sent": median(x["wire_over_sent"] for x in reps),
                       "qdisc_over_sent": median(x["qdisc_over_sent"] for x in reps),
                       "forward_mb": (median(x["forward_bytes"] for x in reps) or 0) / 1e6
                       if any(x["forward_bytes"] is not None for x in reps) else None,
                       "raw_ms": raw_ms, "raw_judged": raw_ok,
                       "cpu_s": {k: median(x["cpu_s"][k] for x in reps) for k in reps[0]["cpu_s"]},
                       "cpu_total_s": median(x["cpu_total_s"] for x in reps)}
                row["ratio"] = row["ms"] / raw_ms if raw_ms else None
                row["cpu_busy"] = row["cpu_total_s"] / (row["ms"] / 1e3 * (os.cpu_count() or 1))
                rows.append(row)
                judged.append({"figure": f"wire / accounting sent, {row['name']} at {rr['rate']} ({sec})",
                               "value": row["wire_over_sent"], "target": WIRE_TARGET,
                               "verdict": verdict(row["wire_over_sent"], WIRE_TARGET, True)})
    base = "plain" if "plain" in modes else modes[0]
    for figure, spec, rate, target in RATIO_TARGETS:
        row = next((r for r in rows if r["policy"] == spec and r["rate"] == rate and r["link"] == base), None)
        if row is None:
            judged.append({"figure": figure, "value": None, "target": target, "verdict": "not measured"})
            continue
        judged.append({"figure": f"{figure} ({base})", "value": row["ratio"], "target": target,
                       "verdict": verdict(row["ratio"], target, row["raw_judged"])})
    tls = []
    if "plain" in modes and "mtls" in modes:
        for r in rows:
            if r["link"] != "mtls":
                continue
            p = next((x for x in rows if x["link"] == "plain" and x["policy"] == r["policy"]
                      and x["rate"] == r["rate"]), None)
            if p is None:
                continue
            links = next(rr["links"] for rr in result["rates"] if rr["rate"] == r["rate"])
            pairs = zip(links["plain"]["policies"][r["policy"]], links["mtls"]["policies"][r["policy"]])
            tls.append({"rate": r["rate"], "policy": r["policy"], "name": r["name"], "plain_ms": p["ms"],
                        "mtls_ms": r["ms"], "ratio": r["ms"] / p["ms"],
                        "paired_ratio": median(m["ms"] / q["ms"] for q, m in pairs),
                        "plain_cpu_busy": p["cpu_busy"],
                        "mtls_cpu_busy": r["cpu_busy"], "plain_cpu_total_s": p["cpu_total_s"],
                        "mtls_cpu_total_s": r["cpu_total_s"]})
        for figure, spec, rate, target in TLS_TARGETS:
            t = next((x for x in tls if x["policy"] == spec and x["rate"] == rate), None)
            judged.append({"figure": figure, "value": t and t["ratio"], "target": target,
                           "verdict": verdict(t and t["ratio"], target, True)})
    lh = result.get("local_hop") or {}
    if "unix" in lh:
        judged.append({"figure": "local hop, full: upload over a Unix socket (publish returned) / raw TCP loopback",
                       "value": lh["ratio_publish"], "target": LOCAL_HOP_TARGET,
                       "verdict": verdict(lh["ratio_publish"], LOCAL_HOP_TARGET, True)})
    elif result.get("local_hop") is not None:
        judged.append({"figure": "local hop, full: upload over a Unix socket / raw TCP loopback", "value": None,
                       "target": LOCAL_HOP_TARGET, "verdict": "not measured"})
    result["rows"], result["judged"], result["tls_ratios"] = rows, judged, tls


def verdict(value, target, judged):
    if value is None:
        return "not measured"
    if not judged:
        return "not judged (raw baseline below 90% of the shaped rate)"
    return "met" if value <= target else "missed"


def fmt(x, spec="%.1f"):
    return "-" if x is None else spec % x


def print_report(result):
    print("\n== mesh benchmark ==")
    print(f"turn: {result['turn']}, raw full-KV {result['kv_bytes'] / 1e6:.1f} MB; {result['topology']}, agents over "
          f"{result['agent_transport']}; relay-to-relay link: {', '.join(result['link_security'])}; {result['reps']} reps, medians; MTU {result['mtu']}; {result['cpus']} CPUs, "
          f"load {result['load_before']} -> {result['load_after']}")
    for rr in result["rates"]:
        print(f"raw TCP at {rr['rate']}: {fmt(rr['raw_median_ms'])} ms, {fmt(rr['raw_median_gbit_s'], '%.2f')} Gbit/s "
              f"({100 * (rr['raw_median_gbit_s'] or 0) * 1e9 / rr['rate_bit_s']:.0f}% of the shaped rate; "
              f"{'judged' if rr['raw_judged'] else 'NOT judged'}), wire/payload {fmt(rr['raw_wire_over_bytes'], '%.3f')} "
              f"(per-segment headers: {fmt(rr['raw_qdisc_over_bytes'], '%.3f')})")
    if result["rows"]:
        hdr = ("rate", "link", "policy", "deliv ms", "pub ms", "raw ms", "ratio", "sent MB", "wire MB", "wire/sent", "+hdrs",
               "fwd MB", "CPU s (pub,fetch,relayA,relayB)", "CPU/(wall*cpus)")
        print("\n%-7s %-5s %-20s %9s %8s %8s %6s %8s %8s %9s %6s %7s %32s %s" % hdr)
        for r in result["rows"]:
            c = r["cpu_s"]
            cpu = ",".join(fmt(c.get(k), "%.2f") for k in ("publisher", "fetcher", "relay_a", "relay_b"))
            print("%-7s %-5s %-20s %9s %8s %8s %6s %8s %8s %9s %6s %7s %32s %s" % (
                r["rate"], r["link"], r["name"][:20], fmt(r["ms"]), fmt(r["publish_ms"]), fmt(r["raw_ms"]),
                fmt(r["ratio"], "%.3f"), fmt(r["sent_mb"], "%.2f"), fmt(r["wire_mb"], "%.2f"),
                fmt(r["wire_over_sent"], "%.3f"), fmt(r["qdisc_over_sent"], "%.3f"), fmt(r["forward_mb"], "%.2f"),
                cpu, fmt(r["cpu_busy"], "%.2f")))
    if result.get("tls_ratios"):
        print("\nmTLS on the relay-to-relay link / plaintext (ratio of the medians of the same run, interleaved; "
              "and the median of the per-rep ratios):")
        for t in result["tls_ratios"]:
            print(f"  {t['rate']:7s} {t['name'][:20]:20s} plain {t['plain_ms']:8.1f} ms, mtls {t['mtls_ms']:8.1f} ms: "
                  f"{t['ratio']:.3f}, per-rep pairs {t['paired_ratio']:.3f} (CPU/(wall*cpus) {t['plain_cpu_busy']:.2f} -> {t['mtls_cpu_busy']:.2f}, "
                  f"CPU s {t['plain_cpu_total_s']:.2f} -> {t['mtls_cpu_total_s']:.2f})")
    hs = result.get("handshake")
    if hs:
        print(f"\nhandshake (fresh relay pair, link unshaped, {hs['turn']}, {len(next(iter(hs['links'].values())))} "
              "trials, medians):")
        for sec in hs["links"]:
            if sec in hs:
                x = hs[sec]
                print(f"  {sec:5s}: first forward {fmt(x['first_ms'], '%.2f')} ms, second "
                      f"{fmt(x['second_ms'], '%.2f')} ms, first - second {fmt(x['cost_ms'], '%.2f')} ms")
        if "mtls_minus_plain_cost_ms" in hs:
            print(f"  mTLS's share (mtls cost - plain cost): {hs['mtls_minus_plain_cost_ms']:.2f} ms")
    lh = result.get("local_hop")
    if lh:
        print("\nlocal hop (full, %s):" % ("one relay on host 1"))
        for kind in ("unix", "tcp"):
            if kind in lh:
                x = lh[kind]
                print(f"  gRPC over {kind:4s}: upload {x['upload_ms']:.1f} ms, publish returned {x['publish_ms']:.1f} ms;"
                      f" raw TCP loopback of the same {x['bytes'] / 1e6:.1f} MB {x['raw_ms']:.1f} ms"
                      f" (CPU publish {x['publish_cpu_s']:.3f} s, raw {x['raw_cpu_s']:.3f} s)")
        if "unix_error" in lh:
            print("  unix: " + lh["unix_error"][:200])
    print("\ntargets:")
    for j in result["judged"]:
        print(f"  {j['figure']}: {fmt(j['value'], '%.3f')} (target <= {j['target']}): {j['verdict']}")
    for n in result["notes"]:
        print("note: " + n)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"), help="build folder (binaries in BUILD/bin)")
    ap.add_argument("--reps", type=int, default=5, help="timed transfers per (rate, policy) and raw sends per rate")
    ap.add_argument("--rates", default="1gbit,10gbit", help="comma list of tc rates")
    ap.add_argument("--policy", action="append", help="policy spec (repeatable; default: the issue's four)")
    ap.add_argument("--topology", choices=["mesh", "fetch-remote"], default="mesh")
    ap.add_argument("--agent-transport", choices=["unix", "tcp"], default="unix")
    ap.add_argument("--link-security", default="plain",
                    help="comma list of relay-to-relay link modes, run interleaved: plain (--insecure), mtls "
                    "(--tls-cert/--tls-key/--tls-client-ca/--peer-identity; agents stay on local listeners)")
    ap.add_argument("--handshake-trials", type=int, default=None,
                    help="fresh relay pairs per link mode for the handshake figure (first forward minus the "
                    "second; default 5 with --link-security naming mtls, else 0)")
    ap.add_argument("--wire-codec", choices=["rans", "none"], default=None,
                    help="the relays' --wire-codec between each other (default: theirs, rans)")
    ap.add_argument("--skip-local-hop", action="store_true")
    ap.add_argument("--raw-only", action="store_true", help="only the raw TCP baseline (and the local hop)")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--time-limit", type=int, default=1800, help="seconds for the whole run (then cleaned up, exit 1)")
    ap.add_argument("--prefix", default="kvmb", help="namespace name prefix")
    ap.add_argument("--mtu", type=int, default=9000, help="MTU of the links (default 9000, jumbo frames: at 1500 the "
                    "per-packet cost on a small VM, not the shaped rate, limits the raw baseline)")
    ap.add_argument("--keep-logs", action="store_true", help="keep the process logs (their folder is printed)")
    for flag, dflt in (("layers", 40), ("kv-heads", 8), ("score-heads", 40), ("head-dim", 128), ("prompt", 512),
                       ("gen", 40)):
        ap.add_argument(f"--{flag}", type=int, default=dflt)
    args = ap.parse_args()
    if not 1 <= args.reps <= 50:
        ap.error("--reps: 1..50 expected")
    args.agent = os.path.join(args.build, "bin", "mesh_bench_agent")
    args.server = os.path.join(args.build, "bin", "kvrelay-server")
    for b in (args.agent, args.server):
        if not os.access(b, os.X_OK):
            ap.error(f"no executable {b} (build the benchmarks: cmake --build {args.build} "
                     f"--target mesh_bench_agent kvrelay-server)")
    args.link_security = [m.strip() for m in args.link_security.split(",") if m.strip()]
    for m in args.link_security:
        if m not in LINK_SECURITY:
            ap.error(f"--link-security: {m!r}: expected a comma list of {', '.join(LINK_SECURITY)}")
    if not args.link_security or len(set(args.link_security)) != len(args.link_security):
        ap.error("--link-security: expected one or more distinct modes (plain, mtls)")
    if "mtls" in args.link_security and args.topology != "mesh":
        ap.error("--link-security mtls: needs --topology mesh (the fetch-remote agent has no TLS client)")
    if args.handshake_trials is None:
        args.handshake_trials = 5 if "mtls" in args.link_security and not args.raw_only else 0
    if not 0 <= args.handshake_trials <= 50:
        ap.error("--handshake-trials: 0..50 expected")
    if args.handshake_trials and (args.raw_only or args.topology != "mesh"):
        ap.error("--handshake-trials: needs the mesh (--topology mesh, not --raw-only)")
    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    for r in rates:
        try:
            netns.rate_bytes_per_second(r)
        except ValueError as e:
            ap.error(str(e))
    policies = [(s, s) for s in args.policy] if args.policy else DEFAULT_POLICIES
    if args.policy:
        policies = [next(((n, s) for n, s in DEFAULT_POLICIES if s == spec), (spec, spec)) for spec in args.policy]
    ok, why = netns.available()
    if not ok:
        print(f"mesh_bench: SKIPPED: {why}")
        return 1

    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGALRM)

    def on_signal(sig, _frame):
        for s in handled:  # a second signal must not interrupt the cleanup
            signal.signal(s, signal.SIG_IGN)
        raise Interrupted(f"signal {signal.Signals(sig).name}")

    for sig in handled:
        signal.signal(sig, on_signal)
    signal.alarm(args.time_limit)

    run_dir = tempfile.mkdtemp(prefix="kvrelay-mesh-bench-")
    os.chmod(run_dir, 0o755)
    result = {"turn": "Qwen3-14B geometry " + ", ".join(f"{k}={v}" for k, v in
                                                          dict(layers=args.layers, kv_heads=args.kv_heads,
                                                               score_heads=args.score_heads, head_dim=args.head_dim,
                                                               prompt=args.prompt, gen=args.gen).items()) + ", bf16",
              "kv_bytes": 0, "topology": args.topology, "agent_transport": args.agent_transport,
              "wire_codec": args.wire_codec or "rans (the relays' default)", "reps": args.reps, "mtu": args.mtu,
              "cpus": os.cpu_count(), "kernel": platform.release(), "load_before": open("/proc/loadavg").read().split()[0],
              "rates": [], "local_hop": None, "handshake": None, "notes": [], "policies": [s for _, s in policies],
              "link_security": args.link_security}
    status = 0
    try:
        with netns.Hosts(["h1", "h2"], prefix=args.prefix, ipv6=False, mtu=args.mtu) as hosts:
            bench = Bench(args, hosts, run_dir)
            result["kv_bytes"] = kv_bytes(bench.geo)
            result["notes"] = bench.notes
            try:
                if not args.skip_local_hop:
                    print("local hop ...", flush=True)
                    result["local_hop"] = bench.local_hop()
                if args.handshake_trials:
                    print("handshake ...", flush=True)
                    result["handshake"] = bench.handshake(args.handshake_trials)
                for rate in rates:
                    print(f"link {rate} ...", flush=True)
                    result["rates"].append(bench.rate(rate, policies))
            finally:
                kill_all()
    except (BenchError, Interrupted, KeyboardInterrupt) as e:
        print(f"mesh_bench: run ended early: {type(e).__name__}: {e}", file=sys.stderr)
        result["notes"].append(f"run ended early: {type(e).__name__}: {e}")
        status = 1
    finally:
        signal.alarm(0)
        kill_all()
        left = [n for n in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
                if n.startswith(args.prefix + "-")]
        if left:
            print(f"mesh_bench: namespaces left over: {left}", file=sys.stderr)
            status = 1
    result["load_after"] = open("/proc/loadavg").read().split()[0]
    summarize(result, policies)
    print_report(result)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)
        print(f"wrote {args.out}")
    if args.keep_logs or status or result["notes"]:
        print(f"logs: {run_dir}")
    else:
        shutil.rmtree(run_dir, ignore_errors=True)
    return status


if __name__ == "__main__":
    sys.exit(main())

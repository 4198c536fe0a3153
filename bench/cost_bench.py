#!/usr/bin/python3
"""Cost benchmark of the relay path: CPU seconds per GB of K/V spent by each
process when agent A publishes through relay A, which forwards to relay B,
where agent B fetches; next to a raw TCP send of the same bytes. Optionally
(--callgrind) instructions per K/V byte and where they go, and (default on)
how many times the relays copy each byte of a `full` message.

Not a test: it reports figures against the targets and never fails on a
missed target (exit 0), only on a broken run (exit 1) or bad usage (2).

    python3 bench/cost_bench.py [--build build] [--reps 5] [--policy SPEC]...
        [--layers 40 ...] [--no-copies] [--copy-reps 2]
        [--callgrind [--cg-layers 4]] [--out cost_bench.json] [--time-limit 1800]

The mesh is mesh_bench.py's (its Bench, Proc, agent binary
bench/mesh_bench_agent.cc and relay flags), on one loopback instead of network
namespaces: "host 1" is 127.0.0.1 and "host 2" 127.0.0.2, relay A runs with
--route b=127.0.0.2:PORT and relay B with --route a=127.0.0.1:PORT, each
advertising itself; the agents reach their own relay over a Unix socket
(--local-listen unix:PATH). No root needed.

CPU (the main figure; robust to a shared machine, wall times are not):
  - agents: getrusage(RUSAGE_SELF) over the timed call only (the publish
    call; the fetch from parked Fetch to the verified message), printed by
    mesh_bench_agent;
  - relays: read right before the publish starts and right after the fetch
    returned (+50 ms; mesh_bench's mesh_rep hooks before_transfer and
    after_transfer), i.e. over the transfer only: the sum over the relay's
    threads of /proc/PID/task/TID/schedstat's run time (ns; user + system)
    when no thread ended inside the window, else utime + stime of
    /proc/PID/stat (10 ms ticks; the row says how many reps fell back). The
    relays idle otherwise (their idle CPU is printed);
  - raw TCP: mesh_bench_agent raw-send / raw-recv of the turn's K/V bytes
    (every prompt/gen K and V tensor) over 127.0.0.1 -> 127.0.0.2, getrusage
    of each side over its send / receive loop.
  Per GB means per 1e9 bytes of the message's uncompressed K/V (the same
  bytes the raw send moves), for `full` and `h2o-head:k=32` alike. The ratio
  is (relay A + relay B CPU s/GB) / (raw sender + raw receiver CPU s/GB), of
  the medians over --reps (target <= 2); the median of per-rep ratios too.

Copies per byte (default on; --no-copies skips it): a second relay pair runs
with LD_PRELOAD=build/lib/libcopy_count_preload.so (bench/copy_count_preload.cc),
which counts the bytes passed to libc's memcpy/memmove/mempcpy/__memcpy_chk/
__memmove_chk, per call size, in counters shared through a file; the driver
reads them before and after each transfer. Copies per byte = bytes copied in
the relay / bytes of the message (its sent bytes: what relay A forwards and
relay B holds); shown for all calls and for calls >= 4 KiB (payload-sized).
Limits: exact for calls that reach the dynamic memcpy/memmove symbols (every
library of the relay is a shared object, so protobuf's, gRPC's, abseil's and
the relay's own calls all do); it misses compiler-inlined copies of small
constant sizes, element-wise copy loops, and copies inside glibc; the
kernel's copies into and out of socket buffers are the "socket" ends and are
not counted (the raw TCP baseline has the same two). So it is a lower bound
of user-space copying. Relay A's count for a compressing policy includes the
compressor's own gathers.

Instructions (--callgrind): `perf stat -e instructions` is tried first; on a
VM without hardware counters (the usual case here: "<not supported>") relay A
and relay B run under `valgrind --tool=callgrind --dump-instr=no` (install:
apt-get install valgrind) with a smaller turn (--cg-layers, default 4 layers
of the same geometry); after one warm-up transfer per policy, counters are
zeroed (callgrind_control -z) right before a transfer and dumped
(callgrind_control -d) right after it, so the figures are the transfer's
only. Reported: instructions per K/V byte for each relay, the top functions
by inclusive instructions (callgrind_annotate) and by self instructions
(read from the dump itself: callgrind_annotate's self figures of functions
still on a stack at a mid-run dump include their callees), self
instructions by shared object, the self instructions of memcpy/memmove
variants and of CRC32C (core/crc32c.cc's ExtendState), and the callers of
memcpy/memmove by the inclusive instructions of their calls.
Cross-check of the copy count: build/bin/copy_calibration (bench/copy_calibration.cc)
runs under callgrind to measure memcpy's instructions per byte per call size
on the memcpy variant glibc picks under valgrind; copies ~= memcpy Ir /
(Ir per byte x message bytes). Its error is the spread of Ir per byte across
call sizes (shown as a range over sizes >= 4 KiB); the LD_PRELOAD count is the
primary figure. Valgrind reports a CPU without AVX-512, so dispatching kernels
(core/internal) take their AVX2 path there; instruction counts are not times.
"""
import argparse
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import mesh_bench as mb  # noqa: E402

POLICIES = ["full", "h2o-head:k=32"]
RATIO_TARGET = 2.0
COPIES_TARGET = 2.0
GB = 1e9
# Layout of copy_count_preload's counter file: [family][bucket][calls, bytes].
COPY_FAMILIES = ("memcpy", "memmove")
COPY_BUCKETS = ("<256B", "<4KiB", "<64KiB", "<1MiB", "<16MiB", ">=16MiB")
PAYLOAD_BUCKET = 2  # buckets from here on are calls >= 4 KiB
CG_READY_TIMEOUT_S = 300


class LoopbackHosts:
    """mesh_bench's two hosts on one loopback: host 1 is 127.0.0.1, host 2
    127.0.0.2 (the whole 127/8 is local), commands run as they are; no link
    counters (a transfer's bytes on the wire are not a figure here)."""

    ADDRS = {"h1": "127.0.0.1", "h2": "127.0.0.2"}

    def addr(self, name):
        return self.ADDRS[name]

    def cmd(self, name, argv):
        return list(argv)

    def tx_bytes(self, name):
        return 0

    def qdisc_bytes(self, name):
        return 0


def thread_runtimes(pid):
    """{tid: ns on CPU} of every thread of pid (/proc/PID/task/TID/schedstat,
    the scheduler's sum_exec_runtime: user + system, in ns, not ticks); {} when
    unreadable."""
    out = {}
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    out[tid] = int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                pass  # the thread ended between listdir and open
    except OSError:
        return {}
    return out


def free_port():
    """A TCP port free on both loopback addresses (checked, then released)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            try:
                with socket.socket() as t:
                    t.bind(("127.0.0.2", port))
                return port
            except OSError:
                continue
    raise mb.BenchError("no TCP port free on both 127.0.0.1 and 127.0.0.2")


class CostBench(mb.Bench):
    """mesh_bench.Bench whose relays may run behind a wrapper (env with
    LD_PRELOAD, valgrind): the wrapper execs, so the pid is the relay's."""

    def __init__(self, args, hosts, run_dir):
        super().__init__(args, hosts, run_dir)
        self.wrap = {}  # host -> argv prefix for that host's relay
        self.on_transfer = None  # (before, after) callables of mesh_rep's hooks
        self.runtime0 = self.runtime1 = []  # per relay {tid: ns} around the last transfer

    def start(self, host, argv, name):
        if argv and argv[0] == self.server:
            argv = list(argv) + list(self.a.relay_arg or [])
            if self.wrap.get(host):
                argv = self.wrap[host] + argv
        return super().start(host, argv, name)

    def before_transfer(self, relays):
        self.runtime0 = [thread_runtimes(r.p.pid) for r in relays]
        if self.on_transfer:
            self.on_transfer[0](relays)

    def after_transfer(self, relays):
        self.runtime1 = [thread_runtimes(r.p.pid) for r in relays]
        if self.on_transfer:
            self.on_transfer[1](relays)

    def mesh_rep(self, relays, agent_addr, spec, session):
        """mesh_bench's transfer; each relay's CPU from its threads' run
        time in ns where no thread ended inside the window (else the
        /proc/PID/stat ticks mesh_bench reads)."""
        res = super().mesh_rep(relays, agent_addr, spec, session)
        res["relay_cpu_source"] = {}
        for name, t0, t1 in zip(("relay_a", "relay_b"), self.runtime0, self.runtime1):
            if t0 and t1 and set(t0) <= set(t1):
                res["cpu_s"][name] = sum(ns - t0.get(tid, 0) for tid, ns in t1.items()) / 1e9
                res["relay_cpu_source"][name] = "schedstat"
            else:
                res["relay_cpu_source"][name] = "stat ticks"
        res["cpu_total_s"] = sum(res["cpu_s"].values())
        return res

    def set_geo(self, geo):
        self.geo = dict(geo)
        self.turn_flags = []
        for k, v in self.geo.items():
            self.turn_flags += [f"--{k.replace('_', '-')}", str(v)]

    def pair(self, tag, wrap=None):
        self.wrap = wrap or {}
        try:
            return self.relay_pair(tag, "plain", free_port())
        finally:
            self.wrap = {}


def per_gb(cpu_s, nbytes):
    return None if cpu_s is None else cpu_s / (nbytes / GB)


def median(xs):
    return mb.median(list(xs))


def stop(relays):
    for r in relays or ():
        if r is not None:
            r.stop()


# ---- CPU per GB

def cpu_phase(bench, args):
    n = mb.kv_bytes(bench.geo)
    out = {"kv_bytes": n, "raw": [], "policies": {p: [] for p in args.policy}, "warmup": {}}
    relays, addrs = bench.pair("cpu")
    try:
        for spec in args.policy:  # the first forward opens the relay-to-relay channel
            out["warmup"][spec] = bench.mesh_rep(relays, addrs, spec, f"cpu-warm-{len(out['warmup'])}")
        bench.raw_rep("warm")
        c0, t0 = [r.cpu_seconds() for r in relays], time.monotonic()
        time.sleep(2.0)
        out["idle_cpu_s_per_s"] = {name: (r.cpu_seconds() - c) / (time.monotonic() - t0)
                                   for name, r, c in zip(("relay_a", "relay_b"), relays, c0)}
        for r in range(args.reps):
            raw = bench.raw_rep(f"cpu-{r}")
            out["raw"].append(raw)
            print(f"  rep {r}: raw {raw['ms']:.1f} ms, CPU sender {raw['cpu_s']['sender']:.3f} s, receiver "
                  f"{raw['cpu_s']['receiver']:.3f} s", flush=True)
            order = args.policy if r % 2 == 0 else list(reversed(args.policy))
            for spec in order:
                res = bench.mesh_rep(relays, addrs, spec, f"cpu-{spec.split(':')[0]}-{r}")
                out["policies"][spec].append(res)
                c = res["cpu_s"]
                print(f"  rep {r}: {spec}: {res['ms']:.1f} ms, sent {res['sent_bytes'] / 1e6:.2f} MB, CPU s "
                      f"agent A {c['publisher']:.3f}, relay A {c['relay_a']:.3f}, relay B {c['relay_b']:.3f}, "
                      f"agent B {c['fetcher']:.3f}", flush=True)
    finally:
        stop(relays)
    raw_s = {k: median(x["cpu_s"][k] for x in out["raw"]) for k in ("sender", "receiver")}
    out["raw_cpu_s_per_gb"] = {k: per_gb(v, n) for k, v in raw_s.items()}
    out["raw_cpu_s_per_gb"]["total"] = per_gb(raw_s["sender"] + raw_s["receiver"], n)
    out["raw_ms"] = median(x["ms"] for x in out["raw"])
    rows = []
    for spec, reps in out["policies"].items():
        cpu = {k: median(x["cpu_s"][k] for x in reps) for k in ("publisher", "relay_a", "relay_b", "fetcher")}
        row = {"policy": spec, "ms": median(x["ms"] for x in reps), "sent_bytes": median(x["sent_bytes"] for x in reps),
               "full_bytes": median(x["full_bytes"] for x in reps), "cpu_s": cpu,
               "cpu_s_per_gb": {k: per_gb(v, n) for k, v in cpu.items()}}
        relays_gb = per_gb(cpu["relay_a"] + cpu["relay_b"], n)
        row["relays_cpu_s_per_gb"] = relays_gb
        raw_gb = out["raw_cpu_s_per_gb"]["total"]
        row["ratio"] = relays_gb / raw_gb if raw_gb else None
        pairs = [(m["cpu_s"]["relay_a"] + m["cpu_s"]["relay_b"]) / (w["cpu_s"]["sender"] + w["cpu_s"]["receiver"])
                 for m, w in zip(reps, out["raw"]) if w["cpu_s"]["sender"] + w["cpu_s"]["receiver"] > 0]
        row["paired_ratio"] = median(pairs)
        row["relay_cpu_from_ticks"] = sum(v == "stat ticks" for x in reps
                                          for v in x.get("relay_cpu_source", {}).values())
        rows.append(row)
    out["rows"] = rows
    return out


# ---- copies per byte (LD_PRELOAD counter)

def read_copy_counters(path):
    with open(path, "rb") as f:
        data = f.read()
    k = len(COPY_FAMILIES) * len(COPY_BUCKETS) * 2
    if len(data) < 8 * k:
        raise mb.BenchError(f"{path}: {len(data)} bytes, expected {8 * k} (was the preload library loaded?)")
    return struct.unpack(f"<{k}Q", data[:8 * k])


def copy_delta(c0, c1):
    """{family: [(calls, bytes) per bucket]} of c1 - c0."""
    out, i = {}, 0
    for fam in COPY_FAMILIES:
        out[fam] = []
        for _ in COPY_BUCKETS:
            out[fam].append((c1[i] - c0[i], c1[i + 1] - c0[i + 1]))
            i += 2
    return out


def copy_phase(bench, args, preload):
    files = {h: os.path.join(bench.dir, f"copycount-{h}.bin") for h in ("h1", "h2")}
    wrap = {h: ["env", f"LD_PRELOAD={preload}", f"KVRELAY_COPYCOUNT_FILE={files[h]}"] for h in files}
    out = {"policies": {p: [] for p in args.policy}}
    relays, addrs = bench.pair("copies", wrap)
    try:
        for i, spec in enumerate(args.policy):
            bench.mesh_rep(relays, addrs, spec, f"copies-warm-{i}")
        for r in range(args.copy_reps):
            for spec in args.policy:
                snap = []  # the counters right before and right after the transfer (mesh_rep's hooks)
                bench.on_transfer = (lambda _: snap.append({h: read_copy_counters(f) for h, f in files.items()}),) * 2
                try:
                    res = bench.mesh_rep(relays, addrs, spec, f"copies-{spec.split(':')[0]}-{r}")
                finally:
                    bench.on_transfer = None
                c0, c1 = snap
                rep = {"sent_bytes": res["sent_bytes"], "full_bytes": res["full_bytes"],
                       "received_bytes": res["received_bytes"]}
                for h, name in (("h1", "relay_a"), ("h2", "relay_b")):
                    d = copy_delta(c0[h], c1[h])
                    total = sum(b for fam in d.values() for _, b in fam)
                    big = sum(b for fam in d.values() for _, b in fam[PAYLOAD_BUCKET:])
                    rep[name] = {"buckets": d, "bytes": total, "bytes_ge_4k": big,
                                 "copies": total / res["sent_bytes"], "copies_ge_4k": big / res["sent_bytes"]}
                out["policies"][spec].append(rep)
                print(f"  copies {spec} rep {r}: relay A {rep['relay_a']['copies']:.2f} "
                      f"(>=4KiB {rep['relay_a']['copies_ge_4k']:.2f}), relay B {rep['relay_b']['copies']:.2f} "
                      f"(>=4KiB {rep['relay_b']['copies_ge_4k']:.2f}) per message byte "
                      f"({res['sent_bytes'] / 1e6:.2f} MB)", flush=True)
    finally:
        stop(relays)
    out["rows"] = []
    for spec, reps in out["policies"].items():
        if not reps:
            continue
        row = {"policy": spec, "sent_bytes": median(x["sent_bytes"] for x in reps),
               "received_bytes": median(x["received_bytes"] for x in reps)}
        for name in ("relay_a", "relay_b"):
            row[name] = {k: median(x[name][k] for x in reps) for k in ("copies", "copies_ge_4k", "bytes")}
            last = reps[-1][name]["buckets"]
            row[name]["by_size_mb"] = {f"{fam} {b}": last[fam][i][1] / 1e6 for fam in COPY_FAMILIES
                                       for i, b in enumerate(COPY_BUCKETS) if last[fam][i][1]}
            row[name]["calls_by_size"] = {f"{fam} {b}": last[fam][i][0] for fam in COPY_FAMILIES
                                          for i, b in enumerate(COPY_BUCKETS) if last[fam][i][0]}
        out["rows"].append(row)
    return out


# ---- instructions (perf, else callgrind)

def perf_instructions_work():
    if not shutil.which("perf"):
        return False, "perf not installed"
    p = subprocess.run(["perf", "stat", "-x,", "-e", "instructions", "--", "true"], capture_output=True, text=True)
    if p.returncode != 0 or "not supported" in p.stderr or "not counted" in p.stderr:
        return False, "perf stat -e instructions: not supported here (no hardware counters)"
    return True, ""


ANNOTATE_LINE = re.compile(r"^\s*([\d,]+)\s+(?:\(\s*[\d.]+%\)\s+)?(\S.*?)\s*$")


def annotate_inclusive(path):
    """The total and [(inclusive Ir, function)] of callgrind_annotate's
    function list, largest first."""
    argv = ["callgrind_annotate", "--inclusive=yes", "--threshold=100", path]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        raise mb.BenchError(f"callgrind_annotate {path}: {p.stderr.strip()[-300:]}")
    total, funcs = None, []
    for line in p.stdout.splitlines():
        m = ANNOTATE_LINE.match(line)
        if not m:
            continue
        ir, what = int(m.group(1).replace(",", "")), m.group(2)
        if "PROGRAM TOTALS" in what:
            total = ir
        elif total is not None:
            funcs.append((ir, what))
    funcs.sort(key=lambda x: -x[0])
    return total, funcs


def split_fn(fn):
    """(function, object file's basename) of a callgrind_annotate entry."""
    m = re.search(r"\s*\[([^\]]*)\]$", fn)
    obj = os.path.basename(m.group(1)) if m else "?"
    fn = fn[:m.start()] if m else fn
    fn = re.sub(r"^\?\?\?:|^[^ :]*\.(?:cc|c|h|S|cpp|inc):", "", fn)  # the source file
    return fn, obj


def short(fn, width=100):
    f, obj = split_fn(fn)
    f = f if len(f) <= width else f[:width - 3] + "..."
    return f"{f} [{obj}]"


def parse_dump(path):
    """Self Ir per function, the object of each function, and the inclusive
    Ir of each (caller, callee) call arc, read from a callgrind dump (format:
    valgrind's docs/callgrind-format; name compression "(id) name")."""
    names = {"ob": {}, "fn": {}}
    kind_of = {"ob": "ob", "cob": "ob", "fn": "fn", "cfn": "fn", "cfi": None, "cfl": None, "fl": None, "fi": None,
               "fe": None}
    self_ir, arcs, obj_of = {}, {}, {}
    cur_ob = cur_fn = cur_cob = cur_cfn = None
    in_call = False
    with open(path, errors="replace") as f:
        for line in f:
            c = line[:1]
            if c.isdigit() or c in "+-*":
                parts = line.split()
                ir = int(parts[1]) if len(parts) > 1 else 0
                if in_call:
                    arcs[(cur_fn, cur_cfn)] = arcs.get((cur_fn, cur_cfn), 0) + ir
                    in_call, cur_cob = False, None
                elif cur_fn is not None:
                    self_ir[cur_fn] = self_ir.get(cur_fn, 0) + ir
                continue
            if line.startswith("calls="):
                in_call = True
                continue
            key, eq, val = line.rstrip("\n").partition("=")
            if not eq or key not in kind_of:
                continue
            kind = kind_of[key]
            if kind is None:
                continue
            m = re.match(r"\((\d+)\)(?: (.*))?$", val)
            if m:
                if m.group(2) is not None:
                    names[kind][m.group(1)] = m.group(2)
                name = names[kind].get(m.group(1), val)
            else:
                name = val
            if key == "ob":
                cur_ob = name
            elif key == "cob":
                cur_cob = name
            elif key == "fn":
                cur_fn, cur_cob = name, None
                obj_of[name] = cur_ob
            else:  # cfn
                cur_cfn = name
                obj_of.setdefault(name, cur_cob or cur_ob)
    return self_ir, obj_of, arcs


MEMCPY_FN = re.compile(r"(^|[^A-Za-z])(__)?mem(cpy|move|pcpy)", re.I)
CRC_FN = re.compile(r"crc32|kvrelay::(\(anonymous namespace\)::)?ExtendState\(", re.I)  # core/crc32c.cc


def callgrind_control(flag, pid):
    p = subprocess.run(["callgrind_control", flag, str(pid)], capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        raise mb.BenchError(f"callgrind_control {flag} {pid}: {(p.stdout + p.stderr).strip()[-300:]}")


def dumps_of(prefix):
    d, base = os.path.split(prefix)
    return sorted(os.path.join(d, f) for f in os.listdir(d) if f.startswith(base))


def calibrate(args, run_dir):
    exe = os.path.join(args.build, "bin", "copy_calibration")
    out_file = os.path.join(run_dir, "callgrind.calibration")
    subprocess.run(["valgrind", "--tool=callgrind", "--dump-instr=no", f"--callgrind-out-file={out_file}", exe],
                   capture_output=True, text=True, timeout=900, check=True)
    _, funcs = annotate_inclusive(out_file)
    per_size = {}
    for ir, fn in funcs:
        m = re.search(r"CopyMany<(\d+)ul>", fn)
        if m:
            per_size[int(m.group(1))] = ir / (256 << 20)
    return per_size


def callgrind_phase(bench, args):
    ok, why = perf_instructions_work()
    out = {"perf": why or "perf stat works (not used: per-process callgrind gives functions too)"}
    if not shutil.which("valgrind") or not shutil.which("callgrind_control"):
        out["error"] = "valgrind not installed (apt-get install valgrind)"
        return out
    geo = dict(bench.geo, layers=args.cg_layers)
    saved = dict(bench.geo)
    bench.set_geo(geo)
    n = mb.kv_bytes(geo)
    out.update({"kv_bytes": n, "turn": " ".join(bench.turn_flags), "policies": {}})
    prefixes = {h: os.path.join(bench.dir, f"callgrind.{h}") for h in ("h1", "h2")}
    wrap = {h: ["valgrind", "--tool=callgrind", "--dump-instr=no", "--trace-children=no",
                f"--callgrind-out-file={prefixes[h]}.%p"] for h in prefixes}
    old_timeout = bench.READY_TIMEOUT_S
    bench.READY_TIMEOUT_S = CG_READY_TIMEOUT_S
    relays = None
    try:
        relays, addrs = bench.pair("callgrind", wrap)
        for i, spec in enumerate(args.policy):
            bench.mesh_rep(relays, addrs, spec, f"cg-warm-{i}")
        for spec in args.policy:
            before = {h: set(dumps_of(prefixes[h])) for h in prefixes}
            bench.on_transfer = (lambda rs: [callgrind_control("-z", r.p.pid) for r in rs],
                                 lambda rs: [callgrind_control("-d", r.p.pid) for r in rs])
            try:
                res = bench.mesh_rep(relays, addrs, spec, f"cg-{spec.split(':')[0]}")
            finally:
                bench.on_transfer = None
            pol = {"sent_bytes": res["sent_bytes"], "cpu_s_under_valgrind": res["cpu_s"]}
            for h, name in (("h1", "relay_a"), ("h2", "relay_b")):
                new = [f for f in dumps_of(prefixes[h]) if f not in before[h]]
                if not new:
                    raise mb.BenchError(f"callgrind_control -d wrote no dump for {name}")
                dump = new[-1]
                total, incl = annotate_inclusive(dump)
                top_incl = incl[:args.cg_top]
                self_ir, obj_of, arcs = parse_dump(dump)
                all_self = sorted(((ir, f"{fn} [{obj_of.get(fn) or '?'}]") for fn, ir in self_ir.items()),
                                  key=lambda x: -x[0])
                is_copy = {fn for fn in self_ir if MEMCPY_FN.search(fn)}
                memcpy_ir = sum(self_ir[fn] for fn in is_copy)
                crc_ir = sum(ir for fn, ir in self_ir.items() if CRC_FN.search(fn))
                by_obj = {}
                for fn, ir in self_ir.items():
                    obj = os.path.basename(obj_of.get(fn) or "?")
                    by_obj[obj] = by_obj.get(obj, 0) + ir
                callers = {}
                for (caller, callee), ir in arcs.items():
                    if callee in is_copy and caller not in is_copy:
                        callers[caller] = callers.get(caller, 0) + ir
                top_callers = sorted(callers.items(), key=lambda x: -x[1])[:12]
                pol[name] = {"dump": dump, "self_by_object": sorted(by_obj.items(), key=lambda x: -x[1])[:12],
                             "memcpy_callers": [(ir, short(f"{fn} [{obj_of.get(fn) or '?'}]"))
                                                for fn, ir in top_callers], "ir": total, "ir_per_kv_byte": total / n,
                             "ir_per_message_byte": total / res["sent_bytes"],
                             "memcpy_ir": memcpy_ir, "crc32_ir": crc_ir,
                             "top_inclusive": [(ir, short(fn)) for ir, fn in top_incl],
                             "top_self": [(ir, short(fn)) for ir, fn in all_self[:args.cg_top]]}
                print(f"  callgrind {spec} {name}: {total / n:.2f} instructions per K/V byte "
                      f"({total / 1e6:.1f} M), memcpy/memmove {memcpy_ir / total:.1%}, crc32 {crc_ir / total:.1%}",
                      flush=True)
            out["policies"][spec] = pol
    finally:
        stop(relays)
        bench.READY_TIMEOUT_S = old_timeout
        bench.set_geo(saved)
    try:
        cal = calibrate(args, bench.dir)
        out["memcpy_ir_per_byte"] = cal
        big = [v for s, v in cal.items() if s >= 4096]
        if big and "full" in out["policies"]:
            pol = out["policies"]["full"]
            for name in ("relay_a", "relay_b"):
                x = pol[name]
                x["copies_est_range"] = (x["memcpy_ir"] / (max(big) * pol["sent_bytes"]),
                                         x["memcpy_ir"] / (min(big) * pol["sent_bytes"]))
    except (subprocess.SubprocessError, OSError) as e:
        out["calibration_error"] = str(e)[:300]
    return out


# ---- the report

def fmt(x, spec="%.3f"):
    return "-" if x is None else spec % x


def cpu_model():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def print_report(res):
    print("\n== cost of the relay path ==")
    print(f"CPU: {res['cpu_model']}, {res['cpus']} CPUs; kernel {res['kernel']}; load {res['load_before']} -> "
          f"{res.get('load_after')}")
    print(f"turn: {res['turn']}; K/V {res['kv_bytes'] / 1e6:.1f} MB; {res['reps']} reps, medians")
    c = res.get("cpu")
    if c:
        print("\nCPU seconds per GB of K/V (user+sys):")
        print("%-16s %9s %9s %9s %9s %11s %11s %9s %9s" % ("policy", "agent A", "relay A", "relay B", "agent B",
                                                           "relays", "ratio", "per-rep", "sent MB"))
        for r in c["rows"]:
            g = r["cpu_s_per_gb"]
            print("%-16s %9s %9s %9s %9s %11s %11s %9s %9s" % (
                r["policy"], fmt(g["publisher"]), fmt(g["relay_a"]), fmt(g["relay_b"]), fmt(g["fetcher"]),
                fmt(r["relays_cpu_s_per_gb"]), fmt(r["ratio"], "%.2f"), fmt(r["paired_ratio"], "%.2f"),
                fmt(r["sent_bytes"] / 1e6, "%.1f")))
        w = c["raw_cpu_s_per_gb"]
        print(f"raw TCP: sender {fmt(w['sender'])}, receiver {fmt(w['receiver'])}, both {fmt(w['total'])} CPU s/GB "
              f"({fmt(c['raw_ms'], '%.1f')} ms per {res['kv_bytes'] / 1e6:.1f} MB)")
        print(f"ratio = (relay A + relay B) / (raw sender + raw receiver), target <= {RATIO_TARGET}; per-rep: the "
              "median of the per-rep ratios")
        ticks = sum(r["relay_cpu_from_ticks"] for r in c["rows"])
        print(f"relay CPU from thread run times (ns); {ticks} relay readings fell back to /proc/PID/stat ticks")
        idle = c.get("idle_cpu_s_per_s") or {}
        print("relays' idle CPU: " + ", ".join(f"{k} {v * 1e3:.1f} ms/s" for k, v in idle.items()))
    cp = res.get("copies")
    if cp:
        print(f"\ncopies per message byte inside each relay (LD_PRELOAD memcpy/memmove byte count; target <= "
              f"{COPIES_TARGET}):")
        for r in cp["rows"]:
            a, b = r["relay_a"], r["relay_b"]
            print(f"  {r['policy']:16s} message {r['sent_bytes'] / 1e6:.2f} MB: relay A {a['copies']:.2f} "
                  f"(calls >= 4 KiB: {a['copies_ge_4k']:.2f}; per uploaded byte, {r['received_bytes'] / 1e6:.1f} MB: "
                  f"{a['bytes'] / r['received_bytes']:.2f}), relay B {b['copies']:.2f} "
                  f"(>= 4 KiB: {b['copies_ge_4k']:.2f})")
            for name, x in (("relay A", a), ("relay B", b)):
                print(f"    {name} MB by call size: " + ", ".join(f"{k} {v:.1f}" for k, v in x["by_size_mb"].items()))
    cg = res.get("callgrind")
    if cg:
        print(f"\ninstructions (callgrind; {cg.get('perf')}):")
        if "error" in cg:
            print("  " + cg["error"])
        else:
            print(f"  turn {cg['turn']}: K/V {cg['kv_bytes'] / 1e6:.2f} MB")
            for spec, pol in cg["policies"].items():
                for name in ("relay_a", "relay_b"):
                    x = pol[name]
                    est = x.get("copies_est_range")
                    print(f"  {spec} {name}: {x['ir_per_kv_byte']:.2f} instructions per K/V byte, "
                          f"{x['ir_per_message_byte']:.2f} per message byte; memcpy/memmove "
                          f"{x['memcpy_ir'] / x['ir']:.1%}"
                          f", crc32 {x['crc32_ir'] / x['ir']:.1%}" +
                          (f"; copies from memcpy Ir {est[0]:.2f}..{est[1]:.2f}" if est else ""))
            if cg.get("memcpy_ir_per_byte"):
                print("  memcpy Ir per byte by call size (under callgrind): " +
                      ", ".join(f"{s} B {v:.3f}" for s, v in sorted(cg["memcpy_ir_per_byte"].items())))
            for spec, pol in cg["policies"].items():
                x = pol["relay_a"]
                print(f"  {spec} relay A, top by inclusive instructions:")
                for ir, fn in x["top_inclusive"]:
                    print(f"    {ir / x['ir']:6.1%} {fn}")
                print(f"  {spec} relay A, self instructions by object: " +
                      ", ".join(f"{o} {ir / x['ir']:.1%}" for o, ir in x["self_by_object"]))
                print(f"  {spec} relay A, top by self instructions:")
                for ir, fn in x["top_self"]:
                    print(f"    {ir / x['ir']:6.1%} {fn}")
            for spec, pol in cg["policies"].items():
                for name in ("relay_a", "relay_b"):
                    x = pol[name]
                    print(f"  {spec} {name}: memcpy/memmove instructions by caller (% of the relay's):")
                    for ir, fn in x["memcpy_callers"]:
                        print(f"    {ir / x['ir']:6.1%} {fn}")
    for n in res["notes"]:
        print("note: " + n)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default=os.path.join(mb.ROOT, "build"), help="build folder (binaries in BUILD/bin)")
    ap.add_argument("--reps", type=int, default=5, help="timed transfers per policy, and raw sends")
    ap.add_argument("--policy", action="append", help=f"policy spec (repeatable; default: {', '.join(POLICIES)})")
    ap.add_argument("--no-copies", action="store_true", help="skip the copy count (LD_PRELOAD relay pair)")
    ap.add_argument("--copy-reps", type=int, default=2, help="transfers per policy for the copy count")
    ap.add_argument("--callgrind", action="store_true", help="relays under valgrind --tool=callgrind: instructions")
    ap.add_argument("--cg-layers", type=int, default=4, help="layers of the turn under callgrind (default 4)")
    ap.add_argument("--cg-top", type=int, default=25, help="functions listed per ranking")
    ap.add_argument("--relay-arg", action="append", help="one more kvrelay-server argument for both relays "
                    "(repeatable; e.g. --relay-arg=--wire-codec=none)")
    ap.add_argument("--skip-cpu", action="store_true", help="no CPU reps (only the copies / callgrind parts)")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--time-limit", type=int, default=1800, help="seconds for the whole run (then cleaned up, exit 1)")
    ap.add_argument("--keep-logs", action="store_true")
    for flag, dflt in (("layers", 40), ("kv-heads", 8), ("score-heads", 40), ("head-dim", 128), ("prompt", 512),
                       ("gen", 40)):
        ap.add_argument(f"--{flag}", type=int, default=dflt)
    args = ap.parse_args()
    if not 1 <= args.reps <= 50 or not 1 <= args.copy_reps <= 20:
        ap.error("--reps: 1..50, --copy-reps: 1..20 expected")
    args.policy = args.policy or list(POLICIES)
    args.agent = os.path.join(args.build, "bin", "mesh_bench_agent")
    args.server = os.path.join(args.build, "bin", "kvrelay-server")
    preload = os.path.join(args.build, "lib", "libcopy_count_preload.so")
    need = [args.agent, args.server] + ([os.path.join(args.build, "bin", "copy_calibration")] if args.callgrind else [])
    for b in need:
        if not os.access(b, os.X_OK):
            ap.error(f"no executable {b} (cmake --build {args.build} --target mesh_bench_agent kvrelay-server "
                     "copy_count_preload copy_calibration)")
    if not args.no_copies and not os.path.exists(preload):
        ap.error(f"no {preload} (cmake --build {args.build} --target copy_count_preload), or --no-copies")
    # mesh_bench.Bench's settings for a plaintext mesh, agents on Unix sockets.
    args.link_security, args.agent_transport, args.topology, args.raw_only = ["plain"], "unix", "mesh", False

    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGALRM)

    def on_signal(sig, _frame):
        for s in handled:
            signal.signal(s, signal.SIG_IGN)
        raise mb.Interrupted(f"signal {signal.Signals(sig).name}")

    for sig in handled:
        signal.signal(sig, on_signal)
    signal.alarm(args.time_limit)
    run_dir = tempfile.mkdtemp(prefix="kvrelay-cost-bench-")
    bench = CostBench(args, LoopbackHosts(), run_dir)
    res = {"cpu_model": cpu_model(), "cpus": os.cpu_count(), "kernel": platform.release(),
           "load_before": open("/proc/loadavg").read().split()[0], "reps": args.reps,
           "turn": " ".join(bench.turn_flags) + " bf16", "kv_bytes": mb.kv_bytes(bench.geo), "policies": args.policy,
           "command": " ".join(sys.argv), "relay_args": args.relay_arg or [], "notes": bench.notes}
    status = 0
    try:
        try:
            if not args.skip_cpu:
                print("CPU per GB ...", flush=True)
                res["cpu"] = cpu_phase(bench, args)
            if not args.no_copies:
                print("copies per byte (LD_PRELOAD counter) ...", flush=True)
                res["copies"] = copy_phase(bench, args, preload)
            if args.callgrind:
                print("instructions (callgrind) ...", flush=True)
                res["callgrind"] = callgrind_phase(bench, args)
        finally:
            mb.kill_all()
    except (mb.BenchError, mb.Interrupted, KeyboardInterrupt, subprocess.SubprocessError) as e:
        print(f"cost_bench: run ended early: {type(e).__name__}: {e}", file=sys.stderr)
        res["notes"].append(f"run ended early: {type(e).__name__}: {str(e)[:500]}")
        status = 1
    finally:
        signal.alarm(0)
        mb.kill_all()
    res["load_after"] = open("/proc/loadavg").read().split()[0]
    print_report(res)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1, default=str)
        print(f"wrote {args.out}")
    if args.keep_logs or status or args.callgrind:
        print(f"logs: {run_dir}")
    else:
        shutil.rmtree(run_dir, ignore_errors=True)
    return status


if __name__ == "__main__":
    sys.exit(main())

"""Helpers shared by the Python test drivers (stdlib only, /usr/bin/python3).

A driver adds this folder to sys.path relative to its own file:

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "testlib"))
    import kvrelay_testlib as tl

- Server: a kvrelay-server process (127.0.0.1:0 unless told otherwise) that
  waits for the ready line `kvrelay-server ready grpc=ADDR[,ADDR...]
  metrics=HOST:PORT[ health=HOST:PORT]` (ADDR: HOST:PORT or unix:PATH), exposes
  addrs, addr (the first), metrics and health (None without --health-listen),
  collects the log (in a file when given a folder) and
  stops with SIGTERM, then SIGKILL. Every Server started
  is listed in STARTED, so a driver (or its watchdog) can end them all.
- run / completed / check_run: a command with a timeout.
- clean_env, port_open, stop_process, read_st, parse_exposition.
- unittest_main: unittest.main under a watchdog that ends the servers.
- random_turn (needs numpy and the kvrelay package), rss_bytes.
"""
import json
import os
import queue
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import unittest

READY_RE = re.compile(r"kvrelay-server ready grpc=(\S+) metrics=(\S+)(?: health=(\S+))?$")
LOOPBACK_ARGS = ("--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0")
STARTED = []  # the subprocess.Popen of every Server started


# ---- processes ------------------------------------------------------------------

def clean_env(**extra):
    """The environment without any KVRELAY_* variable, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVRELAY_")}
    env.update(extra)
    return env


def run(cmd, timeout=120, env=None, cwd=None):
    """(returncode or None on timeout or when it cannot start, stdout, stderr);
    env None: clean_env()."""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                           env=env if env is not None else clean_env(), cwd=cwd)
        return p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired:
        return None, "", f"timed out after {timeout} s: {' '.join(cmd)}"
    except OSError as e:
        return None, "", f"{cmd[0]}: {e}"


def completed(cmd, timeout=120, env=None, cwd=None):
    """subprocess.run with text output captured; env None: this environment.
    Raises subprocess.TimeoutExpired past `timeout`."""
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)


def check_run(cmd, timeout=120, env=None, cwd=None):
    """completed(), raising AssertionError (with both outputs) on a non-zero exit."""
    p = completed(cmd, timeout=timeout, env=env, cwd=cwd)
    if p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)}: rc={p.returncode}\nstdout: {p.stdout}\nstderr: {p.stderr}")
    return p


# Failures collected by check() for drivers that run every step and report
# all failures at the end (instead of stopping at the first).
FAILURES = []


def check(cond, what):
    """Records `what` as a failure unless cond; returns cond."""
    if not cond:
        FAILURES.append(what)
        print("FAIL:", what, flush=True)
    return cond


def wait_for(probe, timeout, interval=0.1):
    """Calls probe() until it returns something true or `timeout` seconds
    have passed; returns its last result."""
    deadline = time.time() + timeout
    while True:
        got = probe()
        if got or time.time() >= deadline:
            return got
        time.sleep(interval)


class Ctl:
    """Runs kvrelayctl with a clean environment. `addr` (constructor) is the
    relay appended as --addr by default; per call, addr=False appends none
    and a string appends that address instead."""

    def __init__(self, binary, workdir, addr=None):
        self.binary, self.dir, self.addr = binary, workdir, addr

    def run(self, *args, addr=True, timeout=120):
        cmd = [self.binary] + list(args)
        target = self.addr if addr is True else addr
        if target:
            cmd += ["--addr", target]
        return run(cmd, timeout=timeout)

    def ok(self, *args, addr=True, timeout=120):
        """The key=value pairs kvrelayctl printed (plus "_out"), or {} after
        recording a failure when it did not exit 0."""
        rc, out, err = self.run(*args, addr=addr, timeout=timeout)
        if not check(rc == 0, f"kvrelayctl {' '.join(args)}: rc={rc} stderr={err.strip()}"):
            return {}
        return dict(re.findall(r"(\w+)=(\S+)", out)) | {"_out": out}

    def path(self, name):
        return os.path.join(self.dir, name)


def stop_process(proc, timeout=20, kill_timeout=10):
    """SIGTERM, up to `timeout` s for it to exit, then SIGKILL; the exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=kill_timeout)
    return proc.returncode


def port_open(hostport, timeout=2.0):
    """Whether something accepts connections at HOST:PORT or unix:PATH."""
    try:
        if hostport.startswith("unix:"):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(timeout)
                s.connect(hostport[len("unix:"):])
                return True
        host, port = hostport.rsplit(":", 1)
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except OSError:
        return False


def ready_text(line):
    """The text of a stdout line: the line itself, or with --log-json the
    record's msg."""
    text = line.rstrip("\n")
    if text.startswith("{"):
        try:
            return str(json.loads(text).get("msg", ""))
        except ValueError:
            pass
    return text


class Server:
    """A kvrelay-server process; the constructor returns once it printed its ready line.

    args None: --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 (pass [] for
    none at all); env None: clean_env(). With `workdir` the output goes to
    WORKDIR/NAME.log as it comes (log_path); it is also kept in memory (log()).
    No ready line within `timeout` s, or an exit before it: the process is
    killed and RuntimeError names the log and shows its tail.
    """

    def __init__(self, binary, workdir=None, args=None, env=None, name="kvrelay-server", timeout=30):
        self.binary, self.name = binary, name
        self.log_path = os.path.join(workdir, f"{name}.log") if workdir else None
        self._log = open(self.log_path, "w") if self.log_path else None
        self._lines = []
        self._queue = queue.Queue()
        self.proc = subprocess.Popen([binary] + list(LOOPBACK_ARGS if args is None else args),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env if env is not None else clean_env())
        STARTED.append(self.proc)
        threading.Thread(target=self._drain, daemon=True).start()
        self.addr = self.metrics = self.health = self.ready_line = None
        self.addrs = []  # every gRPC address of the ready line, in --listen order
        deadline = time.time() + timeout
        while time.time() < deadline and self.addr is None:
            try:
                line = self._queue.get(timeout=max(0.1, deadline - time.time()))
            except queue.Empty:
                break
            if line is None:  # stdout closed: the server exited
                break
            text = ready_text(line)
            m = READY_RE.match(text)
            if m:
                self.ready_line = text
                self.addrs = m.group(1).split(",")
                self.addr, self.metrics, self.health = self.addrs[0], m.group(2), m.group(3)
        if self.addr is None:
            status = self.proc.poll()
            self.kill()
            how = "still running, killed" if status is None else f"exited with status {status}"
            where = f"; log {self.log_path}" if self.log_path else ""
            raise RuntimeError(f"{name} printed no ready line within {timeout} s ({how}{where}); "
                               f"output:\n{self.log()[-2000:]}")

    def _drain(self):
        for line in self.proc.stdout:
            self._lines.append(line)
            if self._log:
                self._log.write(line)
                self._log.flush()
            self._queue.put(line)
        self._queue.put(None)

    def log(self):
        """What the server printed so far."""
        return "".join(self._lines)

    def terminate(self, timeout):
        """SIGTERM; (exit status or None when still running after `timeout`, seconds taken)."""
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        return rc, time.monotonic() - t0

    def stop(self, timeout=20):
        """SIGTERM, then SIGKILL after `timeout` s; the exit status."""
        if self.proc.poll() is None:
            rc, _ = self.terminate(timeout)
            if rc is None:
                self.kill()
        return self.proc.returncode

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def kill_started():
    """SIGKILL every Server still running; the pids that did not die within 10 s."""
    stuck = []
    for p in STARTED:
        if p.poll() is None:
            p.kill()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                stuck.append(p.pid)
    return stuck


def stop_started(timeout=20):
    """Server.stop() for every Server still running."""
    for p in STARTED:
        stop_process(p, timeout)


# ---- turns and processes ------------------------------------------------------------

def random_turn(seed, layers=4, H=4, S=8, d=64, n_prompt=512, n_gen=16):
    """A synthetic F32 turn from `seed` (the same bytes for the same seed):
    `layers` x [H, n_prompt + n_gen, d] K and V, scores [S, n_prompt]."""
    import numpy as np  # only the drivers that make turns need them
    import kvrelay
    rng = np.random.default_rng(seed)
    return kvrelay.Turn([kvrelay.TurnLayer(
        prompt_k=rng.standard_normal((H, n_prompt, d), dtype=np.float32),
        prompt_v=rng.standard_normal((H, n_prompt, d), dtype=np.float32),
        gen_k=rng.standard_normal((H, n_gen, d), dtype=np.float32),
        gen_v=rng.standard_normal((H, n_gen, d), dtype=np.float32),
        score=rng.random((S, n_prompt), dtype=np.float32)) for _ in range(layers)], dtype="F32")


def rss_bytes(pid):
    """VmRSS of process `pid` in bytes (0 when unknown)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


# ---- files and scrapes -------------------------------------------------------------

def read_st(path):
    """(metadata, {name: (dtype, shape, bytes)}) of a safetensors file."""
    with open(path, "rb") as f:
        buf = f.read()
    (n,) = struct.unpack("<Q", buf[:8])
    header = json.loads(buf[8:8 + n])
    meta = header.pop("__metadata__", {}) or {}
    out = {}
    for name, t in header.items():
        b, e = t["data_offsets"]
        out[name] = (t["dtype"], tuple(t["shape"]), buf[8 + n + b:8 + n + e])
    return meta, out


def same_message(a, b, what, keys=("n_history", "n_anchor", "n_kept", "n_gen", "next_pos", "anchor_pos")):
    """Two message files hold the same tensors byte for byte, acc aside
    (relay-side state, which a delivery does not carry and an offline
    compression writes), and the same metadata `keys`."""
    ma, ta = read_st(a)
    mb, tb = read_st(b)
    ta = {k: v for k, v in ta.items() if not k.endswith(".acc")}
    tb = {k: v for k, v in tb.items() if not k.endswith(".acc")}
    ok = check(set(ta) == set(tb), f"{what}: same tensors ({sorted(ta)[:4]} vs {sorted(tb)[:4]})")
    for name in ta:
        if name in tb:
            ok &= check(ta[name] == tb[name], f"{what}: {name} bit-exact")
    for key in keys:
        if key in ma or key in mb:
            ok &= check(ma.get(key) == mb.get(key), f"{what}: {key} {ma.get(key)} vs {mb.get(key)}")
    return ok


def free_port(host="127.0.0.1"):
    """A TCP port free on `host` now (the kernel's pick)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def scrape(server, on_bad_line=None):
    """parse_exposition of `server`'s /metrics."""
    import urllib.request
    text = urllib.request.urlopen(f"http://{server.metrics}/metrics", timeout=10).read().decode()
    return parse_exposition(text, on_bad_line)


def metric_total(samples, name, **labels):
    """The sum of the samples of `name` whose labels include `labels`."""
    return sum(v for (n, lab), v in samples.items() if n == name and all(dict(lab).get(k) == val
                                                                          for k, val in labels.items()))


def parse_exposition(text, on_bad_line=None):
    """{(name, frozenset(labels.items())): value} of a text-format scrape;
    on_bad_line(line) for each line it cannot parse (skipped)."""
    samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\d+)?$', line)
        if not m:
            if on_bad_line:
                on_bad_line(line)
            continue
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        samples[(m.group(1), frozenset(labels.items()))] = float(m.group(3))
    return samples


# ---- unittest drivers --------------------------------------------------------------

def unittest_main(rest, watchdog_s):
    """unittest.main over __main__ with the arguments `rest`, bounded by a
    watchdog (past `watchdog_s` s it kills every Server and exits 1); every
    Server still running is stopped at the end. The exit status."""
    def expire():
        print(f"FAIL: watchdog: the test ran past {watchdog_s} s", file=sys.stderr, flush=True)
        try:
            for p in STARTED:
                if p.poll() is None:
                    p.kill()
        finally:
            os._exit(1)

    dog = threading.Timer(watchdog_s, expire)
    dog.daemon = True
    dog.start()
    try:
        prog = unittest.main(argv=[sys.argv[0]] + list(rest), exit=False, verbosity=2)
    finally:
        dog.cancel()
        stop_started()
    return 0 if prog.result.wasSuccessful() else 1

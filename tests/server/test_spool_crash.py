#!/usr/bin/env python3
"""Crash tests of the spool: real relays, real clients, kill -9 at random
instants and at named crash points.

A checker drives publish, forward, fetch and ack through the Python client
against relays with --spool-dir, kills a relay with SIGKILL (or lets it kill
itself at KVRELAY_CRASH_POINT), restarts it on the same spool, lets the
clients retry with the same ids, and checks three invariants:

  1. every Publish that returned OK is fetchable until it is acked (or is
     dead-lettered with a reason that `kvrelayctl status` shows);
  2. each message id is committed once, with one content hash (every
     delivery of an id carries the same bytes);
  3. a message whose Ack returned OK is never delivered again.

Redelivery of unacked messages is allowed. Modes:
  single  one relay; the publisher and the recipient both use it;
  mesh    relay A (the sender's) forwards to relay B (the recipient's); A is
          killed, sometimes while B is stopped (SIGSTOP) so that forwards
          wait in A's outbox;
  points  each named crash point once (or --point-runs times), single relay
          for the spool points and the mesh for forward.mid_stream.

Every loop is bounded in count and time. Prints the figures:
iterations, publishes accepted, messages lost, duplicated (an id with two
contents), acked-but-redelivered.
"""
import argparse
import hashlib
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "testlib"))
import kvrelay_testlib as tl  # noqa: E402

import grpc  # noqa: E402
import numpy as np  # noqa: E402

import kvrelay  # noqa: E402

SPOOL_POINTS = ["spool.message.after_temp_write", "spool.message.before_rename",
                "spool.message.after_rename", "spool.journal.after_append"]
MESH_POINTS = ["forward.mid_stream"]
POLICY = "h2o-head:k=8"
SESSIONS = 3
ROUND = 100  # kills per round (fresh spools)
CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 50), ("grpc.min_reconnect_backoff_ms", 50),
                   ("grpc.max_reconnect_backoff_ms", 250)]


def make_turn(mid):
    """The turn of message `mid`: the same bytes on every retry."""
    seed = int(hashlib.sha256(mid.encode()).hexdigest()[:8], 16)
    return tl.random_turn(seed, layers=2, H=2, S=4, d=32, n_prompt=48, n_gen=4)


def content_hash(m):
    h = hashlib.sha256()
    for layer in m.layers:
        for a in (layer.k, layer.v, layer.pos):
            h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


class Relay:
    """A kvrelay-server on a fixed port and spool, restartable."""

    def __init__(self, server, work, name, port, extra):
        self.server, self.work, self.name, self.port = server, work, name, port
        self.spool = os.path.join(work, f"{name}-spool")
        self.extra = list(extra)
        self.proc = None
        self.starts = 0
        self.recovery_lines = []

    @property
    def addr(self):
        return f"127.0.0.1:{self.port}"

    def start(self, crash_point=None):
        env = tl.clean_env()
        if crash_point:
            env["KVRELAY_CRASH_POINT"] = crash_point
        # A round publishes thousands of messages into 3 sessions: above the
        # default 1024 per session the relay would refuse them, rightly.
        args = ["--listen", self.addr, "--metrics-listen", "off", "--spool-dir", self.spool,
                "--worker-threads", "2", "--max-session-messages", "100000"] + self.extra
        deadline = time.time() + 20
        while True:  # the port of a relay just killed may linger for a moment
            try:
                self.proc = tl.Server(self.server, self.work, args=args, env=env,
                                      name=f"{self.name}-{self.starts}", timeout=15)
                break
            except (RuntimeError, OSError):
                if time.time() > deadline:
                    raise
                time.sleep(0.2)
        self.starts += 1
        for line in self.proc.log().splitlines():
            if "spool: recovered" in line:
                self.recovery_lines.append(line)

    def kill(self):
        if self.proc and self.proc.proc.poll() is None:
            self.proc.proc.send_signal(signal.SIGCONT)
            self.proc.kill()

    def alive(self):
        return self.proc is not None and self.proc.proc.poll() is None

    def stop(self):
        if self.proc:
            self.proc.proc.send_signal(signal.SIGCONT)
            self.proc.stop()


class Checker:
    def __init__(self, rng):
        self.rng = rng
        self.lock = threading.Lock()
        self.accepted = {}        # (session, id) -> True once a Publish returned OK
        self.pending = {}         # (session, id) -> publish not yet OK (retried with the same id)
        self.hashes = {}          # (session, id) -> content hash of its first delivery
        self.acked = set()        # (session, id) acked OK by the recipient
        self.maybe_acked = set()  # an Ack that failed: it may have taken effect
        self.violations = []
        self.next_id = 0
        self.deliveries = 0

    def violation(self, text):
        with self.lock:
            self.violations.append(text)
        print(f"VIOLATION: {text}", flush=True)

    def new_message(self):
        with self.lock:
            self.next_id += 1
            key = (f"s{self.next_id % SESSIONS}", f"m{self.next_id}")
            self.pending[key] = True
            return key

    def delivered(self, session, m):
        key = (session, m.message_id)
        h = content_hash(m)
        with self.lock:
            self.deliveries += 1
            if key in self.acked:
                self.violations.append(f"{key} was acked OK and was delivered again")
            old = self.hashes.setdefault(key, h)
            if old != h:
                self.violations.append(f"{key} delivered with two contents")


def publish(client, ck, key, timeout=5.0):
    session, mid = key
    try:
        client.publish(make_turn(mid), session, "planner", ["critic"], message_id=mid, policy=POLICY,
                       retries=0, timeout=timeout)
    except kvrelay.PublishError:
        return False
    except grpc.RpcError:
        return False
    with ck.lock:
        ck.accepted[key] = True
        ck.pending.pop(key, None)
    return True


def consume_once(client, ck, session, timeout=0.3, ack_p=0.7):
    try:
        m = client.fetch(session, "critic", timeout=timeout)
    except (grpc.RpcError, kvrelay.RelayError):
        return False
    ck.delivered(session, m)
    if ck.rng.random() < ack_p:
        try:
            client.ack(session, "critic", m.message_id, timeout=2.0)
            with ck.lock:
                ck.acked.add((session, m.message_id))
        except grpc.RpcError:
            with ck.lock:
                ck.maybe_acked.add((session, m.message_id))
    return True


def traffic(pub, con, ck, stop, pub_relay, duration):
    """Publishes and consumes until `stop` is set or `duration` passes."""
    end = time.time() + duration

    def publisher():
        while not stop.is_set() and time.time() < end:
            with ck.lock:
                retry = next(iter(ck.pending), None)
            key = retry or ck.new_message()
            if not publish(pub, ck, key, timeout=3.0) and not pub_relay.alive():
                time.sleep(0.02)

    def consumer():
        s = 0
        while not stop.is_set() and time.time() < end:
            consume_once(con, ck, f"s{s % SESSIONS}")
            s += 1

    ts = [threading.Thread(target=publisher), threading.Thread(target=consumer)]
    for t in ts:
        t.start()
    return ts


def wait_ready(client, timeout=5.0):
    """Asks the client's channel to connect now and waits until it is ready.

    A channel whose calls failed fast while the relay was down sits in
    reconnect backoff for up to ~5 s after the relay is back (grpcio 1.51,
    with calls that do not wait for readiness); asking for a connection ends
    the wait at once."""
    ready = grpc.channel_ready_future(client._channel)
    try:
        ready.result(timeout=timeout)
        return True
    except grpc.FutureTimeoutError:
        ready.cancel()
        return False


def retry_pending(pub, ck, relay, deadline_s=20):
    """Retries every publish that has not returned OK, with its id, until it does."""
    end = time.time() + deadline_s
    wait_ready(pub)
    while time.time() < end:
        with ck.lock:
            keys = list(ck.pending)
        if not keys:
            return True
        for key in keys:
            if not publish(pub, ck, key):
                wait_ready(pub, timeout=1.0)
        if not relay.alive():
            return False
    return not ck.pending


def drain(con, ck, ctl, sender_relay, settle_s):
    """Fetches and acks everything; checks invariant 1 for every accepted id."""
    end = time.time() + settle_s
    wait_ready(con)
    while True:
        got = 0
        for s in range(SESSIONS):
            while consume_once(con, ck, f"s{s}", timeout=0.5, ack_p=1.0):
                got += 1
        with ck.lock:
            missing = [k for k in ck.accepted if k not in ck.acked]
        if not missing or time.time() > end:
            break
        time.sleep(0.3)
    for key in missing:
        # Dead-lettered with a reason that `kvrelayctl status` shows is allowed.
        rc, out, err = tl.run([ctl, "status", "--addr", sender_relay.addr, "--session", key[0], "--id", key[1]],
                              timeout=20)
        if rc == 0 and "dead" in out.lower() and "reason" in out.lower():
            print(f"dead-lettered (allowed): {key}: {out.strip()}")
            continue
        # An Ack whose answer was lost to the kill, and that took effect.
        if rc == 0 and key in ck.maybe_acked and "state=acked" in out:
            continue
        ck.violation(f"{key}: Publish returned OK, never acked, and not fetchable ({out.strip()} {err.strip()})")


def run_loop(args, mode, iterations, rng, crash_points=()):
    work = tempfile.mkdtemp(prefix=f"kvrelay-crash-{mode}-")
    ck = Checker(rng)
    t0 = time.time()
    relays = []
    try:
        if mode == "single":
            a = Relay(args.server, work, "a", tl.free_port(), [])
            relays = [a]
            b = a
        else:
            aport, bport = tl.free_port(), tl.free_port()
            b = Relay(args.server, work, "b", bport, [])
            a = Relay(args.server, work, "a", aport,
                      ["--route", f"critic=127.0.0.1:{bport}", "--advertise", f"127.0.0.1:{aport}",
                       "--forward-stall-seconds", "1", "--forward-timeout-seconds", "600"])
            relays = [a, b]
            b.start()
        a.start()
        pub = kvrelay.Client(a.addr, options=CHANNEL_OPTIONS)
        con = kvrelay.Client(b.addr, options=CHANNEL_OPTIONS)
        kills = 0
        plan = list(crash_points) if crash_points else [None] * iterations
        for i, point in enumerate(plan):
            if point:
                # The relay kills itself at the N-th time it reaches the point.
                a.stop()
                a.start(crash_point=f"{point}:{rng.randint(1, 3)}")
            stop = threading.Event()
            paused = mode == "mesh" and not point and rng.random() < 0.4
            if paused:
                b.proc.proc.send_signal(signal.SIGSTOP)  # forwards wait in A's outbox
            ts = traffic(pub, con, ck, stop, a, duration=30 if point else 5)
            if point:
                a.proc.proc.wait(timeout=30)  # it must reach the point under traffic
            else:
                time.sleep(rng.uniform(0.05, 0.8))
                a.kill()
            stop.set()
            for t in ts:
                t.join(20)
            if a.alive():
                ck.violation(f"crash point {point} was not reached within 30 s")
                a.kill()
            if paused:
                b.proc.proc.send_signal(signal.SIGCONT)
            kills += 1
            if kills % 100 == 0:
                with ck.lock:
                    print(f"  {mode}: {kills} kills in {time.time() - t0:.0f} s, {len(ck.accepted)} publishes "
                          f"accepted, {len(ck.acked)} acked, violations so far {len(ck.violations)}", flush=True)
            a.start()
            if not retry_pending(pub, ck, a):
                ck.violation(f"iteration {i}: publishes could not be retried after the restart")
        drain(con, ck, args.kvrelayctl, a, settle_s=60 if mode == "mesh" else 10)
        pub.close()
        con.close()
        elapsed = time.time() - t0
        with ck.lock:
            lost = sum(1 for v in ck.violations if "not fetchable" in v)
            dup = sum(1 for v in ck.violations if "two contents" in v)
            again = sum(1 for v in ck.violations if "delivered again" in v)
            print(f"crash loop {mode}{' (crash points)' if crash_points else ''}: {kills} kills in {elapsed:.0f} s, "
                  f"{len(ck.accepted)} publishes accepted, {len(ck.acked)} acked, {ck.deliveries} deliveries; "
                  f"lost {lost}, duplicated {dup}, acked-but-redelivered {again}, "
                  f"other violations {len(ck.violations) - lost - dup - again}", flush=True)
            for line in a.recovery_lines[-2:]:
                print(f"  last recovery: {line.strip()[:300]}")
            return kills, list(ck.violations), len(ck.accepted)
    finally:
        for r in relays:
            r.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--kvrelayctl", required=True)
    ap.add_argument("--iterations", type=int, default=70, help="kills of the single relay")
    ap.add_argument("--mesh-iterations", type=int, default=30, help="kills of the sender's relay in the mesh")
    ap.add_argument("--point-runs", type=int, default=1, help="runs of each named crash point")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--keep", action="store_true", help="keep the spools and logs")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    print(f"seed {seed}", flush=True)
    rng = random.Random(seed)
    budget = 600 + 10 * (args.iterations + args.mesh_iterations) + 60 * args.point_runs * 5
    watchdog = threading.Timer(budget, lambda: (print(f"watchdog: over {budget} s", flush=True),
                                                tl.kill_started(), os._exit(3)))
    watchdog.daemon = True
    watchdog.start()
    total, failed = 0, []
    runs = []
    # Rounds of at most ROUND kills, each on fresh spools checked whole at its
    # end: a session holds at most 1024 messages (--max-session-messages).
    for mode, n in (("single", args.iterations), ("mesh", args.mesh_iterations)):
        for start in range(0, n, ROUND):
            runs.append((mode, min(ROUND, n - start), ()))
    if args.point_runs:
        runs.append(("single", 0, tuple(SPOOL_POINTS * args.point_runs)))
        runs.append(("mesh", 0, tuple(MESH_POINTS * args.point_runs)))
    accepted = 0
    for mode, n, points in runs:
        kills, violations, acc = run_loop(args, mode, n, rng, points)
        total += kills
        accepted += acc
        failed += violations
        print(f"  so far: {total} kills, {accepted} publishes accepted, {len(failed)} violations", flush=True)
    print(f"crash tests: {total} kills in all, {accepted} publishes accepted, {len(failed)} violations "
          f"(lost {sum('not fetchable' in v for v in failed)}, duplicated {sum('two contents' in v for v in failed)}, "
          f"acked-but-redelivered {sum('delivered again' in v for v in failed)}; seed {seed})")
    for v in failed[:20]:
        print(f"  {v}")
    tl.kill_started()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Overload: 64 concurrent publishers on 8 sessions against a relay whose
limits are set low.

The relay must answer RESOURCE_EXHAUSTED (and nothing worse: no other
error, no crash), keep its RSS below its configured limits plus a stated
overhead while it is under load, and lose no message it accepted: every
publish that returned OK is fetched, whole, by its recipient afterwards,
and none that failed is. Prints the figures (publishes accepted and
refused, peak RSS against the bound).
"""
import argparse
import os
import shutil
import tempfile
import sys
import threading
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "testlib"))
import kvrelay_testlib as tl  # noqa: E402
from kvrelay_testlib import Server  # noqa: E402

import grpc  # noqa: E402

import kvrelay  # noqa: E402

ARGS = None
MIB = 1 << 20
PUBLISHERS, SESSIONS, ROUNDS = 64, 8, 3
# The relay's limits: what may be in flight and what it may retain.
INFLIGHT, STORE = 48 * MIB, 96 * MIB
# What the relay may hold beyond them: the process at rest (code, gRPC, the
# worker pool), gRPC's per-call buffers of 64 streams, and freed heap kept
# for reuse (--heap-retain-bytes 16MiB per arena).
OVERHEAD = 64 * MIB


class OverloadTest(unittest.TestCase):
    def test_sixty_four_publishers_against_low_limits(self):
        work = tempfile.mkdtemp(prefix="kvrelay-overload-")
        args = ["--listen", "127.0.0.1:0", "--metrics-listen", "off", "--worker-threads", "2",
                "--max-inflight-bytes", str(INFLIGHT), "--max-store-bytes", str(STORE),
                "--max-session-bytes", str(STORE // 4), "--max-mailbox-bytes", str(STORE // 8),
                "--heap-retain-bytes", str(16 * MIB), "--upload-idle-timeout-seconds", "30"]
        self.addCleanup(shutil.rmtree, work, True)
        with Server(ARGS.server, work, args=args, name="overload") as relay:
            pid = relay.proc.pid
            rest = tl.rss_bytes(pid)
            # 4 x 2 x 4 x 528 x 64 float32 (~4.3 MB) each, shared: the client side stays small
            turns = [tl.random_turn(i) for i in range(4)]
            accepted, refused, other = [], [], []
            lock = threading.Lock()
            peak = [rest]
            done = threading.Event()

            def sample():
                while not done.is_set():
                    peak[0] = max(peak[0], tl.rss_bytes(pid))
                    time.sleep(0.02)

            def publisher(i):
                sess = f"s{i % SESSIONS}"
                c = kvrelay.Client(relay.addr)
                try:
                    for r in range(ROUNDS):
                        mid = f"p{i}-r{r}"
                        try:
                            c.publish(turns[(i + r) % len(turns)], sess, f"pub{i}", [f"sink{i % SESSIONS}"],
                                      message_id=mid, policy="h2o-head:k=32", retries=0, timeout=120)
                            with lock:
                                accepted.append((sess, mid))
                        except grpc.RpcError as e:
                            with lock:
                                (refused if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else other).append(
                                    (sess, mid, e.code().name, e.details()))
                finally:
                    c.close()

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            t0 = time.time()
            threads = [threading.Thread(target=publisher, args=(i,)) for i in range(PUBLISHERS)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(300)
            elapsed = time.time() - t0
            done.set()
            sampler.join(5)
            self.assertFalse(any(t.is_alive() for t in threads), "publishers finished within 300 s")
            self.assertIsNone(relay.proc.poll(), "the relay is still running")
            bound = rest + INFLIGHT + STORE + OVERHEAD
            print(f"overload: {PUBLISHERS} publishers x {ROUNDS} on {SESSIONS} sessions in {elapsed:.1f} s: "
                  f"{len(accepted)} accepted, {len(refused)} RESOURCE_EXHAUSTED, {len(other)} other; "
                  f"RSS at rest {rest / MIB:.0f} MiB, peak {peak[0] / MIB:.0f} MiB, bound {bound / MIB:.0f} MiB "
                  f"(rest + inflight {INFLIGHT // MIB} + store {STORE // MIB} + overhead {OVERHEAD // MIB})",
                  flush=True)
            self.assertEqual(other, [], "only RESOURCE_EXHAUSTED under overload")
            self.assertGreater(len(refused), 0, "the limits were reached")
            self.assertGreater(len(accepted), 0, "some publishes got through")
            self.assertLess(peak[0], bound, "RSS stays below the limits plus the overhead")
            for _, _, code, details in refused[:3]:
                self.assertRegex(details, r"--max-|limit", "a refusal names the limit")

            # Nothing accepted is lost, and nothing refused appears.
            want = {}
            for sess, mid in accepted:
                want.setdefault(sess, set()).add(mid)
            refused_ids = {mid for _, mid, _, _ in refused}
            with kvrelay.Client(relay.addr) as c:
                for s in range(SESSIONS):
                    sess, got = f"s{s}", set()
                    while True:
                        try:
                            m = c.fetch(sess, f"sink{s}", timeout=1.0)
                        except grpc.RpcError as e:
                            self.assertEqual(e.code(), grpc.StatusCode.DEADLINE_EXCEEDED, e.details())
                            break
                        self.assertNotIn(m.message_id, got, "each message once")
                        got.add(m.message_id)
                        self.assertEqual(len(m.layers), 4)
                        c.ack(sess, f"sink{s}", m.message_id)
                    self.assertEqual(got, want.get(sess, set()), f"session {sess}: every accepted message")
                    self.assertFalse(got & refused_ids, f"session {sess}: no refused message")
                stats = c.stats()
            self.assertEqual(stats.messages_committed, len(accepted))
            self.assertEqual(stats.inflight_bytes, 0)


def main():
    global ARGS
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ARGS, rest = ap.parse_known_args()
    return tl.unittest_main(rest, watchdog_s=500)


if __name__ == "__main__":
    sys.exit(main())

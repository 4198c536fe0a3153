#!/usr/bin/env python3
"""The spool under real I/O faults: kvrelay-server --spool-dir runs under
libfiu's POSIX preload (fiu-run -x), and fiu-ctrl turns faults on and off
while it runs (libfiu fault points, as the relay's calls meet them):

  posix/io/rw/write,failinfo=28      write(2) fails with ENOSPC
  posix/io/rw/write,failinfo=5       write(2) fails with EIO
  posix/io/sync/fdatasync,failinfo=5 fdatasync(2) fails with EIO
  posix/io/rw/write/reduce           write(2) writes fewer bytes than asked

Checked, per server/store/spool_store.h: ENOSPC while a publish writes its message
file is RESOURCE_EXHAUSTED, EIO there is UNAVAILABLE; either way nothing is
visible, no temporary file is left, and the relay goes on serving. EIO on
the journal's fdatasync fails that call (an ack: the journal is the only
file it syncs) with UNAVAILABLE, turns health NOT_SERVING and
kvrelay_spool_failed to 1, and every later write is refused, also once the
fault is gone. Short writes are continued: publishes succeed and are intact.
A short write followed by a failure (which libfiu cannot sequence) comes
from RLIMIT_FSIZE: the kernel writes up to the limit, then EFBIG. After each
case a restart without faults serves every publish that returned OK, intact,
and nothing else.

Exit 77 (skipped) when fiu-run or fiu-ctrl is missing
(scripts/install_deps.sh installs fiu-utils).
"""
import argparse
import zlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "testlib"))
import kvrelay_testlib as tl  # noqa: E402
from kvrelay_testlib import Server  # noqa: E402

ARGS = None
FIU_RUN, FIU_CTRL = shutil.which("fiu-run"), shutil.which("fiu-ctrl")
if not (FIU_RUN and FIU_CTRL):
    print("SKIP: fiu-run/fiu-ctrl not found (apt-get install fiu-utils)", flush=True)
    sys.exit(77)

import grpc  # noqa: E402
import numpy as np  # noqa: E402

import kvrelay  # noqa: E402

ENOSPC, EIO = 28, 5
FSIZE_LIMIT = 256 << 10  # RLIMIT_FSIZE of the short-write-then-EFBIG case



def intact(turn, m):
    """Whether fetched message `m` holds `turn`'s K/V bit for bit (policy full)."""
    if len(m.layers) != len(turn.layers):
        return False
    for tl_, ml in zip(turn.layers, m.layers):
        for mine, parts in ((ml.k, (tl_.prompt_k, tl_.gen_k)), (ml.v, (tl_.prompt_v, tl_.gen_v))):
            want = np.concatenate(parts, axis=1)
            if mine.shape != want.shape or not np.array_equal(mine.view(np.uint32), want.view(np.uint32)):
                return False
    return True


def spool_failed(relay):
    """kvrelay_spool_failed from /metrics."""
    import urllib.request
    with urllib.request.urlopen(f"http://{relay.metrics}/metrics", timeout=10) as r:
        samples = tl.parse_exposition(r.read().decode())
    return samples.get(("kvrelay_spool_failed", frozenset()))


def make_turn(seed, n_prompt=64):
    """F32 K/V of `seed`: 2 layers x [2, n_prompt + 4, 64] (n_prompt 64: ~140 KB)."""
    return tl.random_turn(seed, layers=2, H=2, S=2, d=64, n_prompt=n_prompt, n_gen=4)


class SpoolFiuTest(unittest.TestCase):
    def setUp(self):
        self.work = tempfile.mkdtemp(prefix="kvrelay-spool-fiu-")
        self.addCleanup(shutil.rmtree, self.work, True)
        self.spool = os.path.join(self.work, "spool")
        self.ctl = os.path.join(self.work, "fiu")
        self.relays = []
        self.addCleanup(self.stop_all)
        self.turns = {}

    def stop_all(self):
        for r in self.relays:
            r.stop(timeout=10)

    def start(self, fiu=True, wrap=(), name="relay"):
        args = ["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", "--worker-threads", "2",
                "--spool-dir", self.spool, "--fsync", "always"]
        cmd = list(wrap) + ([FIU_RUN, "-x", "-f", self.ctl] if fiu else []) + [ARGS.server]
        relay = Server(cmd[0], self.work, args=cmd[1:] + args, name=f"{name}{len(self.relays)}")
        self.relays.append(relay)
        return relay

    def restart(self, relay, **kw):
        self.assertEqual(relay.stop(timeout=20), 0, "the relay stops on SIGTERM")
        return self.start(**kw)

    def fiu(self, relay, command):
        """One fiu-ctrl command to the relay; fails the test when libfiu refuses it."""
        r = subprocess.run([FIU_CTRL, "-f", self.ctl, "-c", command, str(relay.proc.pid)],
                           capture_output=True, text=True, timeout=20)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertNotIn("error", r.stdout + r.stderr, f"fiu-ctrl -c '{command}'")

    def publish(self, c, mid, seed=None, session="s"):
        turn = self.turns.setdefault(mid, make_turn(seed if seed is not None else zlib.crc32(mid.encode())))
        return c.publish(turn, session, "a", ["b"], message_id=mid, policy="full", retries=0, timeout=60)

    def publish_fails(self, c, mid, code):
        with self.assertRaises(grpc.RpcError) as e:
            self.publish(c, mid)
        self.assertEqual(e.exception.code(), code, e.exception.details())
        return e.exception.details()

    def drain(self, c, session="s", agent="b", ack=True, limit=20):
        """The ids fetched (each checked intact), in order, until none comes within 1 s."""
        got = []
        for _ in range(limit):
            try:
                m = c.fetch(session, agent, timeout=1.0)
            except grpc.RpcError as e:
                self.assertEqual(e.code(), grpc.StatusCode.DEADLINE_EXCEEDED, e.details())
                return got
            self.assertIn(m.message_id, self.turns, "a message this test published")
            self.assertTrue(intact(self.turns[m.message_id], m), f"{m.message_id} intact")
            got.append(m.message_id)
            if not ack:
                return got
            c.ack(session, agent, m.message_id)
        self.fail(f"more than {limit} messages")

    def leftovers(self):
        """Temporary message files and quarantined files in the spool."""
        names = [f"msg/{n}" for n in os.listdir(os.path.join(self.spool, "msg")) if n.endswith(".tmp")]
        qdir = os.path.join(self.spool, "quarantine")
        return names + [f"quarantine/{n}" for n in (os.listdir(qdir) if os.path.isdir(qdir) else [])]

    def wait_health(self, c, want, seconds=10):
        deadline, h = time.monotonic() + seconds, None
        while time.monotonic() < deadline:
            h = c.health()
            if h == want:
                return h
            time.sleep(0.05)
        return h

    def assert_still_serving(self, relay, c):
        self.assertEqual(c.health(), "SERVING")
        self.assertEqual(spool_failed(relay), 0.0)

    # ---- message files: refused, nothing visible, the relay serves on ----

    def check_message_file_fault(self, point, errno_, code):
        relay = self.start()
        with kvrelay.Client(relay.addr) as c:
            self.publish(c, "m0")
            self.fiu(relay, f"enable name={point},failinfo={errno_}")
            details = self.publish_fails(c, "m1", code)
            self.publish_fails(c, "m2", code)
            self.fiu(relay, f"disable name={point}")
            self.assertIn("nothing was stored", details)
            self.assertEqual(self.leftovers(), [])
            self.assert_still_serving(relay, c)
            self.assertEqual(self.drain(c), ["m0"], "m1 and m2 are not visible")
            self.publish(c, "m1")  # the retry: no trace of the failed attempt
            self.publish(c, "m3")
            self.assertEqual(self.drain(c, ack=False), ["m1"])
        relay = self.restart(relay, fiu=False)
        with kvrelay.Client(relay.addr) as c:
            self.assertEqual(c.health(), "SERVING")
            self.assertEqual(self.drain(c), ["m1", "m3"], "after a restart: what returned OK, unacked")
        self.assertEqual(self.leftovers(), [])

    def test_enospc_writing_a_message_file_is_resource_exhausted(self):
        self.check_message_file_fault("posix/io/rw/write", ENOSPC, grpc.StatusCode.RESOURCE_EXHAUSTED)

    def test_eio_writing_a_message_file_is_unavailable(self):
        self.check_message_file_fault("posix/io/rw/write", EIO, grpc.StatusCode.UNAVAILABLE)

    def test_eio_syncing_a_message_file_is_unavailable(self):
        # A publish syncs its message file before anything reaches the journal.
        self.check_message_file_fault("posix/io/sync/fdatasync", EIO, grpc.StatusCode.UNAVAILABLE)

    # ---- the journal: fatal until a restart ----

    def test_eio_syncing_the_journal_stops_the_spool(self):
        relay = self.start()
        with kvrelay.Client(relay.addr) as c:
            for mid in ("m0", "m1", "m2"):
                self.publish(c, mid)
            self.assertEqual(self.drain(c, ack=False), ["m0"])
            time.sleep(0.5)  # the delivery's journal batch (not waited for) is written
            self.fiu(relay, f"enable name=posix/io/sync/fdatasync,failinfo={EIO}")
            with self.assertRaises(grpc.RpcError) as e:
                c.ack("s", "b", "m0")  # the ack syncs the journal only
            self.assertEqual(e.exception.code(), grpc.StatusCode.UNAVAILABLE, e.exception.details())
            self.assertEqual(self.wait_health(c, "NOT_SERVING"), "NOT_SERVING")
            details = self.publish_fails(c, "m3", grpc.StatusCode.UNAVAILABLE)
            self.fiu(relay, "disable name=posix/io/sync/fdatasync")
            # The fault is gone; the spool still takes nothing until a restart.
            self.assertIn("restart", details)
            self.publish_fails(c, "m4", grpc.StatusCode.UNAVAILABLE)
            with self.assertRaises(grpc.RpcError) as e:
                c.ack("s", "b", "m0")
            self.assertEqual(e.exception.code(), grpc.StatusCode.UNAVAILABLE, e.exception.details())
            self.assertEqual(c.health(), "NOT_SERVING")
            self.assertEqual(spool_failed(relay), 1.0)
        relay = self.restart(relay, fiu=False)
        with kvrelay.Client(relay.addr) as c:
            self.assertEqual(c.health(), "SERVING")
            self.assertEqual(spool_failed(relay), 0.0)
            got = self.drain(c)
            # m0's ack failed: it may or may not have taken effect.
            self.assertIn(got, (["m0", "m1", "m2"], ["m1", "m2"]), "every OK publish, and nothing refused")
            self.publish(c, "m5")
            self.assertEqual(self.drain(c), ["m5"], "the restarted spool takes writes")
        self.assertEqual(self.leftovers(), [])

    # ---- short writes ----

    def test_short_writes_are_continued(self):
        relay = self.start()
        with kvrelay.Client(relay.addr) as c:
            self.fiu(relay, "enable name=posix/io/rw/write/reduce")
            for mid in ("m0", "m1", "m2"):
                self.publish(c, mid)
            self.assertEqual(self.drain(c, ack=False), ["m0"])
            self.fiu(relay, "disable name=posix/io/rw/write/reduce")
            self.assert_still_serving(relay, c)
        relay = self.restart(relay, fiu=False)
        with kvrelay.Client(relay.addr) as c:
            self.assertEqual(self.drain(c), ["m0", "m1", "m2"])
        self.assertEqual(self.leftovers(), [])

    def test_a_short_write_then_efbig_leaves_nothing(self):
        # RLIMIT_FSIZE: a write across the limit is cut short at it, the next
        # fails with EFBIG (SIGXFSZ ignored, so that the relay lives on).
        wrap = [sys.executable, "-c",
                "import os, resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
                f"resource.setrlimit(resource.RLIMIT_FSIZE, ({FSIZE_LIMIT}, {FSIZE_LIMIT})); "
                "os.execv(sys.argv[1], sys.argv[1:])"]
        relay = self.start(fiu=False, wrap=wrap)
        with kvrelay.Client(relay.addr) as c:
            self.publish(c, "m0")  # ~140 KB: under the limit
            big = make_turn(7, n_prompt=256)  # ~530 KB
            self.turns["big"] = big
            with self.assertRaises(grpc.RpcError) as e:
                c.publish(big, "s", "a", ["b"], message_id="big", policy="full", retries=0, timeout=60)
            self.assertEqual(e.exception.code(), grpc.StatusCode.UNAVAILABLE, e.exception.details())
            self.assertIn("File too large", e.exception.details())
            self.assertEqual(self.leftovers(), [])
            self.assert_still_serving(relay, c)
            self.publish(c, "m1")
            self.assertEqual(self.drain(c), ["m0", "m1"], "the big message is not visible")
        relay = self.restart(relay, fiu=False)
        with kvrelay.Client(relay.addr) as c:
            self.assertEqual(self.drain(c), [], "all acked; nothing else")


def main():
    global ARGS
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ARGS, rest = ap.parse_known_args()
    return tl.unittest_main(rest, watchdog_s=500)


if __name__ == "__main__":
    sys.exit(main())

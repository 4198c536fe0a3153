#!/usr/bin/env python3
"""Three relays on three test hosts (network namespaces joined by veth links).

  - a chain planner (host a) -> critic (host b) -> refiner (host c) with
    parents, each agent talking to its own relay on its host's loopback (a
    plaintext --local-listen), every forward between hosts over mTLS;
  - a link cut (ip link set down) in the middle of a forward, for longer than
    --forward-stall-seconds, then restored: the message is delivered exactly
    once, nothing partial is visible at the destination in between, and a
    retry really happened.

Needs root (ip netns); prints SKIPPED and why otherwise, and exits 77.
The namespaces are removed at the end, also after a failure.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "testlib"))
import kvrelay_testlib as tl  # noqa: E402
import netns  # noqa: E402
from certs import TestPki  # noqa: E402
from kvrelay_testlib import FAILURES, Server, check, read_st  # noqa: E402

SKIP = 77
PORT = 50051


class HostCtl(tl.Ctl):
    """kvrelayctl run inside a host's namespace, against that host's relay."""

    def __init__(self, binary, workdir, hosts, host):
        super().__init__(binary, workdir, addr=f"127.0.0.1:{PORT}")
        self.hosts, self.host = hosts, host

    def run(self, *args, addr=True, timeout=120):
        cmd = self.hosts.cmd(self.host, [self.binary, *args])
        target = self.addr if addr is True else addr
        if target:
            cmd += ["--addr", target]
        return tl.run(cmd, timeout=timeout)


def stats(ctl):
    rc, out, _ = ctl.run("stats")
    return dict(re.findall(r"^(\w+): (\S+)$", out, re.M))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--kvrelayctl", required=True)
    args = ap.parse_args()
    ok, why = netns.available()
    if not ok:
        print(f"SKIPPED: {why}")
        return SKIP
    work = tempfile.mkdtemp(prefix="kvrelay_netns_")
    names = ["a", "b", "c"]
    agents = {"planner": "a", "critic": "b", "refiner": "c"}
    with netns.Hosts(names, prefix="kvrt") as hosts:
        routes = os.path.join(work, "routes.json")
        with open(routes, "w") as f:
            f.write("{" + ",".join(f'"{a}": "{hosts.addr(h)}:{PORT}"' for a, h in agents.items()) + "}")
        # Relays reach each other over mTLS on the host's address; agents
        # reach their own relay on a plaintext loopback local listener.
        pki = TestPki(os.path.join(work, "pki"))
        ca = pki.ca("mesh-ca")
        certs = {h: pki.issue(ca, f"relay-{h}", dns=[f"relay-{h}.mesh.test"], ips=[hosts.addr(h)]) for h in names}
        relays = {}
        try:
            for h in names:
                relays[h] = Server(
                    "ip", work, name=f"relay-{h}",
                    args=["netns", "exec", hosts.ns(h), args.server, "--listen", f"{hosts.addr(h)}:{PORT}",
                          "--local-listen", f"127.0.0.1:{PORT}", "--tls-cert", certs[h].cert, "--tls-key",
                          certs[h].key, "--tls-client-ca", ca.cert, "--peer-identity", "*.mesh.test",
                          "--metrics-listen", "off", "--advertise", f"{hosts.addr(h)}:{PORT}",
                          "--route-file", routes, "--forward-stall-seconds", "2", "--forward-timeout-seconds",
                          "120"])
            ctl = {h: HostCtl(args.kvrelayctl, work, hosts, h) for h in names}
            geo = ["--layers", "3", "--kv-heads", "2", "--score-heads", "4", "--head-dim", "64", "--prompt", "96",
                   "--gen", "8"]
            turns = []
            for i in range(2):
                t = os.path.join(work, f"t{i}.st")
                ctl["a"].ok("make-turn", "--out", t, "--seed", str(i + 1), "--first-agent",
                            "true" if i == 0 else "false", *geo, addr=False)
                turns.append(t)

            # A chain across the hosts.
            r1 = ctl["a"].ok("publish", "--session", "ns", "--from", "planner", "--to", "critic", "--policy",
                             "h2o-head:k=16", "--in", turns[0])
            f1 = ctl["b"].ok("fetch", "--session", "ns", "--agent", "critic", "--out", os.path.join(work, "m1.st"),
                             "--wait", "20")
            check(f1.get("message_id") == r1.get("message_id"), f"chain: hop 1 across hosts ({f1})")
            r2 = ctl["b"].ok("publish", "--session", "ns", "--from", "critic", "--to", "refiner", "--policy",
                             "h2o-head:k=16", "--parent", r1.get("message_id", "x"), "--in", turns[1])
            f2 = ctl["c"].ok("fetch", "--session", "ns", "--agent", "refiner", "--out", os.path.join(work, "m2.st"),
                             "--wait", "20")
            check(f2.get("message_id") == r2.get("message_id") and f2.get("parent") == r1.get("message_id"),
                  f"chain: hop 2 across hosts with its parent ({f2})")
            m1, _ = read_st(os.path.join(work, "m1.st"))
            m2, _ = read_st(os.path.join(work, "m2.st"))
            n1 = sum(int(m1[k]) for k in ("n_history", "n_anchor", "n_kept", "n_gen"))
            check(int(m2.get("n_history", -1)) == n1, f"chain: the second message's history is the first ({n1})")
            print(f"chain across hosts: {'ok' if not FAILURES else 'FAILED'}", flush=True)

            # A link cut in the middle of a forward: shape a's link so that the
            # forward of a ~12 MB `full` message takes several seconds.
            before = len(FAILURES)
            big = os.path.join(work, "big.st")
            ctl["a"].ok("make-turn", "--out", big, "--seed", "9", "--layers", "8", "--kv-heads", "4",
                        "--head-dim", "128", "--prompt", "1024", "--gen", "16", addr=False)
            hosts.shape("a", "20mbit")
            r = ctl["a"].ok("publish", "--session", "cut", "--from", "planner", "--to", "critic", "--policy", "full",
                            "--in", big)
            mid = r.get("message_id", "x")
            time.sleep(1.0)
            hosts.link_down("a")
            partial = []
            t_end = time.time() + 4.5  # > 2 s stall
            while time.time() < t_end:
                s = stats(ctl["b"])
                partial.append(int(s.get("mailbox_messages", 0)))
                time.sleep(0.5)
            hosts.link_up("a")
            hosts.shape("a", "1gbit")
            check(all(p == 0 for p in partial), f"cut: nothing visible at the destination during the cut ({partial})")
            got = ctl["b"].ok("fetch", "--session", "cut", "--agent", "critic", "--out", os.path.join(work, "cut.st"),
                              "--wait", "60", timeout=90)
            check(got.get("message_id") == mid, f"cut: delivered after the link came back ({got})")
            rc, _, err = ctl["b"].run("fetch", "--session", "cut", "--agent", "critic", "--out",
                                      os.path.join(work, "cut2.st"), "--wait", "2")
            check(rc == 1 and "DEADLINE_EXCEEDED" in err, f"cut: delivered exactly once ({rc} {err.strip()})")
            rc, out, err = ctl["a"].run("status", "--session", "cut", "--id", mid)
            attempts = re.search(r"attempts=(\d+)", out)
            check(rc == 0 and attempts and int(attempts.group(1)) >= 2,
                  f"cut: the forward was retried ({out.strip()} {err.strip()})")
            print(f"link cut: {'ok' if len(FAILURES) == before else 'FAILED'}", flush=True)
        finally:
            for r in relays.values():
                r.stop()
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    check("kvrt-" not in left, f"namespaces removed ({left.strip()})")
    if FAILURES:
        print(f"{len(FAILURES)} failure(s); logs in {work}")
        return 1
    shutil.rmtree(work, ignore_errors=True)
    print("all netns mesh checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())

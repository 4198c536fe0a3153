#!/usr/bin/env python3
"""Relay CPU per forward with --wire-codec rans against none.

Two kvrelay-server processes on loopback, A (the sender's relay, with the
--wire-codec given) and B (the recipient's). Each round publishes one turn
from planner on A to critic on B, fetches it on B, and reads the CPU seconds
(utime + stime, /proc/PID/stat) both relays spent on it. Rounds alternate
between a rans pair and a none pair of relays, so a busy spell of a shared
machine moves both alike; the figure is the median over rounds of
(CPU of A + B with rans) / (CPU of A + B with none), next to the bytes on the
wire (kvrelay_wire_bytes_total) of each.

The publish's compression runs on A in both and is counted in both: the
ratio is of the relays' whole CPU per forwarded message.

  .venv/bin/python bench/wire_codec_relay_cpu.py --server build/bin/kvrelay-server \\
      --kvrelayctl build/bin/kvrelayctl [--rounds 7] [--policy h2o-head:k=32+int4]

Not part of the tests.
"""
import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "testlib"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "server"))
from kvrelay_testlib import Ctl  # noqa: E402
from test_mesh import Mesh, fetch, metric, metrics  # noqa: E402


def cpu_seconds(server):
    with open(f"/proc/{server.proc.pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--kvrelayctl", required=True)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--policy", action="append")
    ap.add_argument("--messages", type=int, default=4, help="forwards per round")
    args = ap.parse_args()
    policies = args.policy or ["h2o-head:k=32+int4", "h2o-head:k=32"]
    work = tempfile.mkdtemp(prefix="kvrelay_wire_cpu_")
    ctl = Ctl(args.kvrelayctl, work)
    turn = ctl.path("turn.st")
    # One Qwen3-14B-like turn, 8 layers of it to keep rounds short.
    ctl.ok("make-turn", "--out", turn, "--seed", "14", "--layers", "8", "--kv-heads", "8", "--score-heads", "40",
           "--head-dim", "128", "--prompt", "512", "--gen", "40", "--dtype", "BF16", addr=False)
    print(f"load average before: {os.getloadavg()}")
    meshes = {}
    for codec in ("rans", "none"):
        os.makedirs(os.path.join(work, codec))
        m = Mesh(args.server, os.path.join(work, codec), ["A", "B"], extra={"A": ["--wire-codec", codec]})
        m.write_routes({"planner": "A", "critic": "B"})
        m.start("A")
        m.start("B")
        meshes[codec] = m
    try:
        for policy in policies:
            ratios, wire = [], {}
            n = 0
            for r in range(args.rounds):
                cpu = {}
                for codec in (("rans", "none") if r % 2 == 0 else ("none", "rans")):
                    m = meshes[codec]
                    a, b = m.relays["A"], m.relays["B"]
                    w0 = metric(metrics(a), "kvrelay_wire_bytes_total")
                    c0 = cpu_seconds(a) + cpu_seconds(b)
                    for _ in range(args.messages):
                        n += 1
                        session = f"s{n}"
                        ctl.ok("publish", "--session", session, "--from", "planner", "--to", "critic", "--policy",
                               policy, "--in", turn, addr=a.addr)
                        fetch(ctl, b, session, "critic", ctl.path("out.st"))
                    cpu[codec] = (cpu_seconds(a) + cpu_seconds(b) - c0) / args.messages
                    wire[codec] = (metric(metrics(a), "kvrelay_wire_bytes_total") - w0) / args.messages
                ratios.append(cpu["rans"] / cpu["none"] if cpu["none"] else float("nan"))
                print(f"{policy} round {r}: CPU per forward rans {cpu['rans'] * 1e3:.1f} ms, none "
                      f"{cpu['none'] * 1e3:.1f} ms", flush=True)
            print(f"{policy}: median CPU rans/none = {statistics.median(ratios):.3f} over {args.rounds} rounds; "
                  f"wire bytes per forward rans {wire['rans']:.0f}, none {wire['none']:.0f} "
                  f"({wire['rans'] / wire['none']:.3f})", flush=True)
    finally:
        for m in meshes.values():
            m.stop_all()
    print(f"load average after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

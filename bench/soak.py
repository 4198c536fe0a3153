#!/usr/bin/env python3
"""Soak with the spool: chain traffic through two relays for --minutes, with
each relay's RSS, open file descriptors and spool bytes sampled over time.

Relay A holds the mailboxes of planner and refiner, relay B those of critic
and judger, each with its own --spool-dir (in a temporary folder) and
--fsync always, so the LatentMAS chain planner -> critic -> refiner -> judger
crosses relays at every hop. A few client threads run chains, each in a
session of its own:

    planner publishes turn 0 to critic             (A, forwarded to B)
    critic fetches it from B, acks, publishes turn 1 with parent_id to refiner
                                                    (B, forwarded to A)
    refiner fetches it from A, acks, publishes turn 2 with parent_id to judger
                                                    (A, forwarded to B)
    judger fetches it from B and acks
    the session is closed at B (the close goes on to A), so both spools free
    its message files; every --expire-every-th chain is left open instead and
    expires after --session-ttl-seconds.

Every --interval seconds it samples, per relay: VmRSS (/proc/PID/status),
open descriptors (/proc/PID/fd), the spool folder's bytes (apparent sizes,
split into message files and journal, and the blocks du counts), the relay's
kvrelay_spool_bytes, kvrelay_store_bytes and its sessions (Stats), and the
chains completed. At the end it judges "flat once warm": the median of the
middle third of the samples against the median of the last third, per relay:

    RSS          growth <= --rss-tol (10%)
    descriptors  growth <= --fd-tol (5)
    spool bytes  growth <= --spool-tol (20%) or <= --spool-floor-mib (8 MiB)

prints a table and the verdict, writes the samples to --json and plots them
to --png (matplotlib: RSS, descriptors, spool bytes, chains/s over time).
Exit 0 when flat, 1 when not, 2 for a run that broke (a relay died, no chain
completed, too many errors).

    .venv/bin/python bench/soak.py [--build build] [--minutes 10] [--interval 5]
        [--threads 3] [--policy SPEC] [--session-ttl-seconds 20] [--expire-every 8]
        [--json docs/soak_spool.json] [--png docs/soak_spool.png] [--keep]
    .venv/bin/python bench/soak.py --plot-only docs/soak_spool.json   # redraw the PNG

Traffic goes to 127.0.0.1 only. Every loop is bounded in time and count, a
watchdog ends everything past --minutes + 5 min, and the relays are stopped
(SIGTERM, then SIGKILL) and the temporary folder removed on every exit path.
"""
import argparse
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "testlib"))
import kvrelay_testlib as tl  # noqa: E402

MIB = 1 << 20
AGENTS = {"A": ("planner", "refiner"), "B": ("critic", "judger")}
CHAIN = ["planner", "critic", "refiner", "judger"]
HOME = {a: r for r, agents in AGENTS.items() for a in agents}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]



# ---- what is sampled -----------------------------------------------------------------


def open_fds(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def spool_usage(root):
    """{msg, journal, other: apparent bytes; files: message files; du: bytes of
    the blocks allocated (what du counts)}. Files may go while it walks."""
    out = {"msg": 0, "journal": 0, "other": 0, "files": 0, "du": 0}
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        for name in filenames:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
            out["du"] += st.st_blocks * 512
            if rel == "msg":
                out["msg"] += st.st_size
                out["files"] += 1
            elif rel == "." and name.startswith("journal"):
                out["journal"] += st.st_size
            else:
                out["other"] += st.st_size
    return out


def scrape(metrics_addr, names):
    """{name: value summed over labels} of the relay's /metrics."""
    text = urllib.request.urlopen(f"http://{metrics_addr}/metrics", timeout=5).read().decode()
    out = {n: 0.0 for n in names}
    for (name, _), v in tl.parse_exposition(text).items():
        if name in out:
            out[name] += v
    return out


METRICS = ["kvrelay_spool_bytes", "kvrelay_store_bytes", "kvrelay_mailbox_messages", "kvrelay_outbox_messages"]


# ---- the relays -------------------------------------------------------------------------

class Relay:
    def __init__(self, name, server_bin, work, port, peer_port, ttl, fsync, extra):
        self.name, self.port = name, port
        self.spool = os.path.join(work, f"spool-{name}")
        routes = []
        for agent, home in HOME.items():
            if home != name:
                routes += ["--route", f"{agent}=127.0.0.1:{peer_port}"]
        self.args = ["--listen", self.addr, "--advertise", self.addr, "--metrics-listen", "127.0.0.1:0",
                     "--spool-dir", self.spool, "--fsync", fsync, "--session-ttl-seconds", str(ttl),
                     "--forward-stall-seconds", "5", "--forward-timeout-seconds", "60", *routes, *extra]
        self.server = tl.Server(server_bin, work, args=self.args, name=f"relay-{name}", timeout=30)
        self.pid = self.server.proc.pid

    @property
    def addr(self):
        return f"127.0.0.1:{self.port}"

    def alive(self):
        return self.server.proc.poll() is None


# ---- traffic ----------------------------------------------------------------------------

class Traffic:
    def __init__(self, clients, turns, policy, expire_every, deadline, max_errors):
        self.clients, self.turns, self.policy = clients, turns, policy
        self.expire_every, self.deadline, self.max_errors = expire_every, deadline, max_errors
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.next_chain = 0
        self.completed = self.closed = self.left_to_expire = 0
        self.errors = {}
        self.error_samples = []
        self.latencies = []

    def error(self, where, e):
        code = e.code().name if hasattr(e, "code") and callable(e.code) and e.code() else type(e).__name__
        with self.lock:
            key = f"{where}:{code}"
            self.errors[key] = self.errors.get(key, 0) + 1
            if len(self.error_samples) < 20:
                details = e.details() if hasattr(e, "details") and callable(e.details) else str(e)
                self.error_samples.append(f"{key}: {details}")
            if sum(self.errors.values()) >= self.max_errors:
                self.stop.set()

    def chain(self, n):
        """One chain in session soak-<n>; True when the judger acked."""
        session = f"soak-{n}"
        parent = ""
        t0 = time.monotonic()
        for hop in range(3):
            src, dst = CHAIN[hop], CHAIN[hop + 1]
            turn = self.turns[(n + hop) % len(self.turns)]
            where = f"publish{hop}"
            try:
                r = self.clients[HOME[src]].publish(turn, session, src, [dst], message_id=f"c{n}-{hop}",
                                                    policy=self.policy, parent_id=parent, timeout=30, retries=2)
                where = f"fetch{hop}"
                m = self.clients[HOME[dst]].fetch(session, dst, timeout=30)
                if m.message_id != r.message_id:
                    raise RuntimeError(f"{dst} fetched {m.message_id}, expected {r.message_id}")
                where = f"ack{hop}"
                self.clients[HOME[dst]].ack(session, dst, m.message_id, timeout=10)
            except Exception as e:  # noqa: BLE001: counted, the chain abandoned, its session closed
                self.error(where, e)
                self.close(session)
                return False
            parent = m.message_id
        with self.lock:
            self.latencies.append(time.monotonic() - t0)
            self.completed += 1
        if self.expire_every and n % self.expire_every == 0:
            with self.lock:
                self.left_to_expire += 1
        else:
            self.close(session)
        return True

    def close(self, session):
        try:
            self.clients["B"].close_session(session, timeout=10)  # the judger's relay; passed on to A
            with self.lock:
                self.closed += 1
        except Exception as e:  # noqa: BLE001
            self.error("close", e)

    def worker(self):
        while not self.stop.is_set() and time.monotonic() < self.deadline:
            with self.lock:
                n = self.next_chain
                self.next_chain += 1
            self.chain(n)


# ---- judging and output -----------------------------------------------------------------

def judge(samples, args):
    """Per relay and metric: the medians of the middle and the last third, growth, verdict."""
    k = len(samples) // 3
    mid, last = samples[k:2 * k], samples[2 * k:]
    rows, flat = [], True
    for relay in ("A", "B"):
        for metric, key, tol in (("RSS", "rss", f"+{args.rss_tol:.0%}"),
                                 ("open fds", "fds", f"+{args.fd_tol}"),
                                 ("spool bytes", "spool", f"+{args.spool_tol:.0%} or +{args.spool_floor_mib} MiB")):
            first = samples[0][relay][key]
            m = statistics.median(s[relay][key] for s in mid)
            e = statistics.median(s[relay][key] for s in last)
            growth = e - m
            if key == "rss":
                ok = growth <= args.rss_tol * m
            elif key == "fds":
                ok = growth <= args.fd_tol
            else:
                ok = growth <= max(args.spool_tol * m, args.spool_floor_mib * MIB)
            # Slope over the warm two thirds (least squares), per minute.
            pts = [(s["t"], s[relay][key]) for s in samples[k:]]
            slope = 0.0
            if len(pts) >= 2:
                tm = statistics.fmean(p[0] for p in pts)
                vm = statistics.fmean(p[1] for p in pts)
                den = sum((p[0] - tm) ** 2 for p in pts)
                slope = 60 * sum((p[0] - tm) * (p[1] - vm) for p in pts) / den if den else 0.0
            rows.append({"relay": relay, "metric": metric, "key": key, "first": first, "mid_median": m,
                         "last_median": e, "max": max(s[relay][key] for s in samples), "growth": growth,
                         "growth_ratio": growth / m if m else 0.0, "slope_per_min": slope,
                         "tolerance": tol, "flat": ok})
            flat &= ok
    return rows, flat


def fmt(key, v):
    if key in ("rss", "spool"):
        return f"{v / MIB:.1f} MiB"
    return f"{v:.0f}"


def print_table(rows, flat):
    print(f"{'relay':5} {'metric':12} {'first':>11} {'mid third':>11} {'last third':>11} {'max':>11} "
          f"{'growth':>12} {'slope/min':>11}  {'tolerance':24} verdict")
    for r in rows:
        g = fmt(r["key"], r["growth"]) + (f" {r['growth_ratio']:+.0%}" if r["key"] != "fds" else "")
        print(f"{r['relay']:5} {r['metric']:12} {fmt(r['key'], r['first']):>11} {fmt(r['key'], r['mid_median']):>11} "
              f"{fmt(r['key'], r['last_median']):>11} {fmt(r['key'], r['max']):>11} {g:>12} "
              f"{fmt(r['key'], r['slope_per_min']):>11}  {r['tolerance']:24} {'flat' if r['flat'] else 'GROWS'}")
    print(f"verdict: {'FLAT' if flat else 'NOT FLAT'} once warm (median of the middle third vs the last third)")


def plot(path, samples, summary):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    t = [s["t"] / 60 for s in samples]
    fig, axes = plt.subplots(4, 1, figsize=(9, 11), sharex=True)
    colors = {"A": "tab:blue", "B": "tab:orange"}
    k = len(t) // 3
    warm, last = (t[k], t[2 * k]) if k else (0, 0)
    for relay in ("A", "B"):
        label = f"relay {relay} ({' + '.join(AGENTS[relay])})"
        axes[0].plot(t, [s[relay]["rss"] / MIB for s in samples], color=colors[relay], label=label)
        axes[1].plot(t, [s[relay]["fds"] for s in samples], color=colors[relay], label=label)
        axes[2].plot(t, [s[relay]["spool"] / MIB for s in samples], color=colors[relay],
                     label=f"{label}: folder")
        axes[2].plot(t, [s[relay]["spool_metric"] / MIB for s in samples], color=colors[relay], linestyle=":",
                     label=f"{label}: kvrelay_spool_bytes")
        axes[2].plot(t, [s[relay]["spool_journal"] / MIB for s in samples], color=colors[relay],
                     linestyle="--", alpha=0.6, label=f"{label}: of it the journal")
    axes[3].plot(t, [s["chains_per_s"] for s in samples], color="tab:green", label="chains/s (both relays)")
    axes[0].set_ylabel("RSS (MiB)")
    axes[1].set_ylabel("open fds")
    axes[2].set_ylabel("spool bytes (MiB)")
    axes[3].set_ylabel("chains/s")
    axes[3].set_xlabel("minutes")
    for ax in axes:
        ax.axvspan(0, warm, color="0.9", zorder=0)
        ax.axvline(last, color="0.6", linestyle="--", linewidth=0.8)
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
        ax.legend(loc="center right" if ax is axes[0] else "best", fontsize=7, ncol=2 if ax is axes[2] else 1)
    for x, what in ((warm / 2, "warm-up"), ((warm + last) / 2, "middle third"), ((last + t[-1]) / 2, "last third")):
        axes[0].text(x, 0.05, what, transform=axes[0].get_xaxis_transform(), ha="center", fontsize=8, color="0.4")
    fig.suptitle(f"kvrelay soak with the spool (--fsync always): {summary['minutes']:.1f} min, "
                 f"{summary['chains_completed']} chains, {summary['policy']}\n"
                 f"verdict: {'flat' if summary['flat'] else 'NOT flat'} once warm "
                 f"(middle third vs last third)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---- main -------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"), help="build folder (bin/, client/python/gen)")
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    ap.add_argument("--threads", type=int, default=3, help="client threads, one chain at a time each")
    ap.add_argument("--policy", default="h2o-head:k=32+obf:p=8,mode=fast")
    ap.add_argument("--fsync", default="always", choices=["always", "never"])
    ap.add_argument("--session-ttl-seconds", type=float, default=20.0)
    ap.add_argument("--expire-every", type=int, default=8,
                    help="every N-th chain's session is left to expire instead of closed (0: none)")
    ap.add_argument("--relay-arg", action="append", default=[], help="one more argument for both relays")
    ap.add_argument("--rss-tol", type=float, default=0.10)
    ap.add_argument("--fd-tol", type=int, default=5)
    ap.add_argument("--spool-tol", type=float, default=0.20)
    ap.add_argument("--spool-floor-mib", type=float, default=8.0)
    ap.add_argument("--max-errors", type=int, default=50, help="stop the traffic after this many errors")
    ap.add_argument("--json", default=os.path.join(ROOT, "docs", "soak_spool.json"))
    ap.add_argument("--png", default=os.path.join(ROOT, "docs", "soak_spool.png"))
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder (spools, relay logs)")
    ap.add_argument("--plot-only", metavar="JSON", help="only redraw --png (and judge again) from a saved JSON")
    args = ap.parse_args()
    if args.plot_only:
        with open(args.plot_only) as f:
            saved = json.load(f)
        rows, flat = judge(saved["samples"], args)
        print_table(rows, flat)
        plot(args.png, saved["samples"], saved["summary"] | {"flat": flat})
        print(f"wrote {args.png}")
        return 0 if flat else 1
    if args.minutes <= 0 or args.interval <= 0 or args.threads < 1:
        ap.error("--minutes, --interval and --threads must be positive")

    build = os.path.abspath(args.build)
    server_bin = os.path.join(build, "bin", "kvrelay-server")
    if not os.access(server_bin, os.X_OK):
        print(f"no {server_bin}: build first, or pass --build", file=sys.stderr)
        return 2
    sys.path.insert(0, os.path.join(build, "client", "python", "gen"))
    sys.path.insert(0, os.path.join(ROOT, "client", "python"))
    import kvrelay  # noqa: E402

    duration = args.minutes * 60
    budget = duration + 300
    watchdog = threading.Timer(budget, lambda: (print(f"watchdog: over {budget:.0f} s, ending", flush=True),
                                                tl.kill_started(), os._exit(3)))
    watchdog.daemon = True
    watchdog.start()

    def on_signal(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_signal)

    work = tempfile.mkdtemp(prefix="kvrelay-soak-")
    relays, clients, traffic, threads = {}, {}, None, []
    samples, status = [], 0
    try:
        pa, pb = free_port(), free_port()
        relays["A"] = Relay("A", server_bin, work, pa, pb, args.session_ttl_seconds, args.fsync, args.relay_arg)
        relays["B"] = Relay("B", server_bin, work, pb, pa, args.session_ttl_seconds, args.fsync, args.relay_arg)
        for name, r in relays.items():
            print(f"relay {name}: pid {r.pid}, {r.server.ready_line}", flush=True)
            clients[name] = kvrelay.Client(r.addr)
        turns = [tl.random_turn(i, n_prompt=256) for i in range(6)]  # 2.2 MB of K/V each
        t0 = time.monotonic()
        deadline = t0 + duration
        traffic = Traffic(clients, turns, args.policy, args.expire_every, deadline, args.max_errors)
        threads = [threading.Thread(target=traffic.worker, name=f"chain-{i}", daemon=True)
                   for i in range(args.threads)]
        for th in threads:
            th.start()

        prev_done, prev_t = 0, 0.0
        next_at = t0
        max_samples = int(duration / args.interval) + 2
        while len(samples) < max_samples:
            next_at += args.interval
            while time.monotonic() < min(next_at, deadline + args.interval) and not traffic.stop.is_set():
                time.sleep(min(0.2, max(0.0, next_at - time.monotonic())))
            now = time.monotonic() - t0
            s = {"t": round(now, 2)}
            for name, r in relays.items():
                if not r.alive():
                    raise RuntimeError(f"relay {name} exited with status {r.server.proc.returncode}; "
                                       f"log tail:\n{r.server.log()[-2000:]}")
                u = spool_usage(r.spool)
                m = scrape(r.server.metrics, METRICS)
                st = clients[name].stats(timeout=10)
                s[name] = {"rss": tl.rss_bytes(r.pid), "fds": open_fds(r.pid),
                           "spool": u["msg"] + u["journal"] + u["other"], "spool_msg": u["msg"],
                           "spool_journal": u["journal"], "spool_other": u["other"], "spool_files": u["files"],
                           "spool_du": u["du"], "spool_metric": m["kvrelay_spool_bytes"],
                           "store_bytes": m["kvrelay_store_bytes"], "mailbox_messages": m["kvrelay_mailbox_messages"],
                           "outbox_messages": m["kvrelay_outbox_messages"], "sessions": st.sessions}
            with traffic.lock:
                done, errors = traffic.completed, sum(traffic.errors.values())
            s["chains"] = done
            s["errors"] = errors
            s["chains_per_s"] = round((done - prev_done) / max(1e-9, now - prev_t), 3)
            prev_done, prev_t = done, now
            samples.append(s)
            print(f"t={now:6.0f}s chains={done:6d} ({s['chains_per_s']:5.1f}/s) errors={errors} | " + " | ".join(
                f"{n}: rss {s[n]['rss'] / MIB:6.1f} MiB fds {s[n]['fds']:3d} spool {s[n]['spool'] / MIB:6.1f} MiB "
                f"(msg {s[n]['spool_files']:3d} files {s[n]['spool_msg'] / MIB:5.1f}, journal "
                f"{s[n]['spool_journal'] / MIB:5.1f}) sessions {s[n]['sessions']}" for n in relays), flush=True)
            if now >= duration or traffic.stop.is_set():
                break
        traffic.stop.set()
        for th in threads:
            th.join(60)
        stuck = [th.name for th in threads if th.is_alive()]
        elapsed = time.monotonic() - t0

        rows, flat = judge(samples, args) if len(samples) >= 3 else ([], False)
        lat = sorted(traffic.latencies)
        summary = {
            "minutes": elapsed / 60, "chains_completed": traffic.completed, "chains_started": traffic.next_chain,
            "sessions_closed": traffic.closed, "sessions_left_to_expire": traffic.left_to_expire,
            "chains_per_s": traffic.completed / elapsed if elapsed else 0,
            "chain_latency_s": {"p50": lat[len(lat) // 2], "p99": lat[int(len(lat) * 0.99)]} if lat else {},
            "errors": traffic.errors, "error_samples": traffic.error_samples, "stuck_threads": stuck,
            "policy": args.policy, "flat": flat, "judgement": rows,
        }
        print(f"{elapsed / 60:.1f} min, {traffic.completed} chains completed ({summary['chains_per_s']:.1f}/s, "
              f"latency p50 {summary['chain_latency_s'].get('p50', 0) * 1e3:.0f} ms, "
              f"p99 {summary['chain_latency_s'].get('p99', 0) * 1e3:.0f} ms), {traffic.closed} sessions closed, "
              f"{traffic.left_to_expire} left to expire, errors {traffic.errors or 'none'}")
        for e in traffic.error_samples[:5]:
            print(f"  {e}")
        if rows:
            print_table(rows, flat)
        broken = traffic.completed == 0 or stuck or sum(traffic.errors.values()) >= args.max_errors
        status = 2 if broken else (0 if flat else 1)
        config = {k: v for k, v in vars(args).items() if k not in ("json", "png", "build")}
        config |= {"relay_args": {n: r.args for n, r in relays.items()}, "host": platform.node(),
                   "cpus": os.cpu_count(), "turn": "F32, 4 layers, 4 KV heads, 8 score heads, head_dim 64, "
                                                   "256 prompt + 16 generated tokens"}
        for name, r in relays.items():
            for line in r.server.log().splitlines():
                if "kvrelay-server ready" in line or "kernels=" in line:
                    config.setdefault("relay_lines", []).append(f"{name}: {line.strip()[:300]}")
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump({"config": config, "summary": summary, "samples": samples}, f, indent=1)
            print(f"wrote {args.json}")
        if args.png and samples:
            os.makedirs(os.path.dirname(os.path.abspath(args.png)), exist_ok=True)
            plot(args.png, samples, summary)
            print(f"wrote {args.png}")
        if broken:
            print("the run broke: " + ("no chain completed" if traffic.completed == 0 else
                                        f"threads stuck {stuck}" if stuck else "too many errors"))
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001
        print(f"soak: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        status = 2
    finally:
        if traffic:
            traffic.stop.set()
        for c in clients.values():
            c.close()
        for r in relays.values():
            r.server.stop(timeout=15)
        tl.kill_started()
        watchdog.cancel()
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return status


if __name__ == "__main__":
    sys.exit(main())

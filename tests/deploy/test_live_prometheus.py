#!/usr/bin/python3
"""A real Prometheus scraping a real relay, queried with the dashboard's own queries.

  1. starts kvrelay-server on 127.0.0.1 (port 0), with a spool in the
     temporary directory (--spool-dir, --max-spool-bytes 8GiB), and Debian's
     Prometheus
     server on a free loopback port with a temporary TSDB, configured from
     deploy/prometheus/prometheus.yml (the project's scrape config, its job
     name and its rule files) with the target moved to the test relay and a
     1 s scrape/evaluation interval;
  2. warms up (a tiny demo per compression policy, so each family's counters
     exist, a fetch that times out and an ack of an unknown message, so the
     error counter has codes), waits until Prometheus holds that state;
  3. runs `kvrelayctl demo` twice, with the default policy
     (h2o-head+obf) and with int4 quantization added (h2o-head+obf+int4,
     its turns carrying the generated steps' queries), on a small geometry; checks that the relay's own /metrics moved by exactly
     the totals each demo printed;
  4. waits for a scrape after the demos, then evaluates the dashboard's
     "Compression ratio by compressor family" and "Bytes saved per second"
     queries (taken from the JSON, $instance -> .*) through /api/v1/query
     with $__rate_interval set to the window between the last pre-demo
     sample and the first post-demo sample and the evaluation time on that
     sample, where rate() does not extrapolate: the ratio per family must
     equal full/sent of the demo totals, the rate times the window the bytes
     saved, to 1e-9 (and the printed ratio to its 3 decimals); so must the
     stat panels (all families) and increase() over the same window;
  5. every other dashboard query returns series without error; the hop
     latency histogram counted one delivery per hop; the network row's
     series exist at 0 (one relay forwards nothing; its forward latency
     quantiles are NaN), and so do the security row's (the five reasons of
     kvrelay_auth_failures_total; kvrelay_insecure on a loopback relay), and
     the spool row's: its bytes above 0, the spool limit as configured,
     kvrelay_spool_failed and the three kinds of quarantined files at 0, fsync
     latency quantiles that are numbers; every alerting rule
     evaluates with health "ok" in the real Prometheus and none fires;
  6. renders the dashboard from this Prometheus into a PNG
     (deploy/grafana/render_png.py; --png, default in the build dir).
     With --traffic-seconds N it first keeps the relay busy for N seconds
     (demos of varied size and policy, with and without queries, some
     errors), adds two relays that run a chain between them (every hop
     forwarded) and one whose tokens file refuses some calls, so that every row of
     the picture has curves: that is how docs/dashboard.png is made
     (tests/deploy/test_dashboard.py checks that it shows every panel).
"""
import argparse
import hashlib
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from deploy_common import (DEPLOY, FAILURES, PROM_CONFIG, Node, Relay, check, clean_env, free_port,  # noqa: E402
                           dashboard_targets, finish, free_port, load_dashboard, parse_exposition, run,
                           stop_process, substitute)

sys.path.insert(0, os.path.join(DEPLOY, "grafana"))

GEOMETRY = ["--layers", "4", "--kv-heads", "2", "--score-heads", "4", "--head-dim", "64",
            "--prompt", "256", "--gen", "16"]
POLICIES = {  # family label -> policy spec
    "h2o-head+obf": "h2o-head:k=32+obf:p=8,mode=fast",
    "h2o-head+obf+int4": "h2o-head:k=32+obf:p=8,mode=fast+int4:group=32",
}
SCRAPE_S = 1.0


class Prometheus:
    def __init__(self, binary, workdir, config):
        self.log_path = os.path.join(workdir, "prometheus.log")
        for attempt in range(3):
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            self.log = open(self.log_path, "a")
            self.proc = subprocess.Popen(
                [binary, f"--config.file={config}", f"--storage.tsdb.path={os.path.join(workdir, 'tsdb')}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1d",
                 "--web.enable-lifecycle"],
                stdout=self.log, stderr=subprocess.STDOUT, env=clean_env(), cwd=workdir)
            deadline = time.time() + 60
            while time.time() < deadline and self.proc.poll() is None:
                try:
                    with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                        if r.status == 200:
                            return
                except OSError:
                    pass
                time.sleep(0.2)
            self.stop()
        with open(self.log_path) as f:
            raise RuntimeError(f"prometheus did not become ready:\n{f.read()[-3000:]}")

    def api(self, path, **params):
        q = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{q}", timeout=30) as r:
            body = json.load(r)
        if body.get("status") != "success":
            raise RuntimeError(f"{path} {params}: {body}")
        return body["data"]

    def query(self, expr, at=None):
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        return self.api("query", **params)

    def stop(self):
        stop_process(self.proc, timeout=30)


def scrape(relay):
    with urllib.request.urlopen(f"http://{relay.metrics}/metrics", timeout=10) as r:
        return parse_exposition(r.read().decode())


def counters(samples, name):
    return {dict(ls).get("family"): v for (n, ls), v in samples.items() if n == name}


def demo(ctl, addr, policy, extra=None, rounds=1):
    rc, out, err = run([ctl, "demo", "--addr", addr, "--policy", policy, "--rounds", str(rounds)]
                       + list(GEOMETRY if extra is None else extra), timeout=300)
    if not check(rc == 0, f"kvrelayctl demo --policy {policy}: rc={rc} {err.strip()[-500:]}"):
        return None
    m = re.search(r"^totals: (.*)$", out, re.M)
    if not check(m, f"demo printed no totals line:\n{out[-1000:]}"):
        return None
    return {k: float(v) for k, v in re.findall(r"(\w+)=([0-9.]+)", m.group(1))}


def wait_for(what, pred, timeout=30, interval=0.25):
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        try:
            last = pred()
            if last:
                return last
        except (OSError, RuntimeError, KeyError, ValueError) as e:
            last = e
        time.sleep(interval)
    check(False, f"timed out waiting for {what} (last: {last})")
    return None


def vector(result):
    """{labels-tuple: value} of an instant-vector result."""
    return {tuple(sorted(s["metric"].items())): float(s["value"][1]) for s in result["result"]}


def close(a, b, rel=1e-9):
    return a == b or (math.isfinite(a) and math.isfinite(b) and abs(a - b) <= rel * max(abs(a), abs(b)))


def errors_traffic(ctl, addr, workdir):
    """One DEADLINE_EXCEEDED (a fetch that waits in vain) and one NOT_FOUND (ack of an unknown id)."""
    out = os.path.join(workdir, "nothing.safetensors")
    rc, _, _ = run([ctl, "fetch", "--addr", addr, "--session", "quiet", "--agent", "nobody", "--out", out,
                    "--wait", "1"], timeout=30)
    check(rc not in (0, None), "a fetch from an empty mailbox should fail (DEADLINE_EXCEEDED)")
    rc, _, _ = run([ctl, "ack", "--addr", addr, "--session", "quiet", "--agent", "nobody", "--id", "m-unknown"],
                   timeout=30)
    check(rc not in (0, None), "an ack of an unknown message should fail (NOT_FOUND)")


def auth_failures(ctl, addr, workdir):
    """Calls without a token and with a wrong one at a relay with a tokens file."""
    run([ctl, "stats", "--addr", addr], timeout=30)
    wrong = os.path.join(workdir, "wrong.token")
    with open(wrong, "w") as f:
        f.write("not-the-token\n")
    run([ctl, "stats", "--addr", addr, "--token-file", wrong], timeout=30)


def busy(ctl, addr, workdir, seconds, mesh=None, guarded=None):
    """Varied traffic for the screenshot: demos of several sizes and policies,
    some with the generated steps' queries, some errors; with `mesh` (two
    relays routing the chain's agents to each other) chains that forward
    every hop, and with `guarded` (a relay with a tokens file) refused
    credentials."""
    rng = random.Random(7)
    end = time.time() + seconds
    shapes = [
        [],  # kvrelayctl's default: Qwen3-14B geometry, ~90 MB per turn
        ["--layers", "16", "--kv-heads", "8", "--score-heads", "16", "--head-dim", "128", "--prompt", "512", "--gen", "40"],
        ["--layers", "8", "--kv-heads", "4", "--score-heads", "8", "--head-dim", "64", "--prompt", "512", "--gen", "32"],
        ["--layers", "8", "--kv-heads", "4", "--score-heads", "8", "--head-dim", "128", "--prompt", "384", "--gen", "24"],
        ["--layers", "4", "--kv-heads", "2", "--score-heads", "4", "--head-dim", "64", "--prompt", "256", "--gen", "16"],
    ]
    policies = list(POLICIES.values()) + ["h2o-head:k=64+obf:p=16,mode=fast"]
    n = 0
    while time.time() < end:
        phase = (time.time() - (end - seconds)) / seconds
        policy = policies[0] if phase < 0.3 else rng.choice(policies)
        extra = rng.choice(shapes) + (["--queries"] if n % 2 else [])
        demo(ctl, addr, policy, extra=extra, rounds=rng.choice([1, 1, 2]))
        n += 1
        if mesh and n % 2 == 0:
            # planner and refiner on the first relay, critic and judger on the second.
            demo(ctl, mesh[0], rng.choice(policies), extra=rng.choice(shapes[1:]) + ["--addr", mesh[1], "--addr",
                                                                                  mesh[0], "--addr", mesh[1]])
        if n % 3 == 0:
            errors_traffic(ctl, addr, workdir)
            if guarded:
                auth_failures(ctl, guarded, workdir)
        time.sleep(rng.uniform(0.5, 2.5))
    return n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prometheus", default=shutil.which("prometheus") or "/usr/bin/prometheus")
    ap.add_argument("--promtool", default=shutil.which("promtool") or "promtool")
    ap.add_argument("--server", required=True)
    ap.add_argument("--kvrelayctl", required=True)
    ap.add_argument("--node", default=shutil.which("node"))
    ap.add_argument("--node-modules", required=True)
    ap.add_argument("--png", help="where to write the dashboard PNG (default: none)")
    ap.add_argument("--traffic-seconds", type=float, default=0.0,
                    help="keep the relay busy this long before rendering (for docs/dashboard.png)")
    ap.add_argument("--relay-arg", action="append", default=[],
                    help="extra kvrelay-server flag, e.g. --relay-arg=--max-inflight-bytes=512MiB")
    args = ap.parse_args()
    if not check(os.access(args.prometheus, os.X_OK), f"{args.prometheus}: the Prometheus server (Debian package "
                 "prometheus, scripts/install_deps.sh) is required"):
        return finish("deploy_live_prometheus")
    node = Node(args.node, args.node_modules)
    dash = load_dashboard()
    targets = dashboard_targets(dash)
    work = tempfile.mkdtemp(prefix="kvrelay-live-")
    relay = prom = None
    others = []
    try:
        # For the picture (--traffic-seconds): relays B and D, which run the
        # chain between them (planner and refiner on B, critic and judger on
        # D: every hop is forwarded; the network row), and relay C with a
        # tokens file, which refuses calls (the security row). Prometheus
        # scrapes them only once the checks on relay A alone are done.
        others = []
        if args.traffic_seconds > 0:
            b_addr, d_addr = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
            for addr, peer, routed in ((b_addr, d_addr, ("critic", "judger")), (d_addr, b_addr, ("planner", "refiner"))):
                routes = [x for agent in routed for x in ("--route", f"{agent}={peer}")]
                others.append(Relay(args.server, work, name=f"relay-{addr.rsplit(':', 1)[1]}", args=[
                    "--listen", addr, "--metrics-listen", "127.0.0.1:0", "--advertise", addr] + routes))
            tokens = os.path.join(work, "tokens")
            with open(tokens, "w") as f:
                f.write("planner sha256:" + hashlib.sha256(b"the-token").hexdigest() + "\n")
            others.append(Relay(args.server, work, name="relay-c", args=[
                "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", "--tokens-file", tokens]))
        # A spool, so that the spool row has data (fsyncs on the temporary directory's disk).
        relay = Relay(args.server, work, args=["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
                                               "--spool-dir", os.path.join(work, "spool"),
                                               "--max-spool-bytes", "8GiB"] + args.relay_arg)
        # The project's scrape config, pointed at this relay, scraping every second.
        cfg = node.yaml(PROM_CONFIG)[0]
        cfg.setdefault("global", {}).update({"scrape_interval": "1s", "evaluation_interval": "1s"})
        cfg["rule_files"] = [os.path.join(os.path.dirname(PROM_CONFIG), g) for g in cfg.get("rule_files", [])]
        jobs = [j for j in cfg["scrape_configs"] if j["job_name"] == "kvrelay"]
        if not check(len(jobs) == 1, "prometheus.yml has one job kvrelay"):
            return finish("deploy_live_prometheus")
        # Targets from a file Prometheus watches, so that more relays can join.
        targets_file = os.path.join(work, "targets.json")

        def scrape_targets(relays):
            with open(targets_file + ".tmp", "w") as f:
                json.dump([{"targets": [r.metrics for r in relays]}], f)
            os.replace(targets_file + ".tmp", targets_file)

        scrape_targets([relay])
        jobs[0].pop("static_configs", None)
        jobs[0]["file_sd_configs"] = [{"files": [targets_file], "refresh_interval": "1s"}]
        cfg_path = os.path.join(work, "prometheus.yml")
        with open(cfg_path, "w") as f:
            json.dump(cfg, f, indent=1)  # JSON is YAML
        rc, out, err = run([args.promtool, "check", "config", cfg_path])
        check(rc == 0, f"promtool check config (test copy): {out} {err}")
        prom = Prometheus(args.prometheus, work, cfg_path)
        t_start = time.time()
        print(f"relay grpc={relay.addr} metrics={relay.metrics}; prometheus {prom.url}", flush=True)
        wait_for("the relay target to be up", lambda: [s for s in prom.query('up{job="kvrelay"}')["result"]
                                                       if s["value"][1] == "1"])

        # Warm-up: every family's counters exist, the error counter has codes.
        tiny = ["--layers", "1", "--kv-heads", "1", "--score-heads", "1", "--head-dim", "32", "--prompt", "64",
                "--gen", "4"]
        for family, policy in POLICIES.items():
            # Queries for int4 (as in the measured demos below): its
            # attention-error histogram exists before the window.
            demo(args.kvrelayctl, relay.addr, policy,
                 extra=tiny + ["--queries"] if family == "h2o-head+obf+int4" else tiny)
        errors_traffic(args.kvrelayctl, relay.addr, work)
        before = scrape(relay)
        full0 = counters(before, "kvrelay_full_bytes_total")
        check(set(full0) == set(POLICIES), f"families after the warm-up: {sorted(full0)}")

        def scraped(name, want):
            got = {s["metric"].get("family"): float(s["value"][1]) for s in prom.query(name)["result"]}
            return got == want and got

        wait_for("Prometheus to scrape the warm-up", lambda: scraped("kvrelay_full_bytes_total", full0))
        time.sleep(2.5 * SCRAPE_S)  # at least two samples of the quiet state
        t_demo = time.time()

        # The demos: the relay's counters move by exactly what each printed.
        totals = {}
        for family, policy in POLICIES.items():
            # The int4 demo's turns carry queries (gen.q), so the attention
            # output error panel has observations in the window too.
            t = demo(args.kvrelayctl, relay.addr, policy, rounds=2 if family == "h2o-head+obf" else 1,
                     extra=GEOMETRY + ["--queries"] if family == "h2o-head+obf+int4" else None)
            if t:
                totals[family] = t
        t_done = time.time()
        if not check(len(totals) == len(POLICIES), "both demos ran"):
            return finish("deploy_live_prometheus")
        after = scrape(relay)
        for name, key in (("kvrelay_full_bytes_total", "full_bytes"), ("kvrelay_sent_bytes_total", "sent_bytes"),
                          ("kvrelay_saved_bytes_total", "saved_bytes")):
            a, b = counters(after, name), counters(before, name)
            for fam, t in totals.items():
                check(a.get(fam, 0) - b.get(fam, 0) == t[key],
                      f"relay {name}{{family={fam}}} moved by {a.get(fam, 0) - b.get(fam, 0)}, the demo printed {key}={t[key]}")
        full1 = counters(after, "kvrelay_full_bytes_total")
        wait_for("Prometheus to scrape the demos", lambda: scraped("kvrelay_full_bytes_total", full1))
        wait_for("a scrape that started after the demos",
                 lambda: [s for s in prom.query("max(timestamp(kvrelay_full_bytes_total))")["result"]
                          if float(s["value"][1]) > t_done])

        # The exact window: from the last scrape before the demos to the first
        # after them (every series of one scrape shares its timestamp).
        span = f"[{int(time.time() - t_start) + 5}s]"
        raw = {(s["metric"]["__name__"], s["metric"].get("family")): [(float(t), float(v)) for t, v in s["values"]]
               for s in prom.query(f'{{__name__=~"kvrelay_(full|sent|saved)_bytes_total"}}{span}')["result"]}
        stamps = [t for t, _ in raw.get(("kvrelay_full_bytes_total", "h2o-head+obf"), [])]
        pre = [t for t in stamps if t < t_demo - 0.1]
        post = [t for t in stamps if t > t_done]
        if not check(pre and post, f"no scrapes around the demos: {stamps[-20:]}"):
            return finish("deploy_live_prometheus")
        t0, t1 = pre[-1], post[0]
        for (name, fam), values in raw.items():
            at = dict(values)
            check(at.get(t0) == counters(before, name).get(fam) and at.get(t1) == counters(after, name).get(fam),
                  f"{name}{{family={fam}}} in Prometheus at {t0}/{t1}: {at.get(t0)}/{at.get(t1)}, relay before/after: "
                  f"{counters(before, name).get(fam)}/{counters(after, name).get(fam)}")
        window = f"{int(round((t1 - t0) * 1000))}ms"
        seconds = int(round((t1 - t0) * 1000)) / 1000
        print(f"window {window} from {t0:.3f} to {t1:.3f} (demos started {t_demo:.3f})", flush=True)

        def dash_query(pred):
            exprs = [t["expr"] for p, t in targets if pred(p, t)]
            check(len(exprs) == 1, f"expected one dashboard query, found {exprs}")
            return substitute(exprs[0], window) if exprs else None

        by_family_ratio = dash_query(lambda p, t: "sum by (family)" in t["expr"] and "kvrelay_full_bytes_total" in t["expr"])
        by_family_saved = dash_query(lambda p, t: "sum by (family)" in t["expr"] and "kvrelay_saved_bytes_total" in t["expr"])
        all_ratio = dash_query(lambda p, t: p["type"] == "stat" and "kvrelay_full_bytes_total" in t["expr"])
        all_saved = dash_query(lambda p, t: p["type"] == "stat" and "kvrelay_saved_bytes_total" in t["expr"])
        for what, expr in (("ratio by family", by_family_ratio), ("saved by family", by_family_saved)):
            print(f"{what}: {expr}")
            res = vector(prom.query(expr, at=t1))
            got = {dict(k).get("family"): v for k, v in res.items()}
            check(set(got) == set(POLICIES), f"{what}: families {sorted(got)}")
            for fam, t in totals.items():
                if what.startswith("ratio"):
                    want = t["full_bytes"] / t["sent_bytes"]
                    check(close(got.get(fam, float("nan")), want),
                          f"dashboard ratio for {fam}: Prometheus {got.get(fam)}, demo totals {want}")
                    check(abs(got.get(fam, 0) - t["ratio"]) <= 0.0005 + 1e-12,
                          f"dashboard ratio for {fam}: {got.get(fam)} vs the demo's printed ratio {t['ratio']}")
                else:
                    check(close(got.get(fam, float("nan")) * seconds, t["saved_bytes"], 1e-9),
                          f"dashboard bytes saved/s for {fam}: {got.get(fam)} x {seconds} s != demo saved_bytes {t['saved_bytes']}")
            print(f"  {got}")
        sum_full = sum(t["full_bytes"] for t in totals.values())
        sum_sent = sum(t["sent_bytes"] for t in totals.values())
        sum_saved = sum(t["saved_bytes"] for t in totals.values())
        r = vector(prom.query(all_ratio, at=t1))
        check(len(r) == 1 and close(list(r.values())[0], sum_full / sum_sent),
              f"dashboard stat ratio {r} != {sum_full / sum_sent}")
        r = vector(prom.query(all_saved, at=t1))
        check(len(r) == 1 and close(list(r.values())[0] * seconds, sum_saved), f"dashboard stat bytes saved {r}")
        inc = vector(prom.query(f"sum by (family) (increase(kvrelay_saved_bytes_total[{window}]))", at=t1))
        for fam, t in totals.items():
            v = inc.get((("family", fam),))
            check(v is not None and close(v, t["saved_bytes"]), f"increase(saved) for {fam}: {v} != {t['saved_bytes']}")
        hops = sum(t.get("hops", 0) for t in totals.values())
        inc = vector(prom.query(f"sum(increase(kvrelay_publish_delivered_seconds_count[{window}]))", at=t1))
        check(list(inc.values()) == [hops], f"deliveries counted by the hop-latency histogram {inc}, demo hops {hops}")

        # Every dashboard query runs and returns series.
        for p, t in targets:
            expr = substitute(t["expr"], window)
            try:
                res = prom.query(expr, at=t1)["result"]
            except (OSError, RuntimeError) as e:
                check(False, f"panel {p['title']!r} {t['refId']}: {e}")
                continue
            check(res, f"panel {p['title']!r} {t['refId']}: no series from the live relay: {expr}")
            if "histogram_quantile" in expr and "kvrelay_forward_seconds" in expr:
                # One relay without routes forwards nothing: the series is there, with no observations.
                v = float(res[0]["value"][1]) if res else 0.0
                check(math.isnan(v), f"panel {p['title']!r} {t['refId']}: forward latency {v} s from a relay "
                      "that has no route to forward on")
            elif "histogram_quantile" in expr:
                v = float(res[0]["value"][1]) if res else float("nan")
                check(0 < v < 30, f"panel {p['title']!r} {t['refId']}: quantile {v} s")
        # The network and security rows' series exist at 0 on a loopback relay that forwards nothing
        # and refuses no one (no tokens file).
        for name in ("kvrelay_forward_bytes_total", "kvrelay_forward_full_bytes_total",
                     "kvrelay_forward_elided_bytes_total", "kvrelay_forward_seconds_count",
                     "kvrelay_outbox_messages", "kvrelay_outbox_bytes", "kvrelay_insecure"):
            got = after.get((name, frozenset()))
            check(got == 0, f"{name} = {got} on a relay without routes, expected 0")
        for name, label, values in (
                ("kvrelay_forwards_total", "outcome", ("committed", "duplicate", "retry", "whole", "dead_letter")),
                ("kvrelay_forwards_received_total", "outcome", ("committed", "duplicate", "refused")),
                ("kvrelay_dead_letters_total", "code", ("INVALID_ARGUMENT", "ALREADY_EXISTS", "FAILED_PRECONDITION",
                                                        "PERMISSION_DENIED", "DEADLINE_EXCEEDED", "UNAVAILABLE",
                                                        "RESOURCE_EXHAUSTED", "NOT_FOUND")),
                ("kvrelay_auth_failures_total", "reason", ("missing_credentials", "bad_token", "bad_certificate",
                                                           "peer_not_allowed", "forbidden"))):
            for v in values:
                got = after.get((name, frozenset({(label, v)})))
                check(got == 0, f"{name}{{{label}=\"{v}\"}} = {got} on a relay without routes, expected 0")
        # The spool row: a fresh, healthy spool that took the demos.
        check((after.get(("kvrelay_spool_bytes", frozenset())) or 0) > 0,
              f"kvrelay_spool_bytes = {after.get(('kvrelay_spool_bytes', frozenset()))} after the demos, expected > 0")
        check(after.get(("kvrelay_spool_failed", frozenset())) == 0, "kvrelay_spool_failed is not 0")
        for what in ("message_file", "journal", "missing"):
            got = after.get(("kvrelay_spool_quarantined_total", frozenset({("what", what)})))
            check(got == 0, f"kvrelay_spool_quarantined_total{{what=\"{what}\"}} = {got} on a new spool, expected 0")
        got = after.get(("kvrelay_limit_bytes", frozenset({("limit", "spool")})))
        check(got == 8 * 2 ** 30 or any("max-spool-bytes" in a for a in args.relay_arg),
              f"kvrelay_limit_bytes{{limit=\"spool\"}} = {got}, configured 8GiB")
        lim = vector(prom.query('kvrelay_limit_bytes{limit="inflight"}'))
        want = after.get(("kvrelay_limit_bytes", frozenset({("limit", "inflight")})))
        check(list(lim.values()) == [want] and (args.relay_arg or want == 4 * 2 ** 30),
              f"kvrelay_limit_bytes{{limit=\"inflight\"}} {lim}, the relay exports {want} (default 4GiB)")

        # The alerting rules, evaluated by the real Prometheus.
        rules = [r for g in prom.api("rules")["groups"] for r in g["rules"]]
        check(len(rules) >= 4, f"Prometheus loaded {len(rules)} rules")
        wait_for("every rule to be evaluated", lambda: all(r.get("lastEvaluation", "").startswith("2") and
                                                             not r["lastEvaluation"].startswith("0001")
                                                             for g in prom.api("rules")["groups"] for r in g["rules"]))
        for r in (r for g in prom.api("rules")["groups"] for r in g["rules"]):
            check(r.get("health") == "ok", f"rule {r.get('name')}: health {r.get('health')} {r.get('lastError')}")
        firing = [a for a in prom.api("alerts")["alerts"] if a.get("state") == "firing"]
        check(not firing, f"alerts firing against a healthy relay: {firing}")

        if args.traffic_seconds > 0:
            scrape_targets([relay] + others)
            wait_for("every relay's target to be up", lambda: len([s for s in prom.query('up{job="kvrelay"}')["result"]
                                                                   if s["value"][1] == "1"]) == 1 + len(others))
            t_busy = time.time()
            n = busy(args.kvrelayctl, relay.addr, work, args.traffic_seconds, mesh=(others[0].addr, others[1].addr),
                     guarded=others[2].addr)
            print(f"traffic: {n} demos in {time.time() - t_busy:.0f} s", flush=True)
            time.sleep(1.5 * SCRAPE_S)
        if args.png:
            try:
                import render_png
            except ImportError as e:
                check(False, f"deploy/grafana/render_png.py: {e}")
            else:
                end = time.time()
                start = t_start if args.traffic_seconds <= 0 else t_busy - 15
                try:
                    info = render_png.render(prom.url, args.png, start, end, step=None, scrape_interval=SCRAPE_S,
                                             subtitle="rendered from a live Prometheus scraping kvrelay-server "
                                                      "(kvrelayctl demo traffic)")
                    print(f"wrote {args.png}: {info}")
                    with open(args.png, "rb") as f:
                        head = f.read(24)
                    check(head[:8] == b"\x89PNG\r\n\x1a\n", f"{args.png} is not a PNG")
                    w, h = int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")
                    check(w >= 1200 and h >= 800, f"{args.png}: {w}x{h}")
                except Exception as e:  # noqa: BLE001 - report, do not hide the other checks
                    check(False, f"rendering the dashboard PNG: {type(e).__name__}: {e}")
    finally:
        if prom:
            prom.stop()
        if relay:
            check(relay.stop() == 0, "the relay did not exit 0 on SIGTERM")
        for other in others:
            other.stop()
        if FAILURES:
            print(f"logs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return finish("deploy_live_prometheus")


if __name__ == "__main__":
    sys.exit(main())

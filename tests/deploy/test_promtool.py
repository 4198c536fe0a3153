#!/usr/bin/python3
"""promtool over the alerting rules, the scrape config and the dashboard's queries.

  1. `promtool check rules deploy/prometheus/rules/*.yaml`; every alert has
     `for:`, a severity label, summary and description annotations, and
     selects only metrics server/metrics/metrics.cc registers (or `up`);
  2. `promtool check config deploy/prometheus/prometheus.yml` (the compose
     scrape config; it loads the rule files it names);
  3. every dashboard query, with $__rate_interval -> 5m and $instance -> .*,
     as a recording rule in a temporary rule file: `promtool check rules`
     parses each one;
  4. `promtool test rules deploy/prometheus/tests/*.yaml`: synthetic series
     for which the dashboard's ratio-by-family and bytes-saved queries give
     known numbers, and for which each alert fires or stays quiet; the test
     file's copies of those queries (and of the failed-RPC ratio by method)
     must be the dashboard's own ($__rate_interval -> 4m there, so the
     expected rates are exact floats), and so must the network row's
     forwarded, full-KV and elided bytes and forward latency quantiles,
     the security row's auth failures by reason and insecure-listener count,
     and the spool row's bytes with their limit, fsync latency quantiles,
     recovery seconds, quarantined files and failed spools;
  5. KvrelayHighErrorRate is a per-method ratio of kvrelay_rpcs_total with a
     minimum-traffic guard, leaving out the same codes as the dashboard's
     failed-ratio panel;
  6. KvrelayAuthFailureBurst counts kvrelay_auth_failures_total per relay and
     reason, and KvrelayInsecureListener selects kvrelay_insecure == 1;
  7. KvrelaySpoolFailed is critical and sees kvrelay_spool_failed == 1 over a
     window (a liveness restart resets the gauge within a scrape or two), and
     KvrelaySpoolNearlyFull compares kvrelay_spool_bytes with the spool's
     kvrelay_limit_bytes and leaves out a limit of 0.
"""
import argparse
import glob
import json
import os
import re
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from deploy_common import (DEPLOY, PROM_CONFIG, PROM_TESTS, Node, check, dashboard_targets,  # noqa: E402
                           finish, load_dashboard, metric_names_in_expr, metric_names_in_source, run, substitute)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--promtool", default=shutil.which("promtool"))
    ap.add_argument("--node", default=shutil.which("node"))
    ap.add_argument("--node-modules", required=True)
    args = ap.parse_args()
    if not check(args.promtool, "promtool is required (Debian package prometheus; scripts/install_deps.sh)"):
        return finish("deploy_promtool")
    node = Node(args.node, args.node_modules)
    rc, out, err = run([args.promtool, "--version"])
    print(" ".join((out or err).split()[:3]))

    rule_files = sorted(glob.glob(os.path.join(DEPLOY, "prometheus", "rules", "*.yaml")))
    check(rule_files, "no rule files under deploy/prometheus/rules")
    rc, out, err = run([args.promtool, "check", "rules"] + rule_files)
    print(out.strip())
    check(rc == 0, f"promtool check rules: rc={rc} {out.strip()} {err.strip()}")

    known = metric_names_in_source() | {"up"}
    alerts = set()
    for f in rule_files:
        for g in node.yaml(f)[0]["groups"]:
            for r in g["rules"]:
                name = r.get("alert") or r.get("record")
                if "alert" in r:
                    alerts.add(name)
                    check(r.get("for"), f"{name}: no `for:`")
                    check((r.get("labels") or {}).get("severity") in ("critical", "warning", "info"),
                          f"{name}: severity label {(r.get('labels') or {}).get('severity')!r}")
                    ann = r.get("annotations") or {}
                    check(ann.get("summary") and len(ann.get("description", "")) >= 80,
                          f"{name}: needs a summary and a runbook-like description")
                for m in metric_names_in_expr(r["expr"]):
                    check(m in known, f"{name}: metric {m} is not registered in server/metrics/metrics.cc")
    check({"KvrelayDown", "KvrelayHighErrorRate", "KvrelayCompressionRatioCollapsed",
           "KvrelayInflightBytesNearLimit", "KvrelayForwardDeadLetters", "KvrelayForwardRetryRateHigh",
           "KvrelayOutboxNearLimit", "KvrelayAuthFailureBurst", "KvrelayInsecureListener",
           "KvrelaySpoolFailed", "KvrelaySpoolNearlyFull"} <= alerts,
          f"alerts {sorted(alerts)}")

    # The error-rate alert: a per-method ratio of kvrelay_rpcs_total (every finished call,
    # OK included), not errors of all methods over a message count; the codes it does not
    # count as failures are the ones the dashboard's failed-ratio panel leaves out.
    err_rules = [r for f in rule_files for g in node.yaml(f)[0]["groups"] for r in g["rules"]
                 if r.get("alert") == "KvrelayHighErrorRate"]
    alert_excluded = None
    if check(len(err_rules) == 1, "one KvrelayHighErrorRate rule"):
        e = re.sub(r"\s+", " ", err_rules[0]["expr"])
        check(metric_names_in_expr(e) == {"kvrelay_rpcs_total"},
              f"KvrelayHighErrorRate should use kvrelay_rpcs_total only, uses {sorted(metric_names_in_expr(e))}")
        groupings = re.findall(r"\bby \(([^)]*)\)", e)
        check(groupings and all("method" in g for g in groupings),
              f"KvrelayHighErrorRate should aggregate by method (per-method ratio), groups by {groupings}")
        excl = set(re.findall(r'code!~"([^"]*)"', e))
        check(len(excl) == 1, f"KvrelayHighErrorRate: one code!~ exclusion expected, got {excl}")
        alert_excluded = set(next(iter(excl)).split("|")) if excl else None
        check(alert_excluded and "OK" in alert_excluded,
              f"KvrelayHighErrorRate counts OK calls as failures (code!~ {alert_excluded})")
        check(re.search(r"\band\b.*\bincrease\(kvrelay_rpcs_total", e),
              "KvrelayHighErrorRate has no minimum-traffic guard (`and ... increase(kvrelay_rpcs_total...)`)")

    # The security alerts: per relay and reason, and the insecure gauge at exactly 1.
    all_rules = {r.get("alert"): r for f in rule_files for g in node.yaml(f)[0]["groups"] for r in g["rules"]}
    burst = all_rules.get("KvrelayAuthFailureBurst")
    if check(burst, "no KvrelayAuthFailureBurst rule"):
        e = re.sub(r"\s+", " ", burst["expr"])
        check(metric_names_in_expr(e) == {"kvrelay_auth_failures_total"},
              f"KvrelayAuthFailureBurst should use kvrelay_auth_failures_total only: {e}")
        check(re.search(r"\bincrease\(kvrelay_auth_failures_total\{", e),
              f"KvrelayAuthFailureBurst should count failures with increase(): {e}")
        groupings = re.findall(r"\bby \(([^)]*)\)", e)
        check(groupings and all({"instance", "reason"} <= {x.strip() for x in g.split(",")} for g in groupings),
              f"KvrelayAuthFailureBurst should aggregate by instance and reason, groups by {groupings}")
    insecure = all_rules.get("KvrelayInsecureListener")
    if check(insecure, "no KvrelayInsecureListener rule"):
        e = re.sub(r"\s+", "", insecure["expr"])
        check(re.fullmatch(r'kvrelay_insecure\{job="kvrelay"\}==1', e),
              f"KvrelayInsecureListener should be kvrelay_insecure{{job=\"kvrelay\"}} == 1: {insecure['expr']}")

    # The spool alerts: a failed spool is critical and is not missed between a
    # restart's scrapes; the fill ratio is against the spool's own limit, a 0 left out.
    failed = all_rules.get("KvrelaySpoolFailed")
    if check(failed, "no KvrelaySpoolFailed rule"):
        e = re.sub(r"\s+", "", failed["expr"])
        check(re.fullmatch(r'max_over_time\(kvrelay_spool_failed\{job="kvrelay"\}\[\d+m\]\)==1', e),
              f"KvrelaySpoolFailed should be max_over_time(kvrelay_spool_failed{{job=\"kvrelay\"}}[Nm]) == 1: "
              f"{failed['expr']}")
        check((failed.get("labels") or {}).get("severity") == "critical",
              f"KvrelaySpoolFailed severity {(failed.get('labels') or {}).get('severity')!r}, expected critical")
    full = all_rules.get("KvrelaySpoolNearlyFull")
    if check(full, "no KvrelaySpoolNearlyFull rule"):
        e = re.sub(r"\s+", "", full["expr"])
        check(metric_names_in_expr(full["expr"]) == {"kvrelay_spool_bytes", "kvrelay_limit_bytes"}
              and 'kvrelay_limit_bytes{job="kvrelay",limit="spool"}>0' in e,
              f"KvrelaySpoolNearlyFull should divide kvrelay_spool_bytes by kvrelay_limit_bytes{{limit=\"spool\"}} "
              f"(> 0): {full['expr']}")

    rc, out, err = run([args.promtool, "check", "config", PROM_CONFIG])
    print(out.strip())
    check(rc == 0, f"promtool check config {PROM_CONFIG}: rc={rc} {out.strip()} {err.strip()}")

    dash = load_dashboard()
    targets = dashboard_targets(dash)
    with tempfile.TemporaryDirectory(prefix="kvrelay-promtool-") as work:
        rules = []
        for p, t in targets:
            rules.append({"record": f"dashboard:panel{p['id']}:{t['refId'].lower()}",
                          "expr": substitute(t["expr"], "5m")})
        path = os.path.join(work, "dashboard-queries.json")  # JSON is YAML
        with open(path, "w") as f:
            json.dump({"groups": [{"name": "dashboard", "rules": rules}]}, f, indent=1)
        rc, out, err = run([args.promtool, "check", "rules", path])
        check(rc == 0 and f"SUCCESS: {len(rules)} rules found" in out,
              f"promtool check rules on the {len(rules)} dashboard queries: rc={rc} {out.strip()} {err.strip()}")
        print(f"dashboard: {len(rules)} queries parse")

    tests = sorted(glob.glob(os.path.join(PROM_TESTS, "*.yaml")))
    check(tests, "no promtool tests under deploy/prometheus/tests")
    rc, out, err = run([args.promtool, "test", "rules"] + tests, timeout=300)
    print(out.strip())
    check(rc == 0, f"promtool test rules: rc={rc}\n{out}\n{err}")

    # The test file must test the dashboard's own ratio and bytes-saved queries.
    tested = set()
    for f in tests:
        doc = node.yaml(f)[0]
        for tg in doc.get("tests", []):
            for e in tg.get("promql_expr_test", []):
                tested.add(re.sub(r"\s+", " ", e["expr"]).strip())
        fired = {a["alertname"] for tg in doc.get("tests", []) for a in tg.get("alert_rule_test", [])
                 if a.get("exp_alerts")}
        check(alerts <= fired, f"alerts never shown firing in the promtool tests: {sorted(alerts - fired)}")
    required = {
        "ratio by family": lambda e: "sum by (family)" in e and "kvrelay_full_bytes_total" in e
                                     and "kvrelay_sent_bytes_total" in e,
        "bytes saved by family": lambda e: "sum by (family)" in e and "kvrelay_saved_bytes_total" in e,
        "failed RPC ratio by method": lambda e: "kvrelay_rpcs_total" in e and "code!~" in e,
        "bytes on the network": lambda e: "kvrelay_forward_bytes_total" in e,
        "wire-coded bytes": lambda e: "kvrelay_wire_bytes_total" in e,
        "what full KV would have sent": lambda e: "kvrelay_forward_full_bytes_total" in e,
        "elided bytes": lambda e: "kvrelay_forward_elided_bytes_total" in e,
        "forward latency": lambda e: "kvrelay_forward_seconds_bucket" in e,
        "auth failures by reason": lambda e: "kvrelay_auth_failures_total" in e,
        "insecure listeners": lambda e: "kvrelay_insecure" in e,
        "spool bytes": lambda e: "kvrelay_spool_bytes" in e,
        "spool limit": lambda e: 'limit="spool"' in e,
        "spool fsync latency": lambda e: "kvrelay_spool_fsync_seconds_bucket" in e,
        "spool recovery": lambda e: "kvrelay_spool_recovery" in e,
        "quarantined spool files": lambda e: "kvrelay_spool_quarantined_total" in e,
        "failed spools": lambda e: "kvrelay_spool_failed" in e,
    }
    for _, t in targets:
        if "kvrelay_rpcs_total" in t["expr"] and "code!~" in t["expr"]:
            panel_excl = {c for m in re.findall(r'code!~"([^"]*)"', t["expr"]) for c in m.split("|")}
            check(panel_excl == alert_excluded, f"the dashboard's failed-ratio query leaves out codes {panel_excl}, "
                  f"the KvrelayHighErrorRate alert {alert_excluded}")
    for what, pred in required.items():
        exprs = [re.sub(r"\s+", " ", substitute(t["expr"], "4m")).strip() for _, t in targets if pred(t["expr"])]
        check(exprs, f"dashboard has no {what} query")
        for e in exprs:
            check(e in tested, f"the promtool tests do not test the dashboard's {what} query verbatim: {e}")
    return finish("deploy_promtool")


if __name__ == "__main__":
    sys.exit(main())

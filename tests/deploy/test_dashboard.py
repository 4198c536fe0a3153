#!/usr/bin/python3
"""Lint of deploy/grafana/kvrelay-dashboard.json (stdlib only).

  - portable: a `datasource` template variable (type datasource, query
    prometheus) that every panel and query uses; no `__inputs` (the
    export-for-sharing form that the provisioning and the ConfigMap sidecar
    cannot resolve), no ${DS_...} references;
  - every panel has a unit (fieldConfig.defaults.unit) and a description, a
    unique id and a place on the grid that overlaps no other panel;
  - every range in every query is $__rate_interval (so rate()/increase()
    follow the scrape interval), every selector filters by $instance, every
    metric is one server/metrics/metrics.cc registers (or `up`), every
    histogram_quantile aggregates `by (le)`;
  - the required panels exist with fitting units: compression ratio by
    family (full/sent), bytes saved per second, hop latency p50/p99
    (kvrelay_publish_delivered_seconds), compression time p50/p99,
    mailbox depth, in-flight bytes with the in-flight limit, errors by code,
    RPCs by method and code (kvrelay_rpcs_total) and the failed-call ratio by
    method (the KvrelayHighErrorRate alert's ratio, per relay);
  - a "network" row holding, below it: bytes forwarded relay to relay
    against what full KV would have sent in one panel, elided bytes, forward
    latency p50/p95 (kvrelay_forward_seconds), forwards by outcome, the
    outbox bytes with the outbox limit and its messages, dead letters by code;
  - a "security" row holding, below it: auth failures per second by reason
    (kvrelay_auth_failures_total, a legend naming the reason) and a stat of
    the relays with an insecure listener (kvrelay_insecure), red from 1;
  - a "spool" row holding, below it: the spool's bytes on disk with the
    spool limit (kvrelay_limit_bytes{limit="spool"}), fsync latency p50/p99
    (kvrelay_spool_fsync_seconds), the last recovery's seconds and its CRC32C
    part, files quarantined or missing by kind, and a stat of the relays
    whose spool failed (kvrelay_spool_failed), red from 1.
"""
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from deploy_common import (DASHBOARD, REPO, check, dashboard_targets, finish,  # noqa: E402
                           metric_names_in_expr, metric_names_in_source)

DS_REF = ("${datasource}", "$datasource")


def squash(expr):
    return re.sub(r"\s+", "", expr)


def panels_of(dash):
    out = []

    def walk(ps):
        for p in ps:
            if p.get("type") == "row":
                walk(p.get("panels", []))
            else:
                out.append(p)

    walk(dash.get("panels", []))
    return out


def find_panel(panels, what, pred):
    hits = [p for p in panels if any(pred(squash(t.get("expr", ""))) for t in p.get("targets", []))]
    check(hits, f"required panel missing: {what}")
    return hits


def main():
    with open(DASHBOARD) as f:
        text = f.read()
    try:
        dash = json.loads(text)
    except ValueError as e:
        check(False, f"{DASHBOARD}: not JSON: {e}")
        return finish("deploy_dashboard")

    check("__inputs" not in dash, "the dashboard has __inputs (use a datasource variable instead)")
    check("${DS_" not in text, "the dashboard references ${DS_...} inputs")
    check(dash.get("uid") == "kvrelay", f"dashboard uid {dash.get('uid')!r}, expected a fixed 'kvrelay'")
    check(dash.get("id") is None, "dashboard id should be null (Grafana assigns it)")
    check(dash.get("title"), "dashboard has no title")
    check(isinstance(dash.get("schemaVersion"), int) and dash["schemaVersion"] >= 36,
          f"schemaVersion {dash.get('schemaVersion')} (Grafana >= 9 dashboards)")

    variables = {v.get("name"): v for v in dash.get("templating", {}).get("list", [])}
    ds = variables.get("datasource")
    check(ds and ds.get("type") == "datasource" and ds.get("query") == "prometheus",
          f"no `datasource` variable of type datasource with query prometheus: {ds}")
    inst = variables.get("instance")
    if check(inst is not None, "no `instance` variable"):
        check((inst.get("datasource") or {}).get("uid") in DS_REF, "the instance variable does not use ${datasource}")
        check(inst.get("includeAll") and inst.get("allValue") == ".*",
              "the instance variable needs includeAll with allValue .* (the queries match it with =~)")
        q = inst.get("query")
        q = q.get("query") if isinstance(q, dict) else q
        m = re.match(r"label_values\((\w+),\s*instance\)", q or "")
        check(m and m.group(1) in metric_names_in_source(), f"instance variable query {q!r}")

    panels = panels_of(dash)
    check(len(panels) >= 7, f"only {len(panels)} panels")
    ids = [p.get("id") for p in panels]
    check(len(set(ids)) == len(ids) and None not in ids, f"panel ids not unique: {ids}")
    cells = {}
    known = metric_names_in_source() | {"up"}
    for p in panels:
        name = f"panel {p.get('id')} {p.get('title')!r}"
        check(p.get("title"), f"{name}: no title")
        check(isinstance(p.get("description"), str) and len(p["description"].strip()) >= 20,
              f"{name}: no description")
        unit = ((p.get("fieldConfig") or {}).get("defaults") or {}).get("unit")
        check(isinstance(unit, str) and unit.strip(), f"{name}: no unit (fieldConfig.defaults.unit)")
        check((p.get("datasource") or {}).get("uid") in DS_REF and (p.get("datasource") or {}).get("type") == "prometheus",
              f"{name}: datasource {p.get('datasource')}, expected the ${{datasource}} variable")
        g = p.get("gridPos") or {}
        if check(all(isinstance(g.get(k), int) for k in "xywh") and g["x"] + g["w"] <= 24, f"{name}: gridPos {g}"):
            for x in range(g["x"], g["x"] + g["w"]):
                for y in range(g["y"], g["y"] + g["h"]):
                    check((x, y) not in cells, f"{name} overlaps panel {cells.get((x, y))}")
                    cells[(x, y)] = p.get("id")
        targets = p.get("targets") or []
        check(targets, f"{name}: no queries")
        refs = [t.get("refId") for t in targets]
        check(len(set(refs)) == len(refs), f"{name}: duplicate refIds {refs}")
        for t in targets:
            expr = t.get("expr", "")
            tn = f"{name} {t.get('refId')}"
            check(expr.strip(), f"{tn}: empty expr")
            if "datasource" in t:
                check((t["datasource"] or {}).get("uid") in DS_REF, f"{tn}: datasource {t['datasource']}")
            for rng in re.findall(r"\[([^\]]*)\]", expr):
                check(rng == "$__rate_interval", f"{tn}: range [{rng}] should be [$__rate_interval]")
            calls = re.findall(r"\b(?:rate|irate|increase)\s*\(([^()]*(?:\([^()]*\))?[^()]*)\)", expr)
            for c in calls:
                check("[$__rate_interval]" in c, f"{tn}: {c!r} does not use $__rate_interval")
            for metric in metric_names_in_expr(expr):
                check(metric in known, f"{tn}: metric {metric} is not registered in server/metrics/metrics.cc")
            selectors = re.findall(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}", expr)
            bare = [m for m in metric_names_in_expr(re.sub(r"\{[^}]*\}", "", expr))
                    if m not in {s[0] for s in selectors}]
            check(not bare, f"{tn}: metrics without a selector {bare} (filter by instance=~\"$instance\")")
            for metric, labels in selectors:
                check('instance=~"$instance"' in labels, f"{tn}: {metric}{{{labels}}} does not filter by $instance")
            if "histogram_quantile" in expr:
                # sum by (le) or by (le, family): the buckets must stay apart.
                groups = [[x.strip() for x in g.split(",")] for g in re.findall(r"by\s*\(([^)]*)\)", expr)]
                check(any("le" in g for g in groups), f"{tn}: histogram_quantile without sum by (le)")
            if (p.get("type") == "timeseries" and len(targets) > 1) or " by (" in expr:
                check(t.get("legendFormat"), f"{tn}: no legendFormat")

    # The required panels, recognised by their queries, and their units.
    def unit(p):
        return p["fieldConfig"]["defaults"].get("unit", "")

    for p in find_panel(panels, "compression ratio by family (full / sent)",
                        lambda e: re.search(r"sumby\(family\)\(rate\(kvrelay_full_bytes_total\{[^}]*\}\[\$__rate_interval\]\)\)"
                                            r"/sumby\(family\)\(rate\(kvrelay_sent_bytes_total\{[^}]*\}\[\$__rate_interval\]\)\)$", e)):
        check("byte" not in unit(p).lower() and "bps" not in unit(p).lower(), f"ratio panel unit {unit(p)!r}")
    for p in find_panel(panels, "bytes saved per second",
                        lambda e: "rate(kvrelay_saved_bytes_total" in e):
        check(unit(p) in ("Bps", "binBps", "decBps"), f"bytes-saved panel unit {unit(p)!r}")

    def quantiles(metric):
        return lambda e: re.search(r"histogram_quantile\(0\.(5|99),sumby\(le\)\(rate\(" + metric, e)

    for metric, what in (("kvrelay_publish_delivered_seconds_bucket", "hop latency"),
                         ("kvrelay_compress_seconds_bucket", "compression time")):
        hits = find_panel(panels, f"{what} p50/p99", quantiles(metric))
        for p in hits:
            qs = {re.search(r"histogram_quantile\((0\.\d+)", squash(t["expr"])).group(1)
                  for t in p["targets"] if metric in t["expr"]}
            check({"0.5", "0.99"} <= qs, f"{what} panel has quantiles {sorted(qs)}, expected 0.5 and 0.99")
            check(unit(p) == "s", f"{what} panel unit {unit(p)!r}, expected s")
    for p in find_panel(panels, "mailbox depth", lambda e: "kvrelay_mailbox_messages" in e):
        check(unit(p) in ("short", "none"), f"mailbox depth unit {unit(p)!r}")
    for p in find_panel(panels, "in-flight bytes", lambda e: "kvrelay_inflight_bytes" in e):
        exprs = [squash(t["expr"]) for t in p["targets"]]
        check(any('kvrelay_limit_bytes{limit="inflight"' in e for e in exprs),
              f"in-flight panel {p['title']!r} does not show kvrelay_limit_bytes{{limit=\"inflight\"}}")
        check(unit(p) in ("bytes", "decbytes"), f"in-flight unit {unit(p)!r}")
    for p in find_panel(panels, "errors by code",
                        lambda e: re.search(r"sumby\(code\)\(rate\(kvrelay_errors_total", e)):
        check(unit(p) in ("reqps", "ops", "short", "cps") or unit(p).startswith("suffix:"), f"errors unit {unit(p)!r}")
    for p in find_panel(panels, "RPCs by method and code (kvrelay_rpcs_total)",
                        lambda e: re.search(r"sumby\(method,code\)\(rate\(kvrelay_rpcs_total\{", e)):
        check(unit(p) in ("reqps", "ops", "short", "cps") or unit(p).startswith("suffix:"), f"RPCs unit {unit(p)!r}")
        check(any("{{method}}" in t.get("legendFormat", "") and "{{code}}" in t.get("legendFormat", "")
                  for t in p["targets"]), f"RPCs panel {p['title']!r}: the legend should name method and code")
    # A stat of failures must not count what long-polling agents produce in
    # normal operation (a Fetch that waits in vain is DEADLINE_EXCEEDED): a
    # healthy relay would show a failure rate that never goes to 0.
    for p in panels:
        if p.get("type") != "stat":
            continue
        for e in (squash(t.get("expr", "")) for t in p.get("targets", [])):
            if "kvrelay_errors_total" in e or re.search(r"kvrelay_rpcs_total\{code!~", e):
                check("kvrelay_errors_total" not in e and
                      re.search(r'code!~"OK\|CANCELLED\|DEADLINE_EXCEEDED\|NOT_FOUND"', e),
                      f"stat panel {p.get('title')!r} counts normal codes as failures: {e}")
    # The KvrelayHighErrorRate alert's ratio: failed calls of a method over all its calls, per relay.
    for p in find_panel(panels, "failed RPC ratio by method",
                        lambda e: re.search(r"sumby\(instance,method\)\(rate\(kvrelay_rpcs_total\{code!~\"OK\|[^\"]*\",", e)
                        and re.search(r"/sumby\(instance,method\)\(rate\(kvrelay_rpcs_total\{instance", e)):
        check(unit(p) in ("percentunit", "percent"), f"failed-ratio panel unit {unit(p)!r}")
    check("kvrelay_rpcs_total" in metric_names_in_source(), "server/metrics/metrics.cc does not register kvrelay_rpcs_total")
    check_network_row(dash, panels, unit)
    check_picture(panels)
    check_security_row(dash, panels, unit)
    check_spool_row(dash, panels, unit)
    return finish("deploy_dashboard")


def row_titled(dash, word):
    """The one top-level row whose title contains WORD, or None (a failed check)."""
    rows = [p for p in dash.get("panels", []) if p.get("type") == "row" and word in p.get("title", "").lower()]
    check(len(rows) == 1, f"{len(rows)} rows titled {word}, expected one")
    return rows[0] if len(rows) == 1 else None


def in_row_test(dash, row):
    """A predicate: whether a panel sits in ROW (nested in it, or below it and above the next row)."""
    top = row["gridPos"]["y"] + row["gridPos"].get("h", 1)
    later_rows = [p["gridPos"]["y"] for p in dash["panels"] if p.get("type") == "row" and p["gridPos"]["y"] >= top]
    bottom = min(later_rows) if later_rows else float("inf")
    nested = row.get("panels") or []
    check(not row.get("collapsed") and not nested or row.get("collapsed") and nested,
          f"{row.get('title')} row: collapsed {row.get('collapsed')} with {len(nested)} nested panels")
    return lambda p: p in nested or top <= p["gridPos"]["y"] < bottom


def check_security_row(dash, panels, unit):
    """Auth failures by reason and the insecure-listener stat sit in a row titled security."""
    row = row_titled(dash, "security")
    if not row:
        return
    in_row = in_row_test(dash, row)
    rates = ("reqps", "ops", "short", "cps")
    for p in find_panel(panels, "auth failures by reason",
                        lambda e: re.search(r"sumby\(reason\)\(rate\(kvrelay_auth_failures_total\{", e)):
        check(in_row(p), f"panel {p['title']!r} (auth failures) is not in the security row")
        check(p.get("type") == "timeseries", f"panel {p['title']!r} (auth failures) is a {p.get('type')}")
        check(unit(p) in rates or unit(p).startswith("suffix:"), f"auth failures panel unit {unit(p)!r}")
        check(any("{{reason}}" in t.get("legendFormat", "") for t in p["targets"]),
              f"auth failures panel {p['title']!r}: the legend should name the reason")
    for p in find_panel(panels, "relays with an insecure listener",
                        lambda e: re.fullmatch(r"sum\(kvrelay_insecure\{[^}]*\}\)", e)):
        check(in_row(p), f"panel {p['title']!r} (insecure listeners) is not in the security row")
        check(p.get("type") == "stat", f"panel {p['title']!r} (insecure listeners) is a {p.get('type')}, expected stat")
        steps = (((p.get("fieldConfig") or {}).get("defaults") or {}).get("thresholds") or {}).get("steps") or []
        red = [s.get("value") for s in steps if s.get("color") == "red"]
        check(red == [1], f"insecure-listener stat: red from {red}, expected from 1 (one relay is one too many)")


def check_spool_row(dash, panels, unit):
    """The spool's panels (--spool-dir) sit in a row titled spool."""
    row = row_titled(dash, "spool")
    if not row:
        return
    in_row = in_row_test(dash, row)

    def need(what, pred, units):
        hits = find_panel(panels, what, pred)
        for p in hits:
            check(in_row(p), f"panel {p['title']!r} ({what}) is not in the spool row")
            check(unit(p) in units, f"panel {p['title']!r} ({what}) unit {unit(p)!r}, expected one of {units}")
        return hits

    def exprs(p):
        return [squash(t["expr"]) for t in p.get("targets", [])]

    for p in need("spool bytes", lambda e: "kvrelay_spool_bytes{" in e, ("bytes", "decbytes")):
        check(any('kvrelay_limit_bytes{limit="spool"' in e for e in exprs(p)),
              f"spool bytes panel {p['title']!r} does not show kvrelay_limit_bytes{{limit=\"spool\"}}")
    for p in need("spool fsync latency", lambda e: re.search(
            r"histogram_quantile\(0\.\d+,sumby\(le\)\(rate\(kvrelay_spool_fsync_seconds_bucket\{", e), ("s",)):
        qs = {re.search(r"histogram_quantile\((0\.\d+)", e).group(1) for e in exprs(p) if "kvrelay_spool_fsync" in e}
        check({"0.5", "0.99"} <= qs, f"spool fsync panel has quantiles {sorted(qs)}, expected 0.5 and 0.99")
    for p in need("spool recovery seconds", lambda e: "kvrelay_spool_recovery_seconds{" in e, ("s",)):
        check(any("kvrelay_spool_recovery_crc_seconds{" in e for e in exprs(p)),
              f"recovery panel {p['title']!r} does not show the CRC32C part (kvrelay_spool_recovery_crc_seconds)")
    for p in need("quarantined spool files", lambda e: re.search(r"sumby\(what\)\(kvrelay_spool_quarantined_total\{", e),
                  ("short", "none")):
        check(any("{{what}}" in t.get("legendFormat", "") for t in p["targets"]),
              f"quarantined panel {p['title']!r}: the legend should name what (message_file, journal, missing)")
    for p in need("relays whose spool failed", lambda e: re.fullmatch(r"sum\(kvrelay_spool_failed\{[^}]*\}\)", e),
                  ("short", "none")):
        check(p.get("type") == "stat", f"panel {p['title']!r} (failed spools) is a {p.get('type')}, expected stat")
        steps = (((p.get("fieldConfig") or {}).get("defaults") or {}).get("thresholds") or {}).get("steps") or []
        red = [s.get("value") for s in steps if s.get("color") == "red"]
        check(red == [1], f"failed-spool stat: red from {red}, expected from 1")


def png_text(path):
    """The tEXt chunks of a PNG file, {keyword: text}."""
    out = {}
    with open(path, "rb") as f:
        data = f.read()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        return out
    i = 8
    while i + 8 <= len(data):
        n = int.from_bytes(data[i:i + 4], "big")
        kind, body = data[i + 4:i + 8], data[i + 8:i + 8 + n]
        if kind == b"tEXt" and b"\0" in body:
            k, v = body.split(b"\0", 1)
            out[k.decode("latin-1")] = v.decode("latin-1")
        i += 12 + n
    return out


def check_picture(panels):
    """docs/dashboard.png, the README's picture, shows every panel of the
    dashboard with data: deploy/grafana/render_png.py records which panels it
    drew values in, and the picture must be of this dashboard."""
    png = os.path.join(REPO, "docs", "dashboard.png")
    shown = png_text(png).get("kvrelay-panels")
    if not check(shown, f"{png}: no kvrelay-panels record; render it with tests/deploy/test_live_prometheus.py "
                        "--traffic-seconds N --png docs/dashboard.png"):
        return
    shown = json.loads(shown)
    titles = [p["title"] for p in panels]
    check(sorted(shown["panels"]) == sorted(titles),
          f"{png} is of another dashboard: its panels {sorted(set(shown['panels']) ^ set(titles))} differ")
    empty = [t for t in titles if t not in shown["drawn"]]
    check(not empty, f"{png}: panels without data: {empty}")


def check_network_row(dash, panels, unit):
    """The relay-to-relay panels sit in a row whose title says network, below it."""
    row = row_titled(dash, "network")
    if not row:
        return
    in_row = in_row_test(dash, row)

    def need(what, pred, units):
        hits = [p for p in find_panel(panels, what, pred)]
        for p in hits:
            check(in_row(p), f"panel {p['title']!r} ({what}) is not in the network row")
            check(unit(p) in units or any(unit(p).startswith(u) for u in units if u.endswith(":")),
                  f"panel {p['title']!r} ({what}) unit {unit(p)!r}, expected one of {units}")
        return hits

    def exprs(p):
        return [squash(t["expr"]) for t in p.get("targets", [])]

    for p in need("bytes on the network vs full KV",
                  lambda e: "rate(kvrelay_forward_bytes_total{" in e, ("Bps", "binBps", "decBps")):
        check(any("rate(kvrelay_forward_full_bytes_total{" in e for e in exprs(p)),
              f"panel {p['title']!r}: forwarded bytes without what full KV would have sent beside them")
        check(any("rate(kvrelay_wire_bytes_total{" in e for e in exprs(p)),
              f"panel {p['title']!r}: forwarded bytes without the wire-coded bytes beside them")
    need("elided bytes", lambda e: "rate(kvrelay_forward_elided_bytes_total{" in e, ("Bps", "binBps", "decBps"))
    for p in need("forward latency", lambda e: re.search(
            r"histogram_quantile\(0\.\d+,sumby\(le\)\(rate\(kvrelay_forward_seconds_bucket\{", e), ("s",)):
        qs = {re.search(r"histogram_quantile\((0\.\d+)", e).group(1) for e in exprs(p) if "kvrelay_forward_seconds" in e}
        check({"0.5", "0.95"} <= qs, f"forward latency panel has quantiles {sorted(qs)}, expected 0.5 and 0.95")
    need("forwards by outcome", lambda e: re.search(r"sumby\(outcome\)\(rate\(kvrelay_forwards_total\{", e),
         ("reqps", "ops", "short", "cps", "suffix:"))
    for p in need("outbox", lambda e: "kvrelay_outbox_bytes{" in e, ("bytes", "decbytes")):
        check(any('kvrelay_limit_bytes{limit="outbox"' in e for e in exprs(p)),
              f"outbox panel {p['title']!r} does not show kvrelay_limit_bytes{{limit=\"outbox\"}}")
        check(any("kvrelay_outbox_messages{" in e for e in exprs(p)), f"outbox panel {p['title']!r} has no message count")
    need("dead letters by code", lambda e: re.search(r"sumby\(code\)\((rate|increase)\(kvrelay_dead_letters_total\{", e),
         ("reqps", "ops", "short", "cps", "suffix:"))


if __name__ == "__main__":
    sys.exit(main())

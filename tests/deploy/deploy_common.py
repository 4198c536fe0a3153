"""Shared helpers of the tests/deploy drivers (stdlib only, /usr/bin/python3).

check() records failures instead of stopping, so one run lists every problem;
finish() prints the summary and gives the exit status. yaml() converts YAML
through tests/deploy/validate_k8s.cjs (the `yaml` npm package), so the drivers
need no Python YAML module. Relay, run, clean_env, port_open,
parse_exposition and stop_process come from tests/testlib/kvrelay_testlib.py
(shared with the other drivers) and are re-exported here.
"""
import json
import os
import re
import socket
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "testlib"))
from kvrelay_testlib import (Server, clean_env, parse_exposition, port_open, run,  # noqa: E402,F401
                             stop_process)

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
DEPLOY = os.path.join(REPO, "deploy")
DASHBOARD = os.path.join(DEPLOY, "grafana", "kvrelay-dashboard.json")
RULES = os.path.join(DEPLOY, "prometheus", "rules", "kvrelay-alerts.yaml")
PROM_CONFIG = os.path.join(DEPLOY, "prometheus", "prometheus.yml")
PROM_TESTS = os.path.join(DEPLOY, "prometheus", "tests")
VALIDATOR = os.path.join(HERE, "validate_k8s.cjs")

FAILURES = []
CHECKS = [0]


def check(cond, what):
    CHECKS[0] += 1
    if not cond:
        FAILURES.append(what)
        print("FAIL:", what, flush=True)
    return bool(cond)


def finish(name):
    if FAILURES:
        print(f"{name}: {len(FAILURES)} of {CHECKS[0]} checks failed", flush=True)
        return 1
    print(f"{name}: all {CHECKS[0]} checks passed", flush=True)
    return 0


class Node:
    """node + the npm ci'd node_modules (NODE_PATH) for validate_k8s.cjs."""

    def __init__(self, node, node_modules):
        self.node, self.node_modules = node, os.path.abspath(node_modules)

    def env(self):
        return clean_env(NODE_PATH=self.node_modules)

    def run(self, *args, timeout=120):
        return run([self.node, VALIDATOR] + list(args), timeout=timeout, env=self.env())

    def yaml(self, path):
        """The documents of a YAML file (YAML 1.1, as Kubernetes and Prometheus read it)."""
        rc, out, err = self.run("yaml2json", path)
        if rc != 0:
            raise RuntimeError(f"yaml2json {path}: rc={rc} {err.strip()}")
        return json.loads(out)


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Relay(Server):
    """A kvrelay-server process on 127.0.0.1; waits for its ready line (kvrelay_testlib.Server)."""

    def __init__(self, binary, workdir, args=(), env=None, name="relay", timeout=30):
        super().__init__(binary, workdir, args=args, env=env, name=name, timeout=timeout)


def parse_bytes(text):
    """kvrelay-server's byte syntax: 4294967296, 4GiB, 512MiB, 1KiB (also kb/mb/gb as powers of 1024)."""
    s = str(text).strip().lower()
    units = {"tib": 1 << 40, "gib": 1 << 30, "mib": 1 << 20, "kib": 1 << 10,
             "tb": 1 << 40, "gb": 1 << 30, "mb": 1 << 20, "kb": 1 << 10, "b": 1}
    for suffix, mult in units.items():
        if s.endswith(suffix):
            return int(float(s[: -len(suffix)]) * mult)
    return int(s)


def parse_quantity(q):
    """A Kubernetes resource quantity in base units (bytes, cores)."""
    s = str(q).strip()
    binary = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50, "Ei": 1 << 60}
    decimal = {"n": 1e-9, "u": 1e-6, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}
    for suffix, mult in binary.items():
        if s.endswith(suffix):
            return float(s[:-2]) * mult
    if s and s[-1] in decimal:
        return float(s[:-1]) * decimal[s[-1]]
    return float(s)


def load_dashboard():
    with open(DASHBOARD) as f:
        return json.load(f)


def dashboard_targets(dash):
    """[(panel, target)] for every query of every panel (rows' nested panels too)."""
    out = []

    def walk(panels):
        for p in panels:
            for t in p.get("targets", []):
                out.append((p, t))
            walk(p.get("panels", []))

    walk(dash.get("panels", []))
    return out


def substitute(expr, rate_interval="5m", instance=".*"):
    """A dashboard expression as Prometheus runs it: Grafana's variables replaced."""
    return (expr.replace("$__rate_interval", rate_interval)
                .replace("${__rate_interval}", rate_interval)
                .replace("${instance}", instance)
                .replace("$instance", instance))


def metric_names_in_source():
    """Metric names server/metrics/metrics.cc registers, with the histograms' series suffixes."""
    with open(os.path.join(REPO, "server", "metrics", "metrics.cc")) as f:
        src = f.read()
    names = set()
    for m in re.finditer(r'\b(Counters|Gauges|Histograms)\(\s*[*\w]+,\s*"([a-z_:]+)"', src):
        kind, name = m.groups()
        names.add(name)
        if kind == "Histograms":
            names.update({name + "_bucket", name + "_sum", name + "_count"})
    return names


PROMQL_KEYWORDS = {
    "sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk", "quantile",
    "count_values", "group", "by", "without", "on", "ignoring", "group_left", "group_right",
    "and", "or", "unless", "bool", "offset", "rate", "irate", "increase", "delta", "idelta",
    "histogram_quantile", "absent", "absent_over_time", "vector", "scalar", "time", "clamp_min",
    "clamp_max", "max_over_time", "min_over_time", "avg_over_time", "sum_over_time",
    "count_over_time", "last_over_time", "label_replace", "label_join", "abs", "ceil", "floor",
    "round", "sort", "sort_desc", "inf", "nan", "le",
}


def metric_names_in_expr(expr):
    """Metric names an expression selects (identifiers before `{` or bare, not label names)."""
    no_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    no_labels = re.sub(r"\{[^}]*\}", "{}", no_strings)
    no_groupings = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", r"\1()", no_labels)
    no_ranges = re.sub(r"\[[^\]]*\]", "[]", no_groupings)
    names = set()
    for m in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", no_ranges):
        word = m.group(0)
        nxt = no_ranges[m.end():m.end() + 1]
        if word.lower() in PROMQL_KEYWORDS or nxt == "(":
            continue
        names.add(word)
    return names

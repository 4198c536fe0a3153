#!/usr/bin/python3
"""deploy/compose/compose.yaml and the Grafana provisioning, checked without Docker.

No Docker engine on the test machines, so the compose file is parsed and
checked for what `docker compose up` would trip over or silently get wrong:
  - the services are kvrelay, prometheus and grafana; depends_on names
    existing services; named volumes are declared;
  - the relay is built from the repository's Dockerfile (context ../..),
    publishes the gRPC and metrics ports it listens on (its command, else
    the Dockerfile's CMD; EXPOSE), names the command the image's HEALTHCHECK
    really runs where a comment describes it, runs read-only without
    capabilities, and every KVRELAY_* variable is one kvrelay-server --help
    lists;
  - secure by default: the Dockerfile's CMD and the compose command each
    serve TLS on a non-loopback --listen, or say --insecure, and compose.yaml
    says in a comment why (its private network); the HEALTHCHECK asks the
    --health-listen port of both;
  - the image's CMD and the compose command (with the compose environment)
    start kvrelay-server as written (the gRPC listener on 0.0.0.0, port 0;
    health on a free loopback port): the HEALTHCHECK's command succeeds
    against the health port, and kvrelay_insecure reads 1 where --insecure
    is given;
  - the relay's spool: one --spool-dir (or KVRELAY_SPOOL_DIR), a
    subdirectory of a writable named volume (declared) that only the relay
    mounts, --max-spool-bytes at least the store limit, --fsync not never;
    the Dockerfile makes the mount point the image user's (a new named
    volume takes its owner); started as written, the relay makes the spool
    (moved into a temporary directory) with mode 0700, and
    kvrelay_spool_failed reads 0;
  - every bind mount's host path exists in the repository; Prometheus reads
    its --config.file where deploy/prometheus/prometheus.yml is mounted, and
    the rules directory lands where that config's rule_files glob looks;
  - prometheus.yml scrapes job "kvrelay" at the relay service's metrics port;
  - Grafana's datasource provisioning points at the prometheus service with
    a fixed uid and is the default (the dashboard's datasource variable picks
    it); the dashboard provider is a file provider whose path is where
    kvrelay-dashboard.json is mounted.
"""
import argparse
import fnmatch
import json
import os
import posixpath
import re
import shutil
import stat
import sys
import tempfile
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from deploy_common import (DEPLOY, REPO, Node, Relay, check, clean_env, finish, free_port,  # noqa: E402
                           parse_bytes, parse_exposition, run)

COMPOSE = os.path.join(DEPLOY, "compose", "compose.yaml")


def port_map(entries):
    """{container_port: host_port} of a compose `ports:` list (short or long syntax)."""
    out = {}
    for p in entries or []:
        if isinstance(p, dict):
            out[int(p["target"])] = int(p.get("published", p["target"]))
            continue
        parts = str(p).split(":")
        cport = int(parts[-1].split("/")[0])
        out[cport] = int(parts[-2]) if len(parts) >= 2 else cport
    return out


def mounts(service):
    """[(source, target, read_only)] of a service's volumes (short or long syntax)."""
    out = []
    for v in service.get("volumes") or []:
        if isinstance(v, dict):
            out.append((v.get("source"), v["target"], bool(v.get("read_only"))))
        else:
            parts = str(v).split(":")
            out.append((parts[0], parts[1], len(parts) > 2 and "ro" in parts[2].split(",")))
    return out


def parse_flags(argv):
    """{flag: [values]} of a kvrelay-server argument list: --flag=value, --flag value, or a
    boolean --flag (followed by another flag or nothing), whose value is ""."""
    out = {}
    i = 0
    while i < len(argv):
        a = str(argv[i])
        if a.startswith("--") and "=" in a:
            k, v = a[2:].split("=", 1)
        elif a.startswith("--") and i + 1 < len(argv) and not str(argv[i + 1]).startswith("--"):
            k, v = a[2:], str(argv[i + 1])
            i += 1
        else:
            k, v = a.lstrip("-"), ""
        out.setdefault(k, []).append(v)
        i += 1
    return out


def is_loopback(addr):
    host = addr.rsplit(":", 1)[0].strip("[]")
    return addr.startswith("unix:") or host in ("localhost", "::1") or host.startswith("127.")


def check_secure_default(what, flags):
    """A non-loopback --listen without --tls-cert/--tls-key needs --insecure (kvrelay-server exits 2)."""
    plain = [a for a in flags.get("listen", []) if not is_loopback(a)]
    tls = flags.get("tls-cert") and flags.get("tls-key")
    check(not plain or tls or "insecure" in flags,
          f"{what}: --listen {plain} in plaintext without --insecure or --tls-cert/--tls-key: the relay exits 2")
    return bool(plain and not tls)


def env_of(service):
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(e.split("=", 1) for e in env)
    return {k: str(v) for k, v in env.items()}


def start_as_written(server, work, what, argv, env, hc_argv):
    """kvrelay-server with ARGV as the container would run it: TCP listeners on port 0 of the
    same host (0.0.0.0 stays 0.0.0.0), the health port on a free loopback port; then the
    HEALTHCHECK's command (its port moved there) and the insecure gauge."""
    health_port = free_port()
    moved = []
    spool = None
    for k, values in parse_flags(argv).items():
        for v in values:
            if k in ("listen", "metrics-listen") and not v.startswith("unix:"):
                v = v.rsplit(":", 1)[0] + ":0"
            elif k == "health-listen":
                v = f"127.0.0.1:{health_port}"
            elif k == "spool-dir":  # below a fresh directory, as below the volume's mount point
                spool = v = os.path.join(tempfile.mkdtemp(dir=work), "spool")
            moved.append(f"--{k}" + (f"={v}" if v else ""))
    if env.get("KVRELAY_SPOOL_DIR") and spool is None:
        spool = env["KVRELAY_SPOOL_DIR"] = os.path.join(tempfile.mkdtemp(dir=work), "spool")
    try:
        r = Relay(server, work, args=moved, env=env, name="relay-" + re.sub(r"\W+", "-", what))
    except RuntimeError as e:
        check(False, f"kvrelay-server refuses {what} ({moved}): {e}")
        return
    try:
        if hc_argv:
            hc = [server] + [re.sub(r":\d+$", f":{health_port}", a) if re.fullmatch(r"[\d.]+:\d+", a) else a
                             for a in hc_argv[1:]]
            rc, out, err = run(hc, timeout=30)
            check(rc == 0, f"{what}: the HEALTHCHECK ({' '.join(hc[1:])}) failed: rc={rc} {(out + err).strip()}")
        with urllib.request.urlopen(f"http://{r.metrics}/metrics", timeout=10) as resp:
            samples = parse_exposition(resp.read().decode())
        want = 1 if "insecure" in parse_flags(argv) else 0
        got = samples.get(("kvrelay_insecure", frozenset()))
        check(got == want, f"{what}: kvrelay_insecure = {got}, expected {want}")
        if spool:
            mode = stat.S_IMODE(os.stat(spool).st_mode) if os.path.isdir(spool) else None
            check(mode == 0o700, f"{what}: the spool directory: mode {mode and oct(mode)}, expected 0o700")
            check(os.path.isfile(os.path.join(spool, "journal")), f"{what}: the relay made no spool journal")
            got = samples.get(("kvrelay_spool_failed", frozenset()))
            check(got == 0, f"{what}: kvrelay_spool_failed = {got}, expected 0")
    finally:
        check(r.stop() == 0, f"the relay with {what} did not exit 0 on SIGTERM")


def check_spool(doc, relay, flags, env, dockerfile):
    """The relay's spool on a named volume of its own, in a subdirectory the relay creates (mode
    0700), bounded, synced; the image's mount point owned by its user, since a new named volume
    takes the owner and mode of the directory it is mounted on."""
    dirs = flags.get("spool-dir") or ([env["KVRELAY_SPOOL_DIR"]] if env.get("KVRELAY_SPOOL_DIR") else [])
    if not check(len(dirs) == 1 and dirs[0].startswith("/"), f"kvrelay: one --spool-dir /ABSOLUTE/PATH, got {dirs}"):
        return
    fsync = (flags.get("fsync") or [env.get("KVRELAY_FSYNC", "always")])[-1]
    check(fsync == "always", f"kvrelay: --fsync={fsync}: the stack syncs (never is for benchmarks)")
    ms = [(src, t, ro) for src, t, ro in mounts(relay) if dirs[0].startswith(t.rstrip("/") + "/")]
    if not check(len(ms) == 1, f"kvrelay: --spool-dir {dirs[0]} is on {len(ms)} volumes below it, expected one "
                 "(the mount point itself is not enough: the relay makes and owns the spool directory)"):
        return
    src, target, ro = ms[0]
    check(not src.startswith((".", "/")) and src in (doc.get("volumes") or {}),
          f"kvrelay: the spool's volume {src} should be a declared named volume (it outlives the container)")
    check(not ro, "kvrelay: the spool's volume is mounted read-only")
    for name, s in (doc.get("services") or {}).items():
        if s is not relay:
            check(src not in {m[0] for m in mounts(s)}, f"{name} mounts the relay's spool volume {src}")
    limit = (flags.get("max-spool-bytes") or [env.get("KVRELAY_MAX_SPOOL_BYTES")])[-1]
    store = (flags.get("max-store-bytes") or [env.get("KVRELAY_MAX_STORE_BYTES")])[-1]
    if check(limit, "kvrelay: no --max-spool-bytes (KVRELAY_MAX_SPOOL_BYTES): the spool would fill the disk"):
        check(not store or parse_bytes(limit) >= parse_bytes(store),
              f"kvrelay: the spool limit {limit} is below the store limit {store}")
    owned = re.search(r"^RUN\b.*\bmkdir\b[^&]*\s" + re.escape(target) + r"\b.*\bchown\s+65532:65532\s+"
                      + re.escape(target) + r"\b", dockerfile, re.M)
    check(owned, f"Dockerfile: no RUN that makes {target} (the spool volume's mount point) and chowns it to "
          "65532:65532: a new named volume would be root's and the relay could not write it")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--node", default=shutil.which("node"))
    ap.add_argument("--node-modules", required=True)
    ap.add_argument("--server", required=True)
    args = ap.parse_args()
    node = Node(args.node, args.node_modules)
    base = os.path.dirname(COMPOSE)
    doc = node.yaml(COMPOSE)[0]
    services = doc.get("services") or {}
    check(set(services) == {"kvrelay", "prometheus", "grafana"}, f"compose services {sorted(services)}")
    check("version" not in doc, "compose.yaml has the obsolete top-level `version`")
    for name, s in services.items():
        for dep in (s.get("depends_on") or []):
            check(dep in services, f"{name} depends on unknown service {dep}")
        check(s.get("image") or s.get("build"), f"{name}: neither image nor build")
        for src, target, ro in mounts(s):
            if src.startswith((".", "/")):
                host = os.path.normpath(os.path.join(base, src))
                check(os.path.exists(host), f"{name}: bind mount source {src} ({host}) does not exist")
                check(host.startswith(REPO + os.sep), f"{name}: bind mount {src} leaves the repository")
                check(ro, f"{name}: bind mount {src} should be read-only")
            else:
                check(src in (doc.get("volumes") or {}), f"{name}: named volume {src} is not declared")

    # The relay: the repository's Dockerfile, its ports, locked down, a valid environment.
    relay = services.get("kvrelay", {})
    build = relay.get("build") or {}
    build = {"context": build} if isinstance(build, str) else build
    ctx = os.path.normpath(os.path.join(base, build.get("context", ".")))
    dockerfile = os.path.join(ctx, build.get("dockerfile", "Dockerfile"))
    check(ctx == REPO, f"kvrelay build context {ctx}, expected the repository root {REPO}")
    check(os.path.isfile(dockerfile), f"kvrelay Dockerfile {dockerfile} missing")
    with open(os.path.join(REPO, "Dockerfile")) as f:
        df = f.read()
    exposed = {int(p) for line in re.findall(r"^EXPOSE\s+(.+)$", df, re.M) for p in line.split()}
    cmd = re.search(r"^CMD\s+(\[.*\])\s*$", df, re.M)
    cmd_args = json.loads(cmd.group(1)) if cmd else []  # the exec (JSON) form
    compose_cmd = relay.get("command")
    compose_cmd = compose_cmd.split() if isinstance(compose_cmd, str) else compose_cmd
    relay_args = compose_cmd if compose_cmd else cmd_args
    image_flags, flags = parse_flags(cmd_args), parse_flags(relay_args)
    listen = [a for a in flags.get("listen", ["0.0.0.0:50051"]) if not a.startswith("unix:")]
    check(len(listen) == 1, f"kvrelay: --listen {listen}: expected one TCP address")
    grpc_port = int(listen[0].rsplit(":", 1)[1])
    metrics_port = int(flags.get("metrics-listen", ["0.0.0.0:9464"])[-1].rsplit(":", 1)[1])
    check({grpc_port, metrics_port} <= exposed, f"Dockerfile EXPOSE {exposed} lacks {grpc_port}/{metrics_port}")
    ports = port_map(relay.get("ports"))
    check(grpc_port in ports and metrics_port in ports, f"kvrelay publishes {ports}, expected {grpc_port} and {metrics_port}")
    check(relay.get("read_only") is True, "kvrelay: read_only is not true")
    check("ALL" in (relay.get("cap_drop") or []), "kvrelay: cap_drop lacks ALL")
    check(any(str(o).startswith("no-new-privileges") for o in relay.get("security_opt") or []),
          "kvrelay: no no-new-privileges")
    # Secure by default: plaintext on the network only with --insecure, and compose says why.
    with open(COMPOSE) as f:
        compose_text = f.read()
    check_secure_default("Dockerfile CMD", image_flags)
    if compose_cmd and check_secure_default("compose kvrelay command", flags):
        comments = " ".join(re.findall(r"#\s*(.*)", compose_text))
        check(re.search(r"--insecure\b.*\bprivate network", comments),
              "compose.yaml: the kvrelay command uses --insecure without a comment saying so (its private network)")
    # A comment naming what the image's HEALTHCHECK runs must name what the Dockerfile runs.
    hc = re.search(r"^HEALTHCHECK\b.*?\bCMD\s+(\[.*\])\s*$", df.replace("\\\n", " "), re.M)
    hc_argv = []
    if check(hc, "Dockerfile: no HEALTHCHECK ... CMD [...] (exec form)"):
        hc_argv = json.loads(hc.group(1))
        hc_addr = parse_flags(hc_argv[2:]).get("addr", ["127.0.0.1:50051"])[-1]
        check(hc_argv[1:2] == ["health"], f"Dockerfile HEALTHCHECK {hc_argv}: expected kvrelay-server health")
        for what, fl in (("Dockerfile CMD", image_flags), ("compose kvrelay command", flags)):
            health = fl.get("health-listen", [])
            check(len(health) == 1 and health[0].rsplit(":", 1)[1] == hc_addr.rsplit(":", 1)[1]
                  and (is_loopback(health[0]) or health[0].startswith("0.0.0.0:")),
                  f"{what}: --health-listen {health}; the HEALTHCHECK asks {hc_addr} (the health port: the gRPC "
                  "port may serve only TLS)")
        hc_cmd = " ".join([os.path.basename(hc_argv[0])] + hc_argv[1:])
        said = re.findall(r"HEALTHCHECK runs\s+`([^`]+)`", re.sub(r"\n\s*#\s*", " ", compose_text))
        for s_ in said:
            check(s_ == hc_cmd, f"compose.yaml says the image's HEALTHCHECK runs `{s_}`; the Dockerfile runs `{hc_cmd}`")
        if not relay.get("healthcheck"):
            check(said, "compose.yaml: the kvrelay service relies on the image's HEALTHCHECK; say what it runs")
    env = env_of(relay)
    rc, help_text, _ = run([args.server, "--help"])
    known = set(re.findall(r"\b(KVRELAY_[A-Z0-9_]+)\b", help_text))
    for k in env:
        check(k in known, f"kvrelay: environment {k} is not one kvrelay-server --help lists")
    check(not {"KVRELAY_LISTEN", "KVRELAY_METRICS_LISTEN"} & set(env), "kvrelay: the environment moves the listen ports")
    check_spool(doc, relay, flags, env, df)
    with tempfile.TemporaryDirectory(prefix="kvrelay-compose-") as work:
        for what, argv, run_env in (("the image's CMD", cmd_args, clean_env()),
                                    ("the compose command and environment", relay_args, clean_env(**env))):
            start_as_written(args.server, work, what, argv, run_env, hc_argv)

    # Prometheus: config and rules where the config expects them; the scrape target.

    prom = services.get("prometheus", {})
    pm = {t: os.path.normpath(os.path.join(base, s)) for s, t, _ in mounts(prom) if s.startswith(".")}
    cfg_flag = next((a.split("=", 1)[1] for a in prom.get("command") or [] if a.startswith("--config.file=")),
                    "/etc/prometheus/prometheus.yml")
    check(pm.get(cfg_flag) == os.path.join(DEPLOY, "prometheus", "prometheus.yml"),
          f"prometheus: {cfg_flag} is not deploy/prometheus/prometheus.yml ({pm.get(cfg_flag)})")
    check(9090 in port_map(prom.get("ports")), "prometheus: port 9090 not published")
    pconf = node.yaml(os.path.join(DEPLOY, "prometheus", "prometheus.yml"))[0]
    cfg_dir = posixpath.dirname(cfg_flag)
    local_rules = sorted(os.path.relpath(os.path.join(dp, f), os.path.join(DEPLOY, "prometheus"))
                         for dp, _, fs in os.walk(os.path.join(DEPLOY, "prometheus", "rules")) for f in fs)
    for glob_ in pconf.get("rule_files") or []:
        check(not glob_.startswith("/"), f"prometheus.yml rule_files {glob_} should be relative to the config")
        target = posixpath.join(cfg_dir, glob_)
        mounted_dir = posixpath.dirname(target)
        check(pm.get(mounted_dir) == os.path.join(DEPLOY, "prometheus", posixpath.dirname(glob_)),
              f"prometheus: rule_files {glob_} looks in {mounted_dir}, where {pm.get(mounted_dir)} is mounted")
        check([r for r in local_rules if fnmatch.fnmatch(r, glob_)], f"rule_files {glob_} matches no rule file")
    jobs = {j["job_name"]: j for j in pconf.get("scrape_configs") or []}
    if check("kvrelay" in jobs, f"prometheus.yml jobs {sorted(jobs)}: no job kvrelay (the alerts select job=\"kvrelay\")"):
        targets = [t for sc in jobs["kvrelay"].get("static_configs") or [] for t in sc.get("targets") or []]
        check(targets == [f"kvrelay:{metrics_port}"], f"job kvrelay targets {targets}, expected kvrelay:{metrics_port}")
        check(jobs["kvrelay"].get("metrics_path", "/metrics") == "/metrics", "job kvrelay metrics_path")

    # Grafana: datasource and dashboard provisioning match the mounts.
    graf = services.get("grafana", {})
    gm = {t: os.path.normpath(os.path.join(base, s)) for s, t, _ in mounts(graf) if s.startswith(".")}
    check(3000 in port_map(graf.get("ports")), "grafana: port 3000 not published")
    ds_dir = gm.get("/etc/grafana/provisioning/datasources")
    db_dir = gm.get("/etc/grafana/provisioning/dashboards")
    check(ds_dir and db_dir, f"grafana: provisioning directories not mounted ({sorted(gm)})")
    if ds_dir:
        dss = [d for f in sorted(os.listdir(ds_dir)) for d in node.yaml(os.path.join(ds_dir, f))[0].get("datasources", [])]
        proms = [d for d in dss if d.get("type") == "prometheus"]
        check(len(proms) == 1, f"grafana: {len(proms)} prometheus datasources provisioned")
        for d in proms:
            check(re.fullmatch(r"[a-zA-Z0-9_-]{1,40}", str(d.get("uid", ""))), f"datasource uid {d.get('uid')!r} not fixed")
            check(d.get("url") == "http://prometheus:9090", f"datasource url {d.get('url')}")
            check(d.get("isDefault") is True, "the prometheus datasource is not the default")
    if db_dir:
        provs = [p for f in sorted(os.listdir(db_dir)) for p in node.yaml(os.path.join(db_dir, f))[0].get("providers", [])]
        check(len(provs) == 1 and provs[0].get("type") == "file", f"grafana dashboard providers {provs}")
        for p in provs:
            path = (p.get("options") or {}).get("path")
            files = {posixpath.dirname(t): s for t, s in gm.items() if s.endswith(".json")}
            check(files.get(path) == os.path.join(DEPLOY, "grafana", "kvrelay-dashboard.json"),
                  f"dashboard provider path {path} does not hold deploy/grafana/kvrelay-dashboard.json ({files})")
        home = env_of(graf).get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH")
        if home:
            check(gm.get(home) == os.path.join(DEPLOY, "grafana", "kvrelay-dashboard.json"),
                  f"GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH {home} is not the mounted dashboard")
    return finish("deploy_compose")


if __name__ == "__main__":
    sys.exit(main())

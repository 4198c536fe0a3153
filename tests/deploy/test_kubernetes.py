#!/usr/bin/python3
"""deploy/kubernetes: kustomize builds, schema validation and our own checks.

For the base and every overlay under deploy/kubernetes/overlays:
  1. `kubectl kustomize DIR` (or `kustomize build DIR`) builds, without a
     deprecation warning (each tool given, kustomize v4 or newer; more through
     KVRELAY_DEPLOY_EXTRA_KUBECTL=path[:path], a kubectl or a kustomize, and
     the builds must agree);
  2. every rendered object validates against the Kubernetes 1.31 and
     prometheus-operator schemas (npm kubernetes-models,
     @kubernetes-models/prometheus-operator) and type-checks against their
     TypeScript interfaces (unknown fields, enum values): validate_k8s.cjs;
  3. our checks of what schemas cannot see: the relay is a native sidecar
     (an init container with restartPolicy Always), its startup, readiness
     and liveness probes are grpc probes on its plaintext --health-listen
     port (0.0.0.0, not the TLS gRPC port: the kubelet cannot do TLS), ports
     named by the PodMonitor and Service exist (and the Service does not name
     a sidecar port, which endpoints ignore before Kubernetes 1.32),
     selectors match the pod template, the security context is the image's
     non-root user 65532 with a read-only root filesystem and no
     capabilities, the byte limits fit the memory limit, every KVRELAY_*
     variable and flag is one kvrelay-server --help lists, the PrometheusRule
     equals deploy/prometheus/rules/kvrelay-alerts.yaml (and the generated file
     is current), the dashboard ConfigMap is labelled grafana_dashboard: "1"
     and holds deploy/grafana/kvrelay-dashboard.json byte for byte;
     a NetworkPolicy selects the relay pods and, evaluated by the
     NetworkPolicy rules, admits the sidecar's gRPC port (a number, the
     sidecar's `grpc` port) only from kvrelay pods of the namespace and its
     metrics port only from the monitoring namespace, egress open;
     a `sh -c` loop in an agent container traps TERM and sleeps with
     `sleep & wait` (it is PID 1: without a handler it ignores SIGTERM and the
     relay loses its drain), and, where PID namespaces are available
     (unshare), run as PID 1 it exits on SIGTERM; overlays run no
     `kvrelayctl demo` agent and not the relay image as the agent;
     the mesh: the agents are a StatefulSet whose serviceName is the headless
     Service selecting them (pod names are DNS labels); the relay listens
     on 0.0.0.0 on its gRPC port and on a unix: socket (--local-listen) in an
     emptyDir that every agent container mounts and names in KVRELAY_ADDR; its
     --route-template is dns:///{agent}.<that Service>.<namespace, literal or
     the downward API's>.svc.cluster.local:<grpc port>, its --advertise is
     what the template gives its own pod (expanded as the kubelet expands
     $(VAR)), every --route names a DNS label, and the NetworkPolicy admits
     a peer relay on the template's port; the outbox limits fit the memory
     limit, the per-destination one below the total;
     transport security: no container listens on a non-loopback plaintext
     address (TLS, and no --insecure shipped), local listeners are loopback
     or unix:; certificate, key and CA come from one whole, read-only volume
     with the file names its source writes: cert-manager's csi-driver
     (driver csi.cert-manager.io, an issuer name and kind, dns-names with
     ${POD_NAME}/${POD_NAMESPACE} giving the pod's --advertise name, server
     and client auth, fs-group = the relay's group) in the base and
     production, a Secret (tls.crt, tls.key, ca.crt) in
     overlays/no-cert-manager; --peer-identity admits another pod of the
     StatefulSet and not a name of another Service or namespace; the tokens
     file is a Secret volume; Secret files are readable by the relay's group
     (fsGroup) and nobody else; no other container mounts any of it;
     examples/ca-issuer.yaml makes the issuer the csi-driver volume names;
     the spool: one --spool-dir, a subdirectory of a writable volume mounted
     by the relay alone (the relay makes it 0700 and must own it; the
     volume's root is writable through the pod's fsGroup, the relay's
     group), --fsync not never, --max-spool-bytes at least the store limit
     and at most 90% of the volume; the volume an emptyDir on disk with a
     sizeLimit in the base, a PersistentVolumeClaim of the StatefulSet's
     volumeClaimTemplates (ReadWriteOnce, the base's emptyDir removed,
     fsGroupChangePolicy OnRootMismatch) in production and the overlays on
     it; the startup probe waits long enough to read a full spool at
     100 MiB/s;
  4. kvrelay-server accepts the sidecar's rendered args and environment
     ($(VAR)s expanded for pod kvrelay-agent-0 in namespace apps, TCP listen
     addresses moved to 127.0.0.1 (the health port to a free port), the Unix
     socket into a temporary directory, a CA and the pod's certificate for
     the names its volume requests, and a tokens file, made where the flags
     read them), creates its socket, exports the configured limits (the
     outbox's too) as kvrelay_limit_bytes and kvrelay_insecure 0, makes its
     spool (--spool-dir moved into a temporary directory: mode 0700, with
     LOCK, journal, msg/ and quarantine/; kvrelay_spool_failed 0), answers a
     plaintext grpc.health.v1 check SERVING on the health port and refuses
     one on the TLS gRPC port.
"""
import argparse
import copy
import glob
import hashlib
import json
import math
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from deploy_common import (DEPLOY, REPO, RULES, Node, Relay, check, clean_env, finish, free_port,  # noqa: E402
                           parse_bytes, parse_exposition, parse_quantity, run)
from certs import TestPki  # noqa: E402  (tests/testlib, put on the path by deploy_common)

K8S = os.path.join(DEPLOY, "kubernetes")
IMAGE_USER = None  # from the Dockerfile's USER line


def dockerfile_user():
    with open(os.path.join(REPO, "Dockerfile")) as f:
        users = re.findall(r"^USER\s+(\d+)(?::(\d+))?\s*$", f.read(), re.M)
    return (int(users[-1][0]), int(users[-1][1] or users[-1][0])) if users else None


def server_help(server):
    rc, out, err = run([server, "--help"], timeout=30)
    check(rc == 0, f"kvrelay-server --help: rc={rc} {err.strip()}")
    # Every --flag in the option column (a line may name two: "--tls-cert FILE --tls-key FILE").
    flags = {f for col in re.findall(r"^[ \t]{1,4}(--\S.*?)(?:[ \t]{2,}|$)", out, re.M)
             for f in re.findall(r"(?:^|\s)--([a-z0-9-]+)", col)}
    envs = set(re.findall(r"\b(KVRELAY_[A-Z0-9_]+)\b", out))
    return flags, envs


def is_kustomize(tool):
    """A kustomize binary (`kustomize build`) rather than a kubectl (`kubectl kustomize`)."""
    return os.path.basename(tool).startswith("kustomize")


def kustomize(tool, path, workdir, tag):
    argv = [tool, "build", path] if is_kustomize(tool) else [tool, "kustomize", path]
    what = f"{' '.join(argv[:2])} {os.path.relpath(path, REPO)}"
    rc, out, err = run(argv, timeout=120)
    if not check(rc == 0, f"{what}: rc={rc} {err.strip()}"):
        return None
    # No field kustomize has deprecated (`bases`, `patchesStrategicMerge`, ...).
    for line in err.splitlines():
        if line.strip():
            check("deprecat" not in line.lower(), f"{what}: {line.strip()}")
            print(f"note: {what}: {line}")
    f = os.path.join(workdir, f"{tag}.yaml")
    with open(f, "w") as fh:
        fh.write(out)
    return f


def normalized(objs):
    """Objects with lists of named things (env, containers, ports) sorted, for comparing builds."""
    def norm(v):
        if isinstance(v, dict):
            return {k: norm(x) for k, x in sorted(v.items())}
        if isinstance(v, list):
            items = [norm(x) for x in v]
            if items and all(isinstance(x, dict) and "name" in x for x in items):
                items.sort(key=lambda x: str(x["name"]))
            return items
        return v
    return sorted((norm(o) for o in objs), key=lambda o: (o.get("kind", ""), o["metadata"].get("name", "")))


def by_kind(objs, kind):
    return [o for o in objs if o.get("kind") == kind]


def matches(selector, labels):
    return all(labels.get(k) == v for k, v in (selector or {}).items())


def effective_security(pod_spec, container):
    """The container's security context with the pod-level defaults it inherits."""
    eff = {}
    pod = pod_spec.get("securityContext") or {}
    for k in ("runAsUser", "runAsGroup", "runAsNonRoot", "seccompProfile"):
        if k in pod:
            eff[k] = pod[k]
    eff.update(container.get("securityContext") or {})
    return eff


def container_ports(pod_spec):
    """{name: (containerPort, container, is_init)} for every named port in the pod."""
    ports = {}
    for is_init, key in ((False, "containers"), (True, "initContainers")):
        for c in pod_spec.get(key) or []:
            for p in c.get("ports") or []:
                if "name" in p:
                    check(p["name"] not in ports, f"port name {p['name']} used twice in the pod")
                    ports[p["name"]] = (p["containerPort"], c, is_init)
    return ports


def flag_values(container, flag):
    """Every value of a (repeatable) kvrelay-server flag in the container's args, in order."""
    values = []
    args = list(container.get("args") or []) + list(container.get("command") or [])
    for i, a in enumerate(args):
        if a == f"--{flag}" and i + 1 < len(args):
            values.append(args[i + 1])
        elif a.startswith(f"--{flag}="):
            values.append(a.split("=", 1)[1])
    return values


def listen_values(container, flag, env_name, default):
    """The addresses a kvrelay-server flag or its environment variable sets (flags win)."""
    values = flag_values(container, flag)
    if not values:
        env = {e["name"]: e.get("value") for e in container.get("env") or []}
        values = [v for v in (env.get(env_name) or "").split(",") if v] or [default]
    return values


def listen_port(container, flag, env_name, default):
    """The TCP port a kvrelay-server listen flag or its environment variable sets (flags win);
    unix:PATH addresses have none."""
    tcp = [v for v in listen_values(container, flag, env_name, default) if not v.startswith("unix:")]
    check(len(tcp) == 1, f"container {container.get('name')}: --{flag} {tcp}: expected one TCP address")
    return int(tcp[0].rsplit(":", 1)[1]) if tcp else None


def byte_limit(container, name):
    """A byte limit --max-NAME-bytes, or its KVRELAY_MAX_NAME_BYTES variable (flags win), or None."""
    flag = f"max-{name.replace('_', '-')}-bytes"
    values = flag_values(container, flag)
    if values:
        return parse_bytes(values[-1])
    env = {e["name"]: e.get("value") for e in container.get("env") or []}
    v = env.get(f"KVRELAY_MAX_{name.upper()}_BYTES")
    return parse_bytes(v) if v else None


def check_sidecar(tag, pod_spec, flags, envs):
    inits = pod_spec.get("initContainers") or []
    relays = [c for c in inits if c.get("name") == "kvrelay"]
    if not check(len(relays) == 1, f"{tag}: one init container named kvrelay (the native sidecar), got {len(relays)}"):
        return None
    relay = relays[0]
    check(relay.get("restartPolicy") == "Always",
          f"{tag}: the kvrelay init container has restartPolicy {relay.get('restartPolicy')!r}, "
          "expected 'Always' (a native sidecar; without it the pod never starts its agent)")
    for c in inits:
        check(c.get("restartPolicy") in (None, "Always"),
              f"{tag}: init container {c['name']}: restartPolicy {c.get('restartPolicy')!r} (only 'Always' is valid)")
    check(pod_spec.get("restartPolicy") in (None, "Always"),
          f"{tag}: pod restartPolicy {pod_spec.get('restartPolicy')!r} (a workload's pods restart Always)")
    check(relay.get("image"), f"{tag}: the sidecar has no image")

    # Ports and probes: grpc probes on the port --listen serves.
    ports = {p.get("name"): p for p in relay.get("ports") or []}
    grpc_port = listen_port(relay, "listen", "KVRELAY_LISTEN", "0.0.0.0:50051")
    metrics_port = listen_port(relay, "metrics-listen", "KVRELAY_METRICS_LISTEN", "0.0.0.0:9464")
    check("grpc" in ports and ports["grpc"]["containerPort"] == grpc_port,
          f"{tag}: sidecar port 'grpc' should be {grpc_port} (--listen), got {ports.get('grpc')}")
    check("metrics" in ports and ports["metrics"]["containerPort"] == metrics_port,
          f"{tag}: sidecar port 'metrics' should be {metrics_port} (--metrics-listen), got {ports.get('metrics')}")
    for p in relay.get("ports") or []:
        check(p.get("protocol", "TCP") == "TCP", f"{tag}: sidecar port {p.get('name')}: protocol {p.get('protocol')}")
    # The kubelet's gRPC probes cannot do TLS: they go to the plaintext health port
    # (--health-listen, grpc.health.v1 alone), on the pod IP, never to the TLS gRPC port.
    health = flag_values(relay, "health-listen")
    health_port = None
    if check(len(health) == 1, f"{tag}: the sidecar should set one --health-listen (the kubelet's probes), "
             f"sets {health}"):
        host, _, port = health[0].rpartition(":")
        check(host in ("0.0.0.0", "[::]", "::") and port.isdigit(),
              f"{tag}: --health-listen {health[0]!r}: the kubelet dials the pod IP, expected 0.0.0.0:PORT")
        health_port = int(port) if port.isdigit() else None
        check(health_port not in (grpc_port, metrics_port),
              f"{tag}: --health-listen port {health_port} is the gRPC or metrics port")
        check("health" in ports and ports["health"]["containerPort"] == health_port,
              f"{tag}: sidecar port 'health' should be {health_port} (--health-listen), got {ports.get('health')}")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        pr = relay.get(probe)
        if not check(isinstance(pr, dict), f"{tag}: the sidecar has no {probe}"):
            continue
        handlers = [h for h in ("grpc", "httpGet", "tcpSocket", "exec") if h in pr]
        check(handlers == ["grpc"], f"{tag}: {probe} handlers {handlers}, expected exactly ['grpc'] (grpc.health.v1)")
        g = pr.get("grpc") or {}
        check(g.get("port") == health_port,
              f"{tag}: {probe}.grpc.port {g.get('port')!r} should be the health port {health_port} (--health-listen: "
              f"the kubelet cannot do TLS, and the gRPC port {grpc_port} serves only TLS)")
        check(g.get("service", "") in ("", "kvrelay.v1.Relay"),
              f"{tag}: {probe}.grpc.service {g.get('service')!r}: the relay reports '' and kvrelay.v1.Relay")
        for k in ("periodSeconds", "failureThreshold", "timeoutSeconds", "initialDelaySeconds"):
            if k in pr:
                check(isinstance(pr[k], int) and pr[k] >= (0 if k == "initialDelaySeconds" else 1),
                      f"{tag}: {probe}.{k} = {pr[k]!r}")
    lp, sp = relay.get("livenessProbe") or {}, relay.get("startupProbe") or {}
    check(sp.get("periodSeconds", 10) * sp.get("failureThreshold", 3) >= 10,
          f"{tag}: the startup probe gives the relay under 10 s to start")
    check(lp.get("failureThreshold", 3) >= 2, f"{tag}: the liveness probe kills the relay after one failure")

    # Security context: the image's numeric non-root user, nothing writable, no capabilities.
    sec = effective_security(pod_spec, relay)
    if IMAGE_USER:
        check(sec.get("runAsUser") == IMAGE_USER[0] and sec.get("runAsGroup", IMAGE_USER[1]) == IMAGE_USER[1],
              f"{tag}: sidecar runs as {sec.get('runAsUser')}:{sec.get('runAsGroup')}, "
              f"the Dockerfile's USER is {IMAGE_USER[0]}:{IMAGE_USER[1]}")
    check(sec.get("runAsNonRoot") is True, f"{tag}: sidecar runAsNonRoot is {sec.get('runAsNonRoot')!r}")
    check(sec.get("readOnlyRootFilesystem") is True, f"{tag}: sidecar readOnlyRootFilesystem is not true")
    check(sec.get("allowPrivilegeEscalation") is False, f"{tag}: sidecar allowPrivilegeEscalation is not false")
    caps = sec.get("capabilities") or {}
    check("ALL" in (caps.get("drop") or []), f"{tag}: sidecar does not drop ALL capabilities")
    check(not caps.get("add"), f"{tag}: sidecar adds capabilities {caps.get('add')}")
    check(sec.get("privileged") in (None, False), f"{tag}: sidecar is privileged")
    check((sec.get("seccompProfile") or {}).get("type") in ("RuntimeDefault", "Localhost"),
          f"{tag}: no seccomp profile (RuntimeDefault)")

    # Flags and environment variables the server knows.
    for a in relay.get("args") or []:
        if a.startswith("--"):
            name = a[2:].split("=", 1)[0]
            check(name in flags, f"{tag}: sidecar arg {a!r}: kvrelay-server --help has no --{name}")
    for e in relay.get("env") or []:
        if e["name"].startswith("KVRELAY_"):
            check(e["name"] in envs, f"{tag}: sidecar env {e['name']}: kvrelay-server --help does not list it")
        vf = e.get("valueFrom") or {}
        if "resourceFieldRef" in vf:
            check(vf["resourceFieldRef"].get("containerName") in (None, relay["name"]),
                  f"{tag}: env {e['name']} reads another container's resources")

    # Resources: requests and limits everywhere; the byte limits fit the memory limit.
    for c in (pod_spec.get("containers") or []) + inits:
        res = c.get("resources") or {}
        for kind in ("requests", "limits"):
            for r in ("cpu", "memory"):
                check(r in (res.get(kind) or {}), f"{tag}: container {c['name']} has no {kind}.{r}")
        if "memory" in (res.get("requests") or {}) and "memory" in (res.get("limits") or {}):
            check(parse_quantity(res["requests"]["memory"]) <= parse_quantity(res["limits"]["memory"]),
                  f"{tag}: container {c['name']}: memory request above its limit")
        if c is not relay:
            s = effective_security(pod_spec, c)
            check(s.get("runAsNonRoot") is True and s.get("allowPrivilegeEscalation") is False
                  and "ALL" in ((s.get("capabilities") or {}).get("drop") or []),
                  f"{tag}: container {c['name']} is less locked down than the sidecar")
    env = {e["name"]: e.get("value") for e in relay.get("env") or []}
    limits = {k: byte_limit(relay, k) for k in ("inflight", "mailbox", "session", "store", "outbox",
                                                 "outbox_per_destination")}
    limits = {k: v for k, v in limits.items() if v is not None}
    check({"inflight", "mailbox", "session", "store"} <= set(limits),
          f"{tag}: the sidecar should set all four byte limits (KVRELAY_MAX_*_BYTES), sets {sorted(limits)}")
    mem = (relay.get("resources") or {}).get("limits", {}).get("memory")
    if mem and "inflight" in limits and "store" in limits:
        # Freed heap the relay keeps: per malloc arena, one per two workers
        # (workers = the CPU limit), at least 1 (server/config/config.h,
        # MallocArenas); the server's default when unset. Without a CPU limit
        # assume 8 workers.
        retain = parse_bytes(env.get("KVRELAY_HEAP_RETAIN_BYTES") or "128MiB")
        cpu = (relay.get("resources") or {}).get("limits", {}).get("cpu")
        arenas = max(1, math.ceil(parse_quantity(cpu)) // 2) if cpu else 4
        # The outbox is counted as memory of its own (it holds messages in memory).
        outbox = limits.get("outbox", 0)
        check(limits["inflight"] + limits["store"] + outbox + arenas * retain <= parse_quantity(mem),
              f"{tag}: in-flight ({limits['inflight']}) + store ({limits['store']}) + outbox ({outbox}) + "
              f"retained heap ({arenas} x {retain}) bytes exceed the memory limit {mem}")
    if "session" in limits and "store" in limits:
        check(limits["session"] <= limits["store"], f"{tag}: session limit above the store limit")
    if "outbox_per_destination" in limits and "outbox" in limits:
        check(limits["outbox_per_destination"] < limits["outbox"],
              f"{tag}: --max-outbox-bytes-per-destination {limits['outbox_per_destination']} is not below "
              f"--max-outbox-bytes {limits['outbox']}: one dead peer could fill the whole outbox")
    return relay


# ------------------------------------------------------------ agent shutdown
SHELLS = {"sh", "bash", "dash", "ash", "zsh", "busybox"}


def shell_script(container):
    """The script of a `sh -c SCRIPT` container (command and args joined), else None."""
    argv = [str(a) for a in (container.get("command") or []) + (container.get("args") or [])]
    if len(argv) >= 3 and os.path.basename(argv[0]) in SHELLS and argv[1] == "-c":
        return argv[2]
    return None


def pid1_prefix():
    """An unshare command line that runs a program as PID 1 of a new PID namespace, as in a
    container (the kernel drops signals PID 1 has no handler for), or None where the
    machine allows no such namespace."""
    for prefix in (["unshare", "--pid", "--fork", "--kill-child", "--user", "--map-root-user"],
                   ["unshare", "--pid", "--fork", "--kill-child"]):
        rc, out, _ = run(prefix + ["/bin/sh", "-c", "echo $$"], timeout=30)
        if rc == 0 and out.strip() == "1":
            return prefix
    return None


def children(pid):
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d))
    return out


def sigterm_as_pid1(prefix, script, env):
    """Runs SCRIPT with /bin/sh as PID 1 of a fresh PID namespace, sends it SIGTERM after a
    second, returns (running_before, exit code or None if it ignored SIGTERM, seconds)."""
    p = subprocess.Popen(prefix + ["/bin/sh", "-c", script], env=env, stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        shell = None
        deadline = time.time() + 10
        while time.time() < deadline and shell is None and p.poll() is None:
            kids = children(p.pid)
            shell = kids[0] if kids else None
            time.sleep(0.05)
        time.sleep(1.0)
        if shell is None or p.poll() is not None:
            return False, p.poll(), 0.0
        os.kill(shell, signal.SIGTERM)
        t0 = time.time()
        try:
            rc = p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return True, None, time.time() - t0
        return True, rc, time.time() - t0
    finally:
        if p.poll() is None:
            p.kill()  # --kill-child: the namespace's PID 1 and with it everything in it
            p.wait()


def check_agent_shutdown(tag, pod_spec, relay, pid1):
    """A `sh -c` loop in a regular container is PID 1 of its container: without a TERM trap
    it ignores SIGTERM, the pod waits out terminationGracePeriodSeconds and the sidecar
    relay is stopped with ~2 s left instead of its drain. Checked in the text (a trap on
    TERM, no foreground sleep) and, where PID namespaces are available, by running the
    script as PID 1 and sending it SIGTERM. Returns how many containers were checked."""
    n = 0
    for c in pod_spec.get("containers") or []:
        script = shell_script(c)
        if script is None or not re.search(r"\b(while|until|sleep)\b", script):
            continue
        n += 1
        name = f"{tag}: container {c['name']}"
        check(re.search(r"^\s*trap\s+(\S.*\s)?(TERM|SIGTERM|15)\b", script, re.M),
              f"{name}: its shell loop has no `trap ... TERM`: as PID 1 it ignores SIGTERM, so every "
              "delete or rollout waits the whole grace period and the relay loses its drain")
        bare = [ln.strip() for ln in script.splitlines()
                if re.search(r"\bsleep\b", ln) and not re.search(r"\bsleep\b[^;&|]*&\s*wait\b", ln)]
        check(not bare, f"{name}: foreground sleep {bare}: the shell runs its TERM trap only after "
              "the sleep ends; use `sleep N & wait $!`")
        if pid1 is None:
            print(f"note: {name}: no PID namespace here (unshare); SIGTERM checked in the text only")
            continue
        env = clean_env()
        for e in c.get("env") or []:
            if "value" in e:
                env[e["name"]] = str(e["value"])
        env["KVRELAY_ADDR"] = "127.0.0.1:1"  # any kvrelayctl found fails at once
        running, rc, secs = sigterm_as_pid1(pid1, script, env)
        if check(running, f"{name}: the script exited by itself within a second (rc={rc}); the container would "
                 "restart in a loop"):
            check(rc is not None, f"{name}: as PID 1 the script ignored SIGTERM for 5 s (no handler)")
            if rc is not None:
                check(rc in (0, 128 + signal.SIGTERM), f"{name}: exited {rc} on SIGTERM")
                print(f"{name}: as PID 1, exits {rc} {secs:.2f} s after SIGTERM")
    return n


# ------------------------------------------------------------ NetworkPolicy
def selector_matches(sel, labels):
    """A LabelSelector (matchLabels, matchExpressions) against labels; {} matches all."""
    for k, v in (sel.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for e in sel.get("matchExpressions") or []:
        k, op, vals = e.get("key"), e.get("operator"), e.get("values") or []
        if (op == "In" and labels.get(k) not in vals) or (op == "NotIn" and k in labels and labels[k] in vals) \
                or (op == "Exists" and k not in labels) or (op == "DoesNotExist" and k in labels):
            return False
    return True


def policy_admits(policy, policy_ns, dst_pod_spec, src, port, protocol="TCP"):
    """Whether the ingress rules of POLICY (in namespace POLICY_NS, selecting the destination
    pod) admit a connection from SRC = {"ns", "ns_labels", "labels"} to PORT, by the
    networking.k8s.io/v1 semantics: rules add up; a rule without ports admits every port,
    one without peers every source; a peer's podSelector alone means the policy's
    namespace; an ipBlock is taken to match any pod (conservatively)."""
    named = {p["name"]: (p["containerPort"], p.get("protocol", "TCP"))
             for key in ("containers", "initContainers") for c in dst_pod_spec.get(key) or []
             for p in c.get("ports") or [] if "name" in p}
    for rule in policy["spec"].get("ingress") or []:
        ports = rule.get("ports") or []
        if ports and not any(
                p.get("protocol", "TCP") == protocol and (
                    p.get("port") is None
                    or (isinstance(p["port"], int) and p["port"] <= port <= p.get("endPort", p["port"]))
                    or (isinstance(p["port"], str) and named.get(p["port"]) == (port, protocol)))
                for p in ports):
            continue
        peers = rule.get("from") or []
        if not peers:
            return True
        for peer in peers:
            if "ipBlock" in peer:
                return True
            ns_sel, pod_sel = peer.get("namespaceSelector"), peer.get("podSelector")
            ns_ok = selector_matches(ns_sel, src["ns_labels"]) if ns_sel is not None else src["ns"] == policy_ns
            if ns_ok and (pod_sel is None or selector_matches(pod_sel, src["labels"])):
                return True
    return False


def check_network_policy(tag, objs, pod_labels, pod_spec, relay):
    """A second fence besides TLS and tokens (and the only one for the plain-HTTP metrics
    port): a NetworkPolicy must select the relay pods and admit the gRPC port only from
    kvrelay pods of the namespace, the metrics port only from the monitoring namespace,
    nothing else; egress stays open."""
    pols = [p for p in by_kind(objs, "NetworkPolicy")
            if selector_matches(p["spec"].get("podSelector") or {}, pod_labels)]
    if not check(len(pols) == 1, f"{tag}: {len(pols)} NetworkPolicies select the relay pods {pod_labels}, "
                 "expected one (only kvrelay pods may reach 50051; only Prometheus the metrics port)"):
        return
    pol = pols[0]
    spec = pol["spec"]
    name = f"{tag}: NetworkPolicy/{pol['metadata']['name']}"
    sel = spec.get("podSelector") or {}
    check(sel.get("matchLabels") and not sel.get("matchExpressions"),
          f"{name}: podSelector {sel} should name the sidecar label (an empty one selects every pod of the namespace)")
    check(spec.get("policyTypes") == ["Ingress"] and not spec.get("egress"),
          f"{name}: policyTypes {spec.get('policyTypes')} (egress {spec.get('egress')}): expected ['Ingress'], "
          "egress unrestricted")
    if not relay:
        return
    rports = {p["name"]: p["containerPort"] for p in relay.get("ports") or []}
    grpc_port, metrics_port = rports.get("grpc"), rports.get("metrics")
    seen = set()
    for i, rule in enumerate(spec.get("ingress") or []):
        check(rule.get("from"), f"{name}: ingress rule {i} has no `from` (admits every source)")
        check(rule.get("ports"), f"{name}: ingress rule {i} has no `ports` (admits every port of the pod)")
        for p in rule.get("ports") or []:
            port = p.get("port")
            check(isinstance(port, int), f"{name}: ingress rule {i} port {port!r}: use the number (CNIs resolve "
                  "named ports from the pod's containers; some ignore init (sidecar) containers')")
            check(port in rports.values(), f"{name}: ingress rule {i} port {port!r} is not one of the sidecar's "
                  f"named ports {rports}")
            check(p.get("protocol", "TCP") == "TCP" and "endPort" not in p, f"{name}: ingress rule {i} port {p}")
            seen.add(port)
    check({grpc_port, metrics_port} <= seen, f"{name}: admits ports {sorted(seen, key=str)}, expected the "
          f"sidecar's grpc ({grpc_port}) and metrics ({metrics_port})")

    # Who gets in, by the NetworkPolicy semantics (the policy in namespace "apps").
    def src(ns, labels, ns_labels=None):
        return {"ns": ns, "labels": labels, "ns_labels": {"kubernetes.io/metadata.name": ns, **(ns_labels or {})}}

    prometheus = src("monitoring", {"app.kubernetes.io/name": "prometheus"})
    cases = [
        ("an agent pod of the namespace", src("apps", dict(pod_labels)), grpc_port, True),
        ("another pod with the sidecar label", src("apps", {"kvrelay/sidecar": "true"}), grpc_port, True),
        ("Prometheus in namespace monitoring", prometheus, metrics_port, True),
        ("Prometheus in namespace monitoring", prometheus, grpc_port, False),
        ("an unlabelled pod of the namespace", src("apps", {"app": "other"}), grpc_port, False),
        ("an unlabelled pod of the namespace", src("apps", {"app": "other"}), metrics_port, False),
        ("a pod with the sidecar label in another namespace", src("other", {"kvrelay/sidecar": "true"}),
         grpc_port, False),
        ("a pod of another namespace", src("other", {"app": "x"}), metrics_port, False),
        ("an agent pod of the namespace", src("apps", dict(pod_labels)), 8080, False),
    ]
    for who, s, port, want in cases:
        got = policy_admits(pol, "apps", pod_spec, s, port)
        check(got == want, f"{name}: {who} -> port {port}: {'admitted' if got else 'refused'}, expected "
              f"{'admitted' if want else 'refused'}")
    ns_sel = [peer.get("namespaceSelector") for r in spec.get("ingress") or [] for peer in r.get("from") or []
              if peer.get("namespaceSelector") is not None]
    print(f"{name}: grpc {grpc_port} from kvrelay pods, metrics {metrics_port} from namespaces {ns_sel}")


# ------------------------------------------------------------ transport security
CSI_DRIVER = "csi.cert-manager.io"
CSI_FILES = {"tls-cert": ("csi.cert-manager.io/certificate-file", "tls.crt"),
             "tls-key": ("csi.cert-manager.io/privatekey-file", "tls.key"),
             "tls-client-ca": ("csi.cert-manager.io/ca-file", "ca.crt")}
# The Secret keys each file comes from: kubernetes.io/tls's, and cert-manager's ca.crt.
SECRET_KEYS = {"tls-cert": "tls.crt", "tls-key": "tls.key", "tls-client-ca": "ca.crt"}


def has_flag(container, flag):
    """Whether a flag appears at all (a boolean flag like --insecure has no value)."""
    args = [str(a) for a in (container.get("args") or []) + (container.get("command") or [])]
    return any(a == f"--{flag}" or a.startswith(f"--{flag}=") for a in args)


def is_loopback(addr):
    """Whether a HOST:PORT (or unix:PATH) address stays inside the pod."""
    if addr.startswith("unix:"):
        return True
    host = addr.rsplit(":", 1)[0].strip("[]")
    return host == "localhost" or host == "::1" or re.fullmatch(r"127\.\d+\.\d+\.\d+", host) is not None


def mount_of_path(container, path):
    """(volumeMount, path inside the volume) of the container's mount holding PATH, or (None, None)."""
    ms = [m for m in container.get("volumeMounts") or [] if path.startswith(m["mountPath"].rstrip("/") + "/")]
    if not ms:
        return None, None
    m = max(ms, key=lambda m: len(m["mountPath"]))
    return m, path[len(m["mountPath"].rstrip("/")) + 1:]


def peer_identity_matches(pattern, name):
    """kvrelay-server's --peer-identity: an exact name, or "*." and one DNS label in front of the rest."""
    if pattern.startswith("*."):
        label, _, rest = name.partition(".")
        return bool(label) and rest == pattern[2:]
    return pattern == name


def csi_expand(value, pod):
    """The csi-driver's ${POD_NAME} / ${POD_NAMESPACE} (os.Expand) in a volume attribute."""
    return value.replace("${POD_NAME}", pod["name"]).replace("${POD_NAMESPACE}", pod["namespace"])


def check_secret_mode(name, pod_spec, relay, secret, what):
    """A Secret volume's files: not world-readable, readable by the relay's group (the pod's fsGroup)."""
    modes = [secret.get("defaultMode", 0o644)] + [i["mode"] for i in secret.get("items") or [] if "mode" in i]
    for mode in modes:
        check(mode & 0o007 == 0, f"{name}: the {what} Secret's files have mode {mode:o}: readable by any user")
    sec = effective_security(pod_spec, relay)
    fs_group = (pod_spec.get("securityContext") or {}).get("fsGroup")
    check(fs_group is not None and fs_group == sec.get("runAsGroup") and all(m & 0o040 for m in modes),
          f"{name}: the {what} Secret's files (mode {[f'{m:o}' for m in modes]}, fsGroup {fs_group}) are not "
          f"readable by the relay's group {sec.get('runAsGroup')}")


def check_transport(tag, workload, pod_spec, relay):
    """TLS on: no container listens on a non-loopback plaintext address (and none ships
    --insecure); local listeners are loopback or unix:; the relay's certificate, key and CA
    come whole-volume (no subPath, read-only) from cert-manager's csi-driver (a per-pod
    certificate for the pod's stable DNS name, the name its peers dial) or from a Secret,
    with the files those sources write; --peer-identity admits the other relays of the
    StatefulSet and no one else; the tokens file comes from a Secret; only the relay mounts
    any of it. Returns "csi" or "secret" (where the certificates come from), or None."""
    name = f"{tag}: {workload['kind']}/{workload['metadata']['name']}"
    for c in (pod_spec.get("initContainers") or []) + (pod_spec.get("containers") or []):
        tls = bool(flag_values(c, "tls-cert")) and bool(flag_values(c, "tls-key"))
        for addr in flag_values(c, "listen"):
            check(is_loopback(addr) or tls or has_flag(c, "insecure"),
                  f"{name}: container {c['name']} listens on {addr} in plaintext without --insecure "
                  "(kvrelay-server exits 2): give it --tls-cert and --tls-key")
        check(not has_flag(c, "insecure"), f"{name}: container {c['name']} runs with --insecure: the kit turns TLS on")
        for addr in flag_values(c, "local-listen"):
            check(is_loopback(addr), f"{name}: container {c['name']} --local-listen {addr}: a local listener is "
                  "plaintext and must be loopback or unix:PATH")
    for v in flag_values(relay, "local-auth"):
        check(v in ("pod", "token"), f"{name}: --local-auth {v!r}: expected pod or token")

    volumes = {v["name"]: v for v in pod_spec.get("volumes") or []}
    pod0 = {"name": f"{workload['metadata']['name']}-0", "namespace": "apps"}
    sources, tls_volumes = set(), set()
    for flag in ("tls-cert", "tls-key", "tls-client-ca"):
        values = flag_values(relay, flag)
        if not check(len(values) == 1 and values[0].startswith("/"),
                     f"{name}: the relay should set one --{flag} /ABSOLUTE/PATH, sets {values}"):
            continue
        m, rel = mount_of_path(relay, values[0])
        if not check(m, f"{name}: --{flag} {values[0]} is on no volume of the relay"):
            continue
        check(m.get("readOnly") is True and not m.get("subPath"),
              f"{name}: the relay's mount {m['name']} at {m['mountPath']} should be the whole volume, read-only "
              "(a subPath mount never sees a renewed certificate)")
        vol = volumes.get(m["name"]) or {}
        tls_volumes.add(m["name"])
        if "csi" in vol:
            csi = vol["csi"]
            attrs = csi.get("volumeAttributes") or {}
            sources.add("csi")
            key, default = CSI_FILES[flag]
            check(rel == attrs.get(key, default), f"{name}: --{flag} reads {rel!r} from the csi-driver volume "
                  f"{m['name']}, which writes {attrs.get(key, default)!r} ({key})")
        elif "secret" in vol:
            sec = vol["secret"]
            sources.add("secret")
            items = {i["path"]: i["key"] for i in sec.get("items") or []}
            key = items.get(rel) if items else rel
            check(key == SECRET_KEYS[flag], f"{name}: --{flag} reads {rel!r} from Secret {sec.get('secretName')}, "
                  f"key {key!r}; expected the key {SECRET_KEYS[flag]!r} (kubernetes.io/tls plus ca.crt)")
        else:
            check(False, f"{name}: --{flag} comes from volume {m['name']}, neither the csi-driver nor a Secret")
    if not check(len(tls_volumes) == 1, f"{name}: certificate, key and CA should come from one volume (they rotate "
                 f"together), come from {sorted(tls_volumes)}"):
        return None
    vol = volumes.get(next(iter(tls_volumes))) or {}
    advertise = flag_values(relay, "advertise")
    own = re.sub(r"^dns:///", "", expand(advertise[0], relay, pod0)).rsplit(":", 1)[0] if advertise else None
    if "csi" in vol:
        csi = vol["csi"]
        attrs = csi.get("volumeAttributes") or {}
        check(csi.get("driver") == CSI_DRIVER, f"{name}: CSI volume driver {csi.get('driver')!r}, expected {CSI_DRIVER}")
        check(csi.get("readOnly") is True, f"{name}: the csi-driver volume should be readOnly: true")
        check(attrs.get(f"{CSI_DRIVER}/issuer-name"), f"{name}: the csi-driver volume names no issuer "
              f"({CSI_DRIVER}/issuer-name)")
        check(attrs.get(f"{CSI_DRIVER}/issuer-kind", "Issuer") in ("Issuer", "ClusterIssuer"),
              f"{name}: {CSI_DRIVER}/issuer-kind {attrs.get(f'{CSI_DRIVER}/issuer-kind')!r}")
        dns = attrs.get(f"{CSI_DRIVER}/dns-names", "")
        check("$(" not in dns, f"{name}: {CSI_DRIVER}/dns-names {dns!r} uses $(VAR), which the kubelet does not "
              "expand in volume attributes: the csi-driver's are ${POD_NAME} and ${POD_NAMESPACE}")
        names = [n.strip() for n in csi_expand(dns, pod0).split(",") if n.strip()]
        check(own in names, f"{name}: in pod {pod0['name']} the certificate's DNS names are {names}; the name "
              f"other relays dial and verify (--advertise) is {own!r}")
        usages = attrs.get(f"{CSI_DRIVER}/key-usages")
        if usages is not None:
            got = {u.strip() for u in usages.split(",")}
            check({"server auth", "client auth"} <= got, f"{name}: {CSI_DRIVER}/key-usages {usages!r}: the relay "
                  "serves (server auth) and forwards (client auth) with one certificate")
        group = effective_security(pod_spec, relay).get("runAsGroup")
        check(attrs.get(f"{CSI_DRIVER}/fs-group") == str(group),
              f"{name}: {CSI_DRIVER}/fs-group {attrs.get(f'{CSI_DRIVER}/fs-group')!r} should be the relay's "
              f"runAsGroup {group} (else it cannot read its key)")
    elif "secret" in vol:
        check_secret_mode(name, pod_spec, relay, vol["secret"], "TLS")

    # Who may forward: the StatefulSet's other relays (their names under the headless Service).
    patterns = [expand(p, relay, pod0) for p in flag_values(relay, "peer-identity")]
    svc = workload["spec"].get("serviceName")
    peer = f"{workload['metadata']['name']}-1.{svc}.apps.svc.cluster.local"
    if check(patterns, f"{name}: no --peer-identity: with TLS and routes, forwards need it"):
        check(all(p != "*" and not p.startswith("*.svc") for p in patterns), f"{name}: --peer-identity {patterns} "
              "admits far more than the mesh")
        check(any(peer_identity_matches(p, peer) for p in patterns),
              f"{name}: --peer-identity {patterns} refuses the peer relay {peer}")
        for stranger in (f"{workload['metadata']['name']}-1.{svc}.other.svc.cluster.local",
                         f"intruder.not-{svc}.apps.svc.cluster.local", f"{svc}.apps.svc.cluster.local"):
            check(not any(peer_identity_matches(p, stranger) for p in patterns),
                  f"{name}: --peer-identity {patterns} admits {stranger}")

    tokens = flag_values(relay, "tokens-file")
    if check(len(tokens) == 1, f"{name}: the relay should set one --tokens-file, sets {tokens}"):
        m, _ = mount_of_path(relay, tokens[0])
        if check(m and "secret" in (volumes.get(m["name"]) or {}),
                 f"{name}: --tokens-file {tokens[0]} is not on a Secret volume"):
            check(m.get("readOnly") is True and not m.get("subPath"),
                  f"{name}: the tokens Secret should be mounted whole and read-only (a subPath never updates)")
            tls_volumes.add(m["name"])
            check_secret_mode(name, pod_spec, relay, volumes[m["name"]]["secret"], "tokens")
    for c in (pod_spec.get("initContainers") or []) + (pod_spec.get("containers") or []):
        if c is not relay:
            held = sorted({m["name"] for m in c.get("volumeMounts") or []} & tls_volumes)
            check(not held, f"{name}: container {c['name']} mounts the relay's key material {held}")
    src = sources.pop() if len(sources) == 1 else None
    print(f"{name}: TLS from {src} ({sorted(tls_volumes)}), peers {patterns}, tokens {tokens}")
    return src


# ------------------------------------------------------------ the spool
SPOOL_READ_BYTES_PER_S = 100 << 20  # what the startup probe must allow recovery to read at


def spool_dir(container):
    """--spool-dir values, or KVRELAY_SPOOL_DIR's (flags win)."""
    values = flag_values(container, "spool-dir")
    if values:
        return values
    env = {e["name"]: e.get("value") for e in container.get("env") or []}
    return [env["KVRELAY_SPOOL_DIR"]] if env.get("KVRELAY_SPOOL_DIR") else []


def check_spool(tag, workload, pod_spec, relay):
    """The relay's spool (docs/SPOOL.md): on a volume the relay alone mounts, writable, a
    subdirectory of it (the relay creates it with mode 0700 and chmods an existing one, which
    only its owner may: a volume's root belongs to root or the fsGroup), synced, bounded below
    the volume's size. Returns "emptyDir" or "pvc" (where it lives), or None."""
    name = f"{tag}: {workload['kind']}/{workload['metadata']['name']}"
    dirs = spool_dir(relay)
    if not check(len(dirs) == 1 and dirs[0].startswith("/"),
                 f"{name}: the relay should set one --spool-dir /ABSOLUTE/PATH, sets {dirs}"):
        return None
    env = {e["name"]: e.get("value") for e in relay.get("env") or []}
    fsync = (flag_values(relay, "fsync") or [env.get("KVRELAY_FSYNC") or "always"])[-1]
    check(fsync == "always", f"{name}: --fsync={fsync}: a deployment syncs (never is for benchmarks)")
    m, rel = mount_of_path(relay, dirs[0])
    if not check(m, f"{name}: --spool-dir {dirs[0]} is on no volume of the relay (read-only root filesystem)"):
        return None
    check(rel and not rel.startswith("/"), f"{name}: --spool-dir {dirs[0]} is the mount point {m['mountPath']}: use "
          "a subdirectory, which the relay creates and owns (it makes the directory 0700)")
    check(not m.get("readOnly") and not m.get("subPath"),
          f"{name}: the spool's mount {m['name']} should be the whole volume, writable")
    for c in (pod_spec.get("initContainers") or []) + (pod_spec.get("containers") or []):
        if c is not relay:
            check(m["name"] not in {x["name"] for x in c.get("volumeMounts") or []},
                  f"{name}: container {c['name']} mounts the relay's spool volume {m['name']} (KV caches at rest)")
    sec = effective_security(pod_spec, relay)
    pod_sec = pod_spec.get("securityContext") or {}
    check(pod_sec.get("fsGroup") is not None and pod_sec.get("fsGroup") == sec.get("runAsGroup"),
          f"{name}: fsGroup {pod_sec.get('fsGroup')} is not the relay's group {sec.get('runAsGroup')}: the relay "
          "cannot create its spool directory in the volume")
    vol = {v["name"]: v for v in pod_spec.get("volumes") or []}.get(m["name"])
    claims = {c["metadata"]["name"]: c for c in workload["spec"].get("volumeClaimTemplates") or []}
    kind, size = None, None
    if vol is not None:
        check(m["name"] not in claims, f"{name}: {m['name']} is both a pod volume and a volumeClaimTemplate")
        if check("emptyDir" in vol, f"{name}: the spool's volume {m['name']} is {sorted(vol)}, expected an emptyDir "
                 "or a volumeClaimTemplate"):
            ed = vol["emptyDir"] or {}
            kind = "emptyDir"
            check(ed.get("medium", "") == "", f"{name}: the spool's emptyDir has medium {ed.get('medium')!r}: in "
                  "memory it counts against the memory limit and a node reboot loses it")
            if check(ed.get("sizeLimit"), f"{name}: the spool's emptyDir has no sizeLimit"):
                size = parse_quantity(ed["sizeLimit"])
    elif check(m["name"] in claims, f"{name}: the spool's volume {m['name']} is neither a pod volume nor a "
               "volumeClaimTemplate"):
        claim = claims[m["name"]]["spec"]
        kind = "pvc"
        check(claim.get("accessModes") == ["ReadWriteOnce"] or claim.get("accessModes") == ["ReadWriteOncePod"],
              f"{name}: the spool's claim accessModes {claim.get('accessModes')}: one relay per spool")
        req = ((claim.get("resources") or {}).get("requests") or {}).get("storage")
        if check(req, f"{name}: the spool's claim requests no storage"):
            size = parse_quantity(req)
        check(pod_sec.get("fsGroupChangePolicy") == "OnRootMismatch",
              f"{name}: fsGroupChangePolicy {pod_sec.get('fsGroupChangePolicy')!r}: without OnRootMismatch the "
              "kubelet walks every spool file at each mount and makes the relay's 0600 files group-writable")
    limit, store = byte_limit(relay, "spool"), byte_limit(relay, "store")
    if check(limit, f"{name}: no --max-spool-bytes: the spool would grow to the volume's end (an emptyDir past its "
             "sizeLimit gets the pod evicted; a full disk under the journal stops the spool)"):
        if store:
            check(limit >= store, f"{name}: --max-spool-bytes {limit} below the store limit {store}: publishes would "
                  "fail on the spool before the store is full")
        if size:
            check(limit <= 0.9 * size, f"{name}: --max-spool-bytes {limit} above 90% of the volume's {size:.0f} bytes "
                  "(the journal may pass the limit; quarantined files are not counted)")
        sp = relay.get("startupProbe") or {}
        window = sp.get("periodSeconds", 10) * sp.get("failureThreshold", 3)
        check(window >= limit / SPOOL_READ_BYTES_PER_S,
              f"{name}: the startup probe allows {window} s; recovery reads up to {limit} bytes of spool "
              f"({limit / SPOOL_READ_BYTES_PER_S:.0f} s at 100 MiB/s) before the relay serves")
    print(f"{name}: spool {dirs[0]} on {kind} {m['name']} ({size and f'{size:.0f} bytes'}), limit {limit}")
    return kind


# ------------------------------------------------------------ the mesh
DNS_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
TEMPLATE_RE = re.compile(r"^dns:///\{agent\}\.([a-z0-9-]+)\.(\S+)\.svc\.cluster\.local:(\d+)$")


def field_refs(container):
    """{env name: fieldPath} of the container's downward-API variables."""
    return {e["name"]: e["valueFrom"]["fieldRef"].get("fieldPath") for e in container.get("env") or []
            if "fieldRef" in (e.get("valueFrom") or {})}


def expand(value, container, pod):
    """VALUE with $(VAR) replaced as the kubelet does, from the container's env: literal
    values, and the downward API's metadata.name / metadata.namespace from POD
    ({"name", "namespace"}); an unknown variable stays as written."""
    env = {e["name"]: e["value"] for e in container.get("env") or [] if "value" in e}
    for name, path in field_refs(container).items():
        if path in ("metadata.name", "metadata.namespace"):
            env[name] = pod[path.split(".", 1)[1]]
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), str(value))


def check_mesh(tag, objs, workload, pod_labels, pod_spec, relay):
    """Every agent pod is one relay of a mesh: a StatefulSet behind the headless Service
    that gives each pod a DNS name; the relay listens on the pod IP (forwards, probes) and
    on a Unix socket in an emptyDir that every agent container mounts and addresses; its
    --route-template resolves an agent name to that agent's pod's name under the Service
    and namespace, on the gRPC port; --advertise is its own pod's target, so its own
    agent stays local; every --route names a DNS label."""
    name = f"{tag}: {workload['kind']}/{workload['metadata']['name']}"
    if not check(workload["kind"] == "StatefulSet",
                 f"{name}: the agents should be a StatefulSet (stable pod DNS names for the routes)"):
        return
    spec = workload["spec"]
    svc_name = spec.get("serviceName")
    svcs = [s for s in by_kind(objs, "Service") if s["metadata"]["name"] == svc_name]
    if not check(len(svcs) == 1, f"{name}: serviceName {svc_name!r} is not a Service of the build"):
        return
    svc = svcs[0]
    check(svc["spec"].get("clusterIP") == "None", f"{name}: Service {svc_name} is not headless (pod DNS names "
          "exist only under a headless Service)")
    check(matches(svc["spec"].get("selector"), pod_labels), f"{name}: Service {svc_name} does not select the pods")
    check(not pod_spec.get("hostname") and pod_spec.get("subdomain") in (None, svc_name),
          f"{name}: the pod template sets hostname/subdomain {pod_spec.get('hostname')!r}/"
          f"{pod_spec.get('subdomain')!r}: the agent's name must be its pod's name under {svc_name}")
    ordinal = f"{workload['metadata']['name']}-{max(0, spec.get('replicas', 1) - 1)}"
    check(DNS_LABEL.match(ordinal) and len(workload["metadata"]["name"]) + 6 <= 63,
          f"{name}: pod names like {ordinal!r} must be DNS labels (agent names go through the route template)")
    rports = {p["name"]: p["containerPort"] for p in relay.get("ports") or []}

    # The local hop: a Unix socket on a volume the agent shares.
    listens = listen_values(relay, "listen", "KVRELAY_LISTEN", "127.0.0.1:50051") + flag_values(relay, "local-listen")
    tcp = [v for v in flag_values(relay, "listen") or listens if not v.startswith("unix:")]
    socks = [v[len("unix:"):] for v in listens if v.startswith("unix:")]
    check(tcp == [f"0.0.0.0:{rports.get('grpc')}"],
          f"{name}: the relay should listen on the pod IP for forwards and remote agents (--listen=0.0.0.0:"
          f"{rports.get('grpc')}), listens on {tcp}")
    if not check(len(socks) == 1 and socks[0].startswith("/"),
                 f"{name}: the relay should listen on one unix:/ABSOLUTE/PATH for its agent, listens on {listens}"):
        return
    sock = socks[0]
    volumes = {v["name"]: v for v in pod_spec.get("volumes") or []}

    def mount_of(c):
        ms = [m for m in c.get("volumeMounts") or []
              if sock.startswith(m["mountPath"].rstrip("/") + "/") and not m.get("subPath")]
        return max(ms, key=lambda m: len(m["mountPath"])) if ms else None

    rm = mount_of(relay)
    if check(rm, f"{name}: the socket {sock} is on no volume of the relay (read-only root filesystem)"):
        check("emptyDir" in (volumes.get(rm["name"]) or {}), f"{name}: the socket's volume {rm['name']} is not an emptyDir")
        check(not rm.get("readOnly"), f"{name}: the relay mounts the socket's volume read-only")
    agents = pod_spec.get("containers") or []
    for c in agents:
        am = mount_of(c)
        check(am and rm and am["name"] == rm["name"] and am["mountPath"] == rm["mountPath"],
              f"{name}: container {c['name']} does not mount the relay's socket volume at {rm and rm['mountPath']}")
        env = {e["name"]: e.get("value") for e in c.get("env") or []}
        if "KVRELAY_ADDR" in env:
            check(env["KVRELAY_ADDR"] == f"unix:{sock}",
                  f"{name}: container {c['name']} KVRELAY_ADDR={env['KVRELAY_ADDR']!r}, expected its relay's "
                  f"socket unix:{sock}")
        argv = " ".join(str(a) for a in (c.get("command") or []) + (c.get("args") or []))
        check("127.0.0.1:50051" not in argv and "localhost:50051" not in argv,
              f"{name}: container {c['name']} addresses its relay over TCP: {argv[:120]!r}")

    # Routing: the template is each agent's pod under the headless Service, on the gRPC port.
    templates = flag_values(relay, "route-template")
    if not check(len(templates) == 1, f"{name}: one --route-template expected, got {templates}"):
        return
    template = templates[0]
    m = TEMPLATE_RE.match(template)
    if not check(m, f"{name}: --route-template {template!r} should be "
                 f"dns:///{{agent}}.{svc_name}.<namespace>.svc.cluster.local:<grpc port>"):
        return
    t_svc, t_ns, t_port = m.group(1), m.group(2), int(m.group(3))
    check(t_svc == svc_name, f"{name}: --route-template names Service {t_svc!r}, the pods' is {svc_name!r}")
    check(t_port == rports.get("grpc"), f"{name}: --route-template port {t_port}, the sidecar's grpc port is "
          f"{rports.get('grpc')}")
    namespaces = {(o.get("metadata") or {}).get("namespace") for o in objs}
    ns_ref = re.fullmatch(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", t_ns)
    if ns_ref:
        check(field_refs(relay).get(ns_ref.group(1)) == "metadata.namespace",
              f"{name}: --route-template's namespace $({ns_ref.group(1)}) is not the downward API's metadata.namespace")
    else:
        check(namespaces == {t_ns}, f"{name}: --route-template's namespace {t_ns!r}, the objects' are {namespaces}")
    advertise = flag_values(relay, "advertise")
    if check(len(advertise) == 1, f"{name}: one --advertise expected, got {advertise}"):
        for pod in ({"name": f"{workload['metadata']['name']}-0", "namespace": "apps"},
                    {"name": ordinal, "namespace": "other"}):
            own = expand(template, relay, pod).replace("{agent}", pod["name"])
            got = expand(advertise[0], relay, pod)
            check(got == own, f"{name}: in pod {pod['name']} (namespace {pod['namespace']}) --advertise is {got!r}, "
                  f"the route template gives its own agent {own!r}: its agent's messages would be forwarded "
                  "to itself")
    for r in flag_values(relay, "route"):
        agent, _, target = r.partition("=")
        check(DNS_LABEL.match(agent) and target, f"{name}: --route {r!r}: expected AGENT=TARGET with a DNS-label agent")

    # Relay to relay: a peer relay (another pod of the workload) reaches the template's port.
    for pol in by_kind(objs, "NetworkPolicy"):
        if selector_matches(pol["spec"].get("podSelector") or {}, pod_labels):
            peer = {"ns": "apps", "labels": dict(pod_labels), "ns_labels": {"kubernetes.io/metadata.name": "apps"}}
            check(policy_admits(pol, "apps", pod_spec, peer, t_port),
                  f"{name}: NetworkPolicy/{pol['metadata']['name']} refuses a peer relay on the route template's "
                  f"port {t_port}")
    print(f"{name}: mesh: {template} (advertise {advertise}), socket {sock} shared with "
          f"{[c['name'] for c in agents]}")


def check_build(tag, objs, flags, envs, rules_doc, dashboard_text, pid1=None):
    for o in objs:
        labels = (o.get("metadata") or {}).get("labels") or {}
        check(labels.get("app.kubernetes.io/part-of") == "kvrelay",
              f"{tag}: {o['kind']}/{o['metadata'].get('name')} lacks app.kubernetes.io/part-of: kvrelay")
    kinds = sorted(o["kind"] for o in objs)
    check({"ConfigMap", "StatefulSet", "NetworkPolicy", "PodMonitor", "PrometheusRule", "Service"} <= set(kinds),
          f"{tag}: objects {kinds}, expected a StatefulSet (the agents of the mesh), Service, NetworkPolicy, "
          "PodMonitor, PrometheusRule and ConfigMap")

    deps = by_kind(objs, "StatefulSet") + by_kind(objs, "Deployment")
    if not check(len(deps) == 1, f"{tag}: one workload (StatefulSet), got {[d['kind'] for d in deps]}"):
        return {}
    dep = deps[0]
    tmpl = dep["spec"]["template"]
    pod_labels = (tmpl.get("metadata") or {}).get("labels") or {}
    pod_spec = tmpl["spec"]
    sel = dep["spec"]["selector"]
    check(not sel.get("matchExpressions"), f"{tag}: {dep['kind']} selector uses matchExpressions (not checked)")
    check(sel.get("matchLabels") and matches(sel["matchLabels"], pod_labels),
          f"{tag}: {dep['kind']} selector {sel} does not match its pod labels {pod_labels}")
    relay = check_sidecar(f"{tag}: {dep['kind']}/{dep['metadata']['name']}", pod_spec, flags, envs)
    ports = container_ports(pod_spec)
    tgp = pod_spec.get("terminationGracePeriodSeconds", 30)
    if relay:
        env = {e["name"]: e.get("value") for e in relay.get("env") or []}
        grace = int(env.get("KVRELAY_SHUTDOWN_GRACE_SECONDS") or 10)
        check(tgp > grace, f"{tag}: terminationGracePeriodSeconds {tgp} leaves the relay no time for its "
              f"{grace} s drain after the agent stops")

    shells = check_agent_shutdown(f"{tag}: {dep['kind']}/{dep['metadata']['name']}", pod_spec, relay, pid1)
    check_network_policy(tag, objs, pod_labels, pod_spec, relay)
    tls_source = spool = None
    if relay:
        check_mesh(tag, objs, dep, pod_labels, pod_spec, relay)
        tls_source = check_transport(tag, dep, pod_spec, relay)
        spool = check_spool(tag, dep, pod_spec, relay)

    for svc in by_kind(objs, "Service"):
        spec = svc["spec"]
        check(spec.get("selector") and matches(spec["selector"], pod_labels),
              f"{tag}: Service {svc['metadata']['name']} selector {spec.get('selector')} does not select the pods {pod_labels}")
        names = [p.get("name") for p in spec.get("ports") or []]
        check({"grpc", "metrics"} <= set(names), f"{tag}: Service ports {names}, expected grpc and metrics")
        for p in spec.get("ports") or []:
            check(p.get("appProtocol"), f"{tag}: Service port {p.get('name')} has no appProtocol")
            tp = p.get("targetPort", p.get("port"))
            if isinstance(tp, int):
                owners = [(n, c["name"]) for n, (cp, c, _) in ports.items() if cp == tp]
                check(owners, f"{tag}: Service port {p.get('name')} targets {tp}, which no container declares")
                if relay and p.get("name") in ("grpc", "metrics"):
                    check(any(c == relay["name"] and n == p["name"] for n, c in owners),
                          f"{tag}: Service port {p['name']} ({tp}) is not the sidecar's {p['name']} port")
            else:
                check(tp in ports, f"{tag}: Service port {p.get('name')} targets the port name {tp!r}, not in the pod")
                if tp in ports:
                    check(not ports[tp][2], f"{tag}: Service port {p.get('name')} targets the sidecar port name {tp!r}: "
                          "endpoints ignore named ports of init containers before Kubernetes 1.32; use the number")
        if p := next((p for p in spec.get("ports") or [] if p.get("name") == "grpc"), None):
            check(p.get("appProtocol") in ("grpc", "kubernetes.io/h2c"),
                  f"{tag}: the grpc Service port's appProtocol {p.get('appProtocol')!r}")

    for pm in by_kind(objs, "PodMonitor"):
        spec = pm["spec"]
        check(matches((spec.get("selector") or {}).get("matchLabels"), pod_labels) and spec["selector"].get("matchLabels"),
              f"{tag}: PodMonitor selector {spec.get('selector')} does not select the pods {pod_labels}")
        for ep in spec.get("podMetricsEndpoints") or []:
            check(ep.get("port") in ports, f"{tag}: PodMonitor port {ep.get('port')!r} is not a named port of the pod "
                  f"({sorted(ports)})")
            if relay and ep.get("port") in ports:
                check(ports[ep["port"]][1] is relay, f"{tag}: PodMonitor scrapes {ep['port']}, not the sidecar's port")
            check(ep.get("path", "/metrics") == "/metrics", f"{tag}: PodMonitor path {ep.get('path')}")
            jobs = [r.get("replacement") for r in ep.get("relabelings") or []
                    if r.get("targetLabel") == "job" and r.get("action", "replace").lower() == "replace"]
            check(jobs == ["kvrelay"], f"{tag}: PodMonitor should set job=\"kvrelay\" (the rules select it), sets {jobs}")

    for pr in by_kind(objs, "PrometheusRule"):
        check(pr["spec"].get("groups") == rules_doc.get("groups"),
              f"{tag}: PrometheusRule spec.groups differ from deploy/prometheus/rules/kvrelay-alerts.yaml "
              "(run deploy/prometheus/make_prometheusrule.py)")

    for cm in by_kind(objs, "ConfigMap"):
        labels = cm["metadata"].get("labels") or {}
        check(labels.get("grafana_dashboard") == "1",
              f"{tag}: ConfigMap {cm['metadata']['name']} label grafana_dashboard is {labels.get('grafana_dashboard')!r}, "
              "expected the string \"1\"")
        data = cm.get("data") or {}
        check(list(data) == ["kvrelay-dashboard.json"], f"{tag}: dashboard ConfigMap keys {list(data)}")
        check(data.get("kvrelay-dashboard.json") == dashboard_text,
              f"{tag}: the ConfigMap's dashboard differs from deploy/grafana/kvrelay-dashboard.json")
    return {"relay": relay, "pod_spec": pod_spec, "workload": dep, "shell_loops": shells, "tls": tls_source,
            "spool": spool}


def dry_run_files(tag, relay, pod_spec, pod, workdir):
    """The files the sidecar's flags name, made for the dry run where its volumes would put them:
    a CA and this pod's certificate for the DNS names its csi-driver volume requests (or its
    --advertise name, for a Secret), and a tokens file with one agent's line.
    Returns ({flag: path}, the certificate's DNS names)."""
    volumes = {v["name"]: v for v in pod_spec.get("volumes") or []}
    m, _ = mount_of_path(relay, (flag_values(relay, "tls-cert") or ["/"])[0])
    attrs = ((volumes.get(m["name"]) if m else None) or {}).get("csi", {}).get("volumeAttributes") or {}
    if f"{CSI_DRIVER}/dns-names" in attrs:
        dns = [n.strip() for n in csi_expand(attrs[f"{CSI_DRIVER}/dns-names"], pod).split(",") if n.strip()]
    else:
        dns = [re.sub(r"^dns:///", "", expand(a, relay, pod)).rsplit(":", 1)[0] for a in flag_values(relay, "advertise")]
    pki = TestPki(os.path.join(workdir, f"{tag}-pki"))
    ca = pki.ca(f"{tag}-ca")
    leaf = pki.issue(ca, pod["name"], dns=dns)
    files = {}
    for flag, src in (("tls-cert", leaf.cert), ("tls-key", leaf.key), ("tls-client-ca", ca.cert)):
        if flag_values(relay, flag):
            files[flag] = src
    if flag_values(relay, "tokens-file"):
        files["tokens-file"] = os.path.join(workdir, f"{tag}-tokens")
        with open(files["tokens-file"], "w") as f:
            f.write(f"# made by the dry run\n{pod['name']} sha256:{hashlib.sha256(os.urandom(32)).hexdigest()}\n")
    return files, dns


def dry_run_relay(tag, server, relay, pod_spec, workdir):
    """kvrelay-server with the sidecar's args and env: starts with TLS on its gRPC port (its
    certificate, key, CA and tokens file made where its volumes would put them), answers
    grpc.health.v1 in plaintext on its health port and not on the TLS port, reads 0 on the
    insecure gauge, creates its socket and exports the limits it was given."""
    # The kubelet's $(VAR) expansion, for the first pod of the workload.
    pod = {"name": "kvrelay-agent-0", "namespace": "apps"}
    sock = os.path.join(workdir, f"{tag}.sock")
    files, dns = dry_run_files(tag, relay, pod_spec, pod, workdir)
    moved = ("listen", "local-listen", "metrics-listen", "health-listen", "spool-dir") + tuple(files)
    args = [expand(a, relay, pod) for a in relay.get("args") or []
            if not re.match(r"--(%s)(=|$)" % "|".join(moved), a)]
    health_port = free_port()
    args = ["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"] + args
    if flag_values(relay, "health-listen"):
        args += ["--health-listen", f"127.0.0.1:{health_port}"]
    for flag, path in files.items():
        args += [f"--{flag}", path]
    unix = [v for v in flag_values(relay, "listen") + flag_values(relay, "local-listen") if v.startswith("unix:")]
    if unix:
        args += ["--local-listen" if flag_values(relay, "local-listen") else "--listen", f"unix:{sock}"]
    spool = None
    if spool_dir(relay):
        # The volume's mount point, the directory the relay creates below it.
        spool = os.path.join(workdir, f"{tag}-volume", "spool")
        os.makedirs(os.path.dirname(spool))
        args += ["--spool-dir", spool]
    env = clean_env()
    limits = (relay.get("resources") or {}).get("limits") or {}
    for e in relay.get("env") or []:
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "resourceFieldRef" in (e.get("valueFrom") or {}):
            ref = e["valueFrom"]["resourceFieldRef"]
            q = parse_quantity(limits.get(ref["resource"].split(".", 1)[1], "1"))
            env[e["name"]] = str(max(1, math.ceil(q / parse_quantity(ref.get("divisor", "1")))))
    env.pop("KVRELAY_LISTEN", None)
    env.pop("KVRELAY_METRICS_LISTEN", None)
    env.pop("KVRELAY_SPOOL_DIR", None)
    try:
        r = Relay(server, workdir, args=args, env=env, name=f"relay-{tag}")
    except RuntimeError as e:
        check(False, f"{tag}: kvrelay-server rejects the sidecar's configuration: {e}")
        return
    try:
        with urllib.request.urlopen(f"http://{r.metrics}/metrics", timeout=10) as resp:
            samples = parse_exposition(resp.read().decode())
        for k in ("inflight", "mailbox", "session", "store"):
            v = env.get(f"KVRELAY_MAX_{k.upper()}_BYTES")
            got = samples.get(("kvrelay_limit_bytes", frozenset({("limit", k)})))
            if v:
                check(got == parse_bytes(v), f"{tag}: kvrelay_limit_bytes{{limit=\"{k}\"}} = {got}, configured {v}")
        want = byte_limit(relay, "outbox")
        if want is not None:
            got = samples.get(("kvrelay_limit_bytes", frozenset({("limit", "outbox")})))
            check(got == want, f"{tag}: kvrelay_limit_bytes{{limit=\"outbox\"}} = {got}, configured {want}")
        if unix:
            check(os.path.exists(sock) and stat.S_ISSOCK(os.stat(sock).st_mode),
                  f"{tag}: the relay did not create its Unix socket ({sock})")
        if spool:
            mode = stat.S_IMODE(os.stat(spool).st_mode) if os.path.isdir(spool) else None
            check(mode == 0o700, f"{tag}: the spool directory {spool}: mode {mode and oct(mode)}, expected 0o700")
            have = set(os.listdir(spool)) if os.path.isdir(spool) else set()
            check({"LOCK", "journal", "msg", "quarantine"} <= have, f"{tag}: the spool holds {sorted(have)}")
            for f in ("LOCK", "journal"):
                if f in have:
                    fm = stat.S_IMODE(os.stat(os.path.join(spool, f)).st_mode)
                    check(fm & 0o077 == 0, f"{tag}: spool file {f} has mode {oct(fm)}: readable by others")
            got = samples.get(("kvrelay_spool_failed", frozenset()))
            check(got == 0, f"{tag}: kvrelay_spool_failed = {got}, expected 0")
            got = samples.get(("kvrelay_spool_bytes", frozenset()))
            check(got is not None and got > 0, f"{tag}: kvrelay_spool_bytes = {got}, expected the new journal's bytes")
            want = byte_limit(relay, "spool")
            if want is not None:  # what KvrelaySpoolNearlyFull compares with
                got = samples.get(("kvrelay_limit_bytes", frozenset({("limit", "spool")})))
                check(got == want, f"{tag}: kvrelay_limit_bytes{{limit=\"spool\"}} = {got}, configured {want}")
        if "tls-cert" in files:
            got = samples.get(("kvrelay_insecure", frozenset()))
            check(got == 0, f"{tag}: kvrelay_insecure = {got} with the sidecar's TLS configuration, expected 0")
            rc, out, err = run([server, "health", "--addr", r.addr, "--timeout", "3"], timeout=30)
            check(rc != 0, f"{tag}: the gRPC port {r.addr} answered a plaintext health check: it should serve only "
                  f"TLS (certificate for {dns})")
        if flag_values(relay, "health-listen"):
            rc, out, err = run([server, "health", "--addr", f"127.0.0.1:{health_port}", "--timeout", "5"], timeout=30)
            check(rc == 0, f"{tag}: the health port (--health-listen, where the probes go) did not answer SERVING in "
                  f"plaintext: rc={rc} {(out + err).strip()}")
    finally:
        check(r.stop() == 0, f"{tag}: relay with the sidecar's configuration did not exit 0 on SIGTERM")


def check_issuer_example(node, base):
    """deploy/kubernetes/examples/ca-issuer.yaml makes the issuer the base's csi-driver volume
    names (kind and name), one that can sign for the csi-driver (not SelfSigned)."""
    path = os.path.join(K8S, "examples", "ca-issuer.yaml")
    if not check(os.path.isfile(path), "deploy/kubernetes/examples/ca-issuer.yaml is missing") or not base.get("relay"):
        return
    docs = node.yaml(path)
    volumes = {v["name"]: v for v in base["pod_spec"].get("volumes") or []}
    m, _ = mount_of_path(base["relay"], (flag_values(base["relay"], "tls-cert") or ["/"])[0])
    attrs = ((volumes.get(m["name"]) if m else None) or {}).get("csi", {}).get("volumeAttributes") or {}
    kind = attrs.get(f"{CSI_DRIVER}/issuer-kind", "Issuer")
    name = attrs.get(f"{CSI_DRIVER}/issuer-name")
    hits = [d for d in docs if d.get("apiVersion") == "cert-manager.io/v1" and d.get("kind") == kind
            and d["metadata"].get("name") == name]
    if check(len(hits) == 1, f"examples/ca-issuer.yaml has no {kind} {name!r} (the base's csi-driver issuer)"):
        check("selfSigned" not in hits[0].get("spec", {}),
              f"examples/ca-issuer.yaml: {kind} {name} is SelfSigned, which the csi-driver cannot use")
        ca = (hits[0].get("spec") or {}).get("ca") or {}
        certs = [d for d in docs if d.get("kind") == "Certificate" and d["spec"].get("secretName") == ca.get("secretName")]
        check(not ca or (certs and certs[0]["spec"].get("isCA") is True),
              f"examples/ca-issuer.yaml: the CA issuer's Secret {ca.get('secretName')} is made by no isCA Certificate")


def main():
    global IMAGE_USER
    ap = argparse.ArgumentParser()
    ap.add_argument("--kubectl", default=shutil.which("kubectl"),
                    help="kubectl (kubectl kustomize) or a kustomize binary (kustomize build), kustomize v4+")
    ap.add_argument("--node", default=shutil.which("node"))
    ap.add_argument("--node-modules", required=True)
    ap.add_argument("--server", required=True)
    args = ap.parse_args()
    if not args.kubectl or not args.node:
        print("FAIL: kubectl (or kustomize) and node are required (scripts/install_deps.sh installs them)")
        return 1
    node = Node(args.node, args.node_modules)
    IMAGE_USER = dockerfile_user()
    check(IMAGE_USER == (65532, 65532), f"Dockerfile USER {IMAGE_USER}")
    flags, envs = server_help(args.server)
    rules_doc = node.yaml(RULES)[0]
    with open(os.path.join(DEPLOY, "grafana", "kvrelay-dashboard.json")) as f:
        dashboard_text = f.read()

    rc, out, err = run(["/usr/bin/python3", os.path.join(DEPLOY, "prometheus", "make_prometheusrule.py"), "--check"])
    check(rc == 0, f"deploy/kubernetes/base/prometheusrule.yaml is stale: {err.strip()}")

    kubectls = [args.kubectl] + [k for k in os.environ.get("KVRELAY_DEPLOY_EXTRA_KUBECTL", "").split(":") if k]
    for k in kubectls:
        rc, out, err = run([k, "version"] if is_kustomize(k) else [k, "version", "--client"], timeout=30)
        print(f"{k}: {' '.join((out or err).split())[:160]}")

    dirs = [os.path.join(K8S, "base")] + sorted(
        d for d in glob.glob(os.path.join(K8S, "overlays", "*")) if os.path.isfile(os.path.join(d, "kustomization.yaml")))
    check(os.path.join(K8S, "overlays", "production") in dirs, "deploy/kubernetes/overlays/production exists")
    pid1 = pid1_prefix()
    print(f"PID namespaces for the SIGTERM check: {'yes' if pid1 else 'no (text checks only)'}")
    with tempfile.TemporaryDirectory(prefix="kvrelay-k8s-") as work:
        builds = {}
        for d in dirs:
            tag = os.path.relpath(d, K8S)
            files = [kustomize(k, d, work, f"{tag.replace('/', '_')}-{i}") for i, k in enumerate(kubectls)]
            if not files[0]:
                continue
            rendered = [node.yaml(f) for f in files if f]
            for i, other in enumerate(rendered[1:], 1):
                check(normalized(other) == normalized(rendered[0]),
                      f"{tag}: {kubectls[i]} builds different objects than {kubectls[0]}")
            rc, out, err = node.run("validate", files[0], timeout=180)
            try:
                report = json.loads(out)
            except ValueError:
                report = {"objects": [], "errors": [f"validator output unreadable: rc={rc} {err.strip()[-2000:]}"]}
            for o in report["objects"]:
                print(f"{tag}: {o['object']}: schema {o['schema']}")
            for e in report["errors"]:
                check(False, f"{tag}: {e}")
            check(rc == (1 if report["errors"] else 0), f"{tag}: validator rc={rc} {err.strip()[-500:]}")
            builds[tag] = check_build(tag, rendered[0], flags, envs, rules_doc, dashboard_text, pid1)
            print(f"{tag}: {len(rendered[0])} objects checked")

        base, prod = builds.get("base") or {}, builds.get(os.path.join("overlays", "production")) or {}
        # Where the certificates come from: the base (and production on it) from cert-manager's
        # csi-driver, per pod; the overlay for clusters without cert-manager from a Secret.
        nocm = builds.get(os.path.join("overlays", "no-cert-manager"))
        check(nocm is not None, "deploy/kubernetes/overlays/no-cert-manager (certificates from a Secret) is missing")
        check(base.get("tls") == "csi", f"base: certificates from {base.get('tls')}, expected the csi-driver")
        check(prod.get("tls") == "csi", f"production: certificates from {prod.get('tls')}, expected the csi-driver")
        check((nocm or {}).get("tls") == "secret",
              f"no-cert-manager: certificates from {(nocm or {}).get('tls')}, expected a Secret")
        check_issuer_example(node, base)
        # The spool: an emptyDir in the base (a restart of the relay keeps it, a new pod does not);
        # a claim per pod in production and what builds on it (a replaced pod recovers it).
        for tag, b in builds.items():
            if b.get("relay"):
                want = "emptyDir" if tag == "base" else "pvc"
                check(b.get("spool") == want, f"{tag}: the spool is on {b.get('spool')}, expected {want}")
        # The base's example agent is a shell loop (kvrelayctl demo): its SIGTERM handling was checked.
        check(base.get("shell_loops", 0) >= 1, "base: the example agent's shell loop was not found to check its "
              "SIGTERM handling")
        # Only the base (the example) makes demo traffic; overlays run the user's agent.
        for tag, b in builds.items():
            if tag == "base" or not b.get("pod_spec"):
                continue
            for c in b["pod_spec"].get("containers") or []:
                argv = " ".join(str(a) for a in (c.get("command") or []) + (c.get("args") or []))
                check("kvrelayctl" not in argv, f"{tag}: container {c['name']} runs kvrelayctl ({argv[:80]!r}): "
                      "the demo agent belongs to the example (base), not next to production relays")
                if b.get("relay"):
                    check(c.get("image") != b["relay"].get("image"),
                          f"{tag}: container {c['name']} runs the relay image {c.get('image')}: put your agent's image")
        if base.get("relay") and prod.get("relay"):
            def env_of(c):
                return {e["name"]: e.get("value") for e in c.get("env") or []}
            be, pe = env_of(base["relay"]), env_of(prod["relay"])
            for k in ("INFLIGHT", "STORE"):
                name = f"KVRELAY_MAX_{k}_BYTES"
                check(name in pe and parse_bytes(pe[name]) > parse_bytes(be.get(name, "0")),
                      f"production: {name} {pe.get(name)} should be above the base's {be.get(name)}")
            bm = parse_quantity(base["relay"]["resources"]["limits"]["memory"])
            pm = parse_quantity(prod["relay"]["resources"]["limits"]["memory"])
            check(pm > bm, "production: the sidecar's memory limit should be above the base's")
            check(prod["relay"]["image"] != base["relay"]["image"] and ":" in prod["relay"]["image"],
                  f"production: image {prod['relay']['image']} should be pinned (kustomize images)")
        for tag, b in builds.items():
            if b.get("relay"):
                dry_run_relay(tag.replace("/", "_"), args.server, b["relay"], b["pod_spec"], work)
    return finish("deploy_kubernetes")


if __name__ == "__main__":
    sys.exit(main())

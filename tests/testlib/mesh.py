"""A mesh of kvrelay-server processes on loopback, for the mesh tests:
relays named by agent group, a route file every relay reads, and what one
relay alone composes for comparison."""
import os
import re

from kvrelay_testlib import Server, check, free_port, scrape


class Mesh:
    """Relays named by agent group; every relay routes every agent."""

    def __init__(self, server_bin, work, names, extra=None):
        self.server_bin, self.work = server_bin, work
        self.ports = {n: free_port() for n in names}
        self.extra = extra or {}
        self.route_file = os.path.join(work, "routes.json")
        self.routes = {}
        self.raw_routes = {}  # agent -> a target that is no relay of the mesh
        self.relays = {}

    def target(self, name):
        return f"127.0.0.1:{self.ports[name]}"

    def write_routes(self, routes):
        """Routes agent -> relay name (and raw_routes); the file is replaced
        by an atomic rename, as a ConfigMap update does."""
        self.routes = dict(routes)
        entries = {a: self.target(r) for a, r in routes.items()} | self.raw_routes
        self.write_file("{" + ",".join(f'"{a}": "{t}"' for a, t in entries.items()) + "}")

    def write_file(self, text):
        tmp = self.route_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, self.route_file)

    def start(self, name, *more):
        args = ["--listen", self.target(name), "--metrics-listen", "127.0.0.1:0",
                "--advertise", self.target(name), "--route-file", self.route_file,
                "--forward-stall-seconds", "2", "--forward-timeout-seconds", "60",
                *self.extra.get(name, []), *more]
        self.relays[name] = Server(self.server_bin, self.work, args=args, name=f"relay-{name}")
        return self.relays[name]

    def stop(self, name):
        r = self.relays.pop(name, None)
        if r:
            r.stop()

    def stop_all(self):
        for n in list(self.relays):
            self.stop(n)


def metrics(server):
    return scrape(server)


def fetch(ctl, relay, session, agent, out, wait=20):
    return ctl.ok("fetch", "--session", session, "--agent", agent, "--out", out, "--wait", str(wait),
                  addr=relay.addr)


def status_lines(ctl, relay, session, mid):
    rc, out, err = ctl.run("status", "--session", session, "--id", mid, addr=relay.addr)
    check(rc == 0, f"status: rc={rc} {err}")
    return {m["agent"]: m for m in (dict(re.findall(r'(\w+)=("[^"]*"|\S+)', line)) for line in out.splitlines())
            if "agent" in m}


def single_relay_chain(ctl, server_bin, work, turns, agents, policy, session):
    """What one relay composes for the chain agents[0] -> agents[1] -> ...:
    the message files, in order."""
    out = []
    with Server(server_bin, work, name="single") as single:
        parent = None
        for i, turn in enumerate(turns):
            args = ["publish", "--session", session, "--from", agents[i], "--to", agents[i + 1],
                    "--policy", policy, "--in", turn]
            if parent:
                args += ["--parent", parent]
            r = ctl.ok(*args, addr=single.addr)
            f = ctl.path(f"single-{session}-{i}.st")
            fetch(ctl, single, session, agents[i + 1], f)
            out.append(f)
            parent = r.get("message_id")
    return out

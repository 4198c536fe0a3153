"""Test hosts in network namespaces (root only), for mesh tests and benchmarks.

    with Hosts(["a", "b", "c"], prefix="kvrt") as hosts:
        hosts.addr("a")            # "10.203.0.1"
        hosts.cmd("a", [...])      # ["ip", "netns", "exec", "kvrt-a", ...]
        hosts.link_down("a"); hosts.link_up("a")
        hosts.shape("a", "1gbit")  # tc tbf on a's link (both directions)
        hosts.tx_bytes("a")        # bytes a's link interface sent

Every host is a namespace with one veth link to a hub namespace holding a
bridge; the hub and every host are removed on exit (and any leftovers of
the same prefix are removed first). Traffic only ever goes to addresses of
these namespaces (10.203.0.0/24 inside them) and to each namespace's own
loopback.
"""
import os
import subprocess

SUBNET = "10.203.0"


def available():
    """(True, "") when namespaces can be made here, else (False, why)."""
    if os.geteuid() != 0:
        return False, "not root: cannot create network namespaces"
    if subprocess.run(["which", "ip"], capture_output=True).returncode != 0:
        return False, "no ip command (iproute2)"
    probe = "kvrprobe%d" % os.getpid()
    p = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if p.returncode != 0:
        return False, f"ip netns add failed: {p.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return True, ""


def _ip(*args, check=True):
    p = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and p.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {p.stderr.strip()}")
    return p


class Hosts:
    def __init__(self, names, prefix="kvrt"):
        self.names, self.prefix = list(names), prefix
        self.hub = f"{prefix}-hub"

    def ns(self, name):
        return f"{self.prefix}-{name}"

    def addr(self, name):
        return f"{SUBNET}.{self.names.index(name) + 1}"

    def dev(self, name):
        """The host's end of its link (inside its namespace)."""
        return "eth0"

    def hub_dev(self, name):
        return f"v{self.names.index(name)}"

    def cmd(self, name, argv):
        return ["ip", "netns", "exec", self.ns(name), *argv]

    def __enter__(self):
        self.cleanup()
        _ip("netns", "add", self.hub)
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "link", "set", "br0", "up")
        for i, n in enumerate(self.names):
            ns = self.ns(n)
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", self.hub_dev(n), "netns", self.hub)
            _ip("-n", ns, "addr", "add", f"{self.addr(n)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", self.hub, "link", "set", self.hub_dev(n), "master", "br0")
            _ip("-n", self.hub, "link", "set", self.hub_dev(n), "up")
        return self

    def __exit__(self, *exc):
        self.cleanup()

    def cleanup(self):
        out = _ip("netns", "list", check=False).stdout
        for line in out.splitlines():
            name = line.split()[0] if line.split() else ""
            if name == self.hub or name.startswith(self.prefix + "-"):
                _ip("netns", "del", name, check=False)

    def link_down(self, name):
        _ip("-n", self.ns(name), "link", "set", "eth0", "down")

    def link_up(self, name):
        _ip("-n", self.ns(name), "link", "set", "eth0", "up")

    def shape(self, name, rate, burst="4mb", latency="20ms"):
        """Token-bucket shapes both directions of `name`'s link to `rate`."""
        for ns, dev in ((self.ns(name), "eth0"), (self.hub, self.hub_dev(name))):
            subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], capture_output=True)
            p = subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                                "burst", burst, "latency", latency], capture_output=True, text=True)
            if p.returncode != 0:
                raise RuntimeError(f"tc on {ns}/{dev}: {p.stderr.strip()}")

    def tx_bytes(self, name):
        p = subprocess.run(self.cmd(name, ["cat", "/sys/class/net/eth0/statistics/tx_bytes"]), capture_output=True,
                           text=True)
        return int(p.stdout.strip() or 0)

"""Test hosts in network namespaces (root only), for mesh tests and benchmarks.

    with Hosts(["a", "b", "c"], prefix="kvrt") as hosts:
        hosts.addr("a")            # "10.203.0.1"
        hosts.cmd("a", [...])      # ["ip", "netns", "exec", "kvrt-a", ...]
        hosts.link_down("a"); hosts.link_up("a")
        hosts.shape("a", "1gbit")  # tc tbf on a's link (both directions)
        hosts.tx_bytes("a")        # bytes a's link interface sent

Hosts(..., mtu=9000) sets the MTU of every link (both ends); None keeps
the kernel's 1500.

Hosts(..., ipv6=False) disables IPv6 in every namespace before its links
come up, so that no router solicitation or multicast listener report adds
to an interface counter (for benchmarks that count bytes on the wire).

Every host is a namespace with one veth link to a hub namespace holding a
bridge; the hub and every host are removed on exit (and any leftovers of
the same prefix are removed first). Traffic only ever goes to addresses of
these namespaces (10.203.0.0/24 inside them) and to each namespace's own
loopback.
"""
import json
import os
import re
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
    def __init__(self, names, prefix="kvrt", ipv6=True, mtu=None):
        self.names, self.prefix, self.ipv6, self.mtu = list(names), prefix, ipv6, mtu
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
        self._no_ipv6(self.hub)
        # Bridged frames skip iptables (br_netfilter, where loaded): the hub only switches.
        for table in ("iptables", "ip6tables", "arptables"):
            subprocess.run(["ip", "netns", "exec", self.hub, "sysctl", "-q", "-w",
                            f"net.bridge.bridge-nf-call-{table}=0"], capture_output=True)
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "link", "set", "br0", "up")
        for i, n in enumerate(self.names):
            ns = self.ns(n)
            _ip("netns", "add", ns)
            self._no_ipv6(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", self.hub_dev(n), "netns", self.hub)
            if self.mtu:
                _ip("-n", ns, "link", "set", "eth0", "mtu", str(self.mtu))
                _ip("-n", self.hub, "link", "set", self.hub_dev(n), "mtu", str(self.mtu))
            _ip("-n", ns, "addr", "add", f"{self.addr(n)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", self.hub, "link", "set", self.hub_dev(n), "master", "br0")
            _ip("-n", self.hub, "link", "set", self.hub_dev(n), "up")
        return self

    def _no_ipv6(self, ns):
        if self.ipv6:
            return
        p = subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1",
                            "net.ipv6.conf.default.disable_ipv6=1"], capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"disabling IPv6 in {ns}: {p.stderr.strip()}")

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

    def shape(self, name, rate, burst=None, latency="20ms"):
        """Token-bucket shapes both directions of `name`'s link to `rate` (tc
        syntax: "1gbit", "10gbit", "500mbit"). burst None: 1 ms at `rate`,
        at least 128 KiB (above a 64 KiB GSO packet, so that tbf never has to
        split one): large enough for a 10 Gbit/s link, small enough that a
        message of a few MB is not mostly sent in the initial burst."""
        if burst is None:
            burst = str(max(rate_bytes_per_second(rate) // 1000, 128 * 1024))
        for ns, dev in ((self.ns(name), "eth0"), (self.hub, self.hub_dev(name))):
            subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], capture_output=True)
            p = subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                                "burst", burst, "latency", latency], capture_output=True, text=True)
            if p.returncode != 0:
                raise RuntimeError(f"tc on {ns}/{dev}: {p.stderr.strip()}")

    def unshape(self, name):
        for ns, dev in ((self.ns(name), "eth0"), (self.hub, self.hub_dev(name))):
            subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], capture_output=True)

    def tx_bytes(self, name):
        return self._counter(name, "tx_bytes")

    def rx_bytes(self, name):
        return self._counter(name, "rx_bytes")

    def qdisc_bytes(self, name):
        """Bytes the root qdisc of `name`'s eth0 sent: unlike the interface
        counter of a veth (which sees GSO packets, headers counted once per
        packet of up to 64 KiB), this counts the headers of every segment,
        as a physical link carries them. 0 without a qdisc."""
        p = subprocess.run(["tc", "-s", "-j", "-n", self.ns(name), "qdisc", "show", "dev", "eth0", "root"],
                           capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"tc -s qdisc show in {self.ns(name)}: {p.stderr.strip()}")
        qdiscs = json.loads(p.stdout or "[]")
        return int(qdiscs[0].get("bytes", 0)) if qdiscs else 0

    def _counter(self, name, counter):
        p = subprocess.run(self.cmd(name, ["cat", f"/sys/class/net/eth0/statistics/{counter}"]), capture_output=True,
                           text=True)
        if p.returncode != 0 or not p.stdout.strip().isdigit():
            raise RuntimeError(f"reading {counter} of {self.ns(name)}/eth0: {p.stderr.strip()}")
        return int(p.stdout.strip())


def rate_bytes_per_second(rate):
    """Bytes per second of a tc rate ("1gbit", "10gbit", "500mbit", "100kbit",
    "1gbps" for bytes); ValueError for anything else."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgt]?)(bit|bps)", rate.strip().lower())
    if not m:
        raise ValueError(f"rate {rate!r}: expected a number and kbit, mbit, gbit, tbit or bps")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2)]
    value = float(m.group(1)) * scale
    return int(value / 8 if m.group(3) == "bit" else value)

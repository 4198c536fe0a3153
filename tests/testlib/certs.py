"""Test certificates made with the openssl command at test time.

    pki = TestPki(tmpdir)
    ca = pki.ca("kvrelay-test-ca")
    relay_a = pki.issue(ca, "relay-a", dns=["relay-a.test"], ips=["127.0.0.11"])
    old = pki.issue(ca, "old", dns=["localhost"], expired=True)
    other = pki.issue(pki.ca("other-ca"), "stranger", dns=["localhost"])

Every certificate is an ECDSA P-256 leaf usable as both TLS server and TLS
client (extendedKeyUsage serverAuth, clientAuth), signed by the CA given;
files are PEM: `cert.cert`, `cert.key`, `ca.cert`. Nothing here touches
files outside `root`.
"""

import datetime
import os
import subprocess
from dataclasses import dataclass, field

_CA_CONFIG = """[ca]
default_ca = d
[d]
database = {db}
new_certs_dir = {dir}
serial = {serial}
default_md = sha256
policy = p
copy_extensions = none
unique_subject = no
[p]
commonName = supplied
"""


@dataclass
class Cert:
    name: str
    cert: str  # PEM certificate path
    key: str  # PEM private key path (mode 0600)
    ca: "Cert" = None  # the issuing CA (None for a CA itself)
    sans: list = field(default_factory=list)


def _run(args, **kw):
    r = subprocess.run(args, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed: {r.stderr.strip()}")
    return r.stdout


def _stamp(t):
    return t.strftime("%Y%m%d%H%M%SZ")


class TestPki:
    def __init__(self, root):
        self.root = root
        os.makedirs(root, exist_ok=True)

    def _path(self, *parts):
        return os.path.join(self.root, *parts)

    def _new_key(self, name):
        key = self._path(f"{name}.key")
        _run(["openssl", "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", key])
        os.chmod(key, 0o600)
        return key

    def ca(self, name):
        """A self-signed CA valid from yesterday for 30 days."""
        key = self._new_key(name)
        cert = self._path(f"{name}.pem")
        _run(["openssl", "req", "-x509", "-new", "-key", key, "-out", cert, "-days", "30", "-subj", f"/CN={name}",
              "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign"])
        ca_dir = self._path(f"{name}.ca")
        os.makedirs(ca_dir, exist_ok=True)
        open(os.path.join(ca_dir, "index.txt"), "w").close()
        with open(os.path.join(ca_dir, "serial"), "w") as f:
            f.write("1000\n")
        with open(os.path.join(ca_dir, "ca.cnf"), "w") as f:
            f.write(_CA_CONFIG.format(db=os.path.join(ca_dir, "index.txt"), dir=ca_dir,
                                      serial=os.path.join(ca_dir, "serial")))
        return Cert(name=name, cert=cert, key=key)

    def issue(self, ca, name, dns=(), ips=(), uris=(), emails=(), expired=False, days=30, out_name=None):
        """A leaf certificate for `name` (its CN) with the given SANs, signed
        by `ca`. `expired`: valid only for a day in 2020. `out_name` names
        the files (default `name`), so one identity can be issued twice."""
        base = out_name or name
        key = self._new_key(base)
        csr = self._path(f"{base}.csr")
        cert = self._path(f"{base}.pem")
        _run(["openssl", "req", "-new", "-key", key, "-out", csr, "-subj", f"/CN={name}"])
        sans = ([f"DNS:{d}" for d in dns] + [f"IP:{i}" for i in ips] + [f"URI:{u}" for u in uris] +
                [f"email:{e}" for e in emails])
        ext = self._path(f"{base}.ext")
        with open(ext, "w") as f:
            if sans:
                f.write("subjectAltName=" + ",".join(sans) + "\n")
            f.write("basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
                    "extendedKeyUsage=serverAuth,clientAuth\n")
        now = datetime.datetime.now(datetime.timezone.utc)
        if expired:
            start, end = datetime.datetime(2020, 1, 1), datetime.datetime(2020, 1, 2)
        else:
            start, end = now - datetime.timedelta(days=1), now + datetime.timedelta(days=days)
        ca_dir = self._path(f"{ca.name}.ca")
        _run(["openssl", "ca", "-batch", "-notext", "-config", os.path.join(ca_dir, "ca.cnf"), "-cert", ca.cert,
              "-keyfile", ca.key, "-in", csr, "-out", cert, "-startdate", _stamp(start), "-enddate", _stamp(end),
              "-extfile", ext])
        return Cert(name=name, cert=cert, key=key, ca=ca, sans=sans)


def subject_alt_names(cert_path):
    """The SAN line of a certificate, as openssl prints it."""
    return _run(["openssl", "x509", "-in", cert_path, "-noout", "-ext", "subjectAltName"]).strip()


def replace_atomically(src, dst):
    """Copies `src` to a temporary file beside `dst`, then renames it over
    `dst`: what cert-manager and SPIFFE helpers do when they rotate."""
    tmp = dst + ".tmp-rotate"
    with open(src, "rb") as f, open(tmp, "wb") as g:
        g.write(f.read())
        g.flush()
        os.fsync(g.fileno())
    os.chmod(tmp, os.stat(src).st_mode & 0o777)
    os.rename(tmp, dst)

#!/usr/bin/env python3
"""kvrelay-server's transport security, identities and authorization,
against real processes and certificates made by openssl at test time.

  - bad credentials, each with its exact code and nothing visible after it:
    plaintext on the TLS port, an untrusted CA, an expired certificate, a
    certificate from another CA, a relay certificate outside
    --peer-identity calling Forward, no token, a wrong token, a token from
    an older tokens file after reload, agent X fetching Y's mailbox,
    publishing as Y, acking Y's message, closing a session it is not in,
    reading the status of a message it is no party to;
  - a three-relay chain over mTLS, every agent with a token: the message
    arrives with its parent by reference, the destination records which
    relay forwarded it, deliveries are reported back;
  - a peer speaks only for its own agents (a forged sender is refused); a
    refusal dead-letters at the sender with its reason; a destination whose
    certificate names another host is never sent to (bad_certificate);
  - a relay with routes takes a publish only from its own agents;
  - certificate rotation by atomic rename: a new connection sees the new
    certificate while a call in progress completes;
  - start-up refusals (exit 2) and --insecure with its gauge;
  - the health port serves grpc.health.v1 alone;
  - kvrelay_auth_failures_total counts each refusal by reason, and no token
    ever appears in a log.
"""
import argparse
import hashlib
import os
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "testlib"))
import kvrelay_testlib as tl  # noqa: E402
from certs import TestPki, replace_atomically  # noqa: E402
from kvrelay_testlib import Server  # noqa: E402

import grpc  # noqa: E402
import numpy as np  # noqa: E402

import kvrelay  # noqa: E402
from kvrelay.v1 import relay_pb2 as pb  # noqa: E402
from kvrelay.v1 import relay_pb2_grpc as pbg  # noqa: E402

ARGS = None
OK, PD, UA, UV = (grpc.StatusCode.OK, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED,
                  grpc.StatusCode.UNAVAILABLE)


def make_turn(seed, layers=2, H=2, S=4, d=32, n_prompt=24, n_gen=4):
    rng = np.random.default_rng(seed)
    ls = []
    for _ in range(layers):
        ls.append(kvrelay.TurnLayer(
            prompt_k=rng.standard_normal((H, n_prompt, d), dtype=np.float32),
            prompt_v=rng.standard_normal((H, n_prompt, d), dtype=np.float32),
            gen_k=rng.standard_normal((H, n_gen, d), dtype=np.float32),
            gen_v=rng.standard_normal((H, n_gen, d), dtype=np.float32),
            score=rng.random((S, n_prompt), dtype=np.float32)))
    return kvrelay.Turn(ls, dtype="F32")


def write_tokens(path, tokens):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write("# agent tokens (SHA-256 only)\n")
        for agent, tok in tokens.items():
            f.write(f"{agent} sha256:{hashlib.sha256(tok.encode()).hexdigest()}\n")
    os.replace(tmp, path)


def auth_failures(server):
    out = {}
    for (name, labels), v in tl.scrape(server).items():
        if name == "kvrelay_auth_failures_total":
            out[dict(labels)["reason"]] = v
    return out


def gauge(server, name):
    for (n, labels), v in tl.scrape(server).items():
        if n == name:
            return v
    return None


def served_cert_der(host, port, ca):
    """The DER certificate the TLS port presents to a new connection."""
    ctx = ssl.create_default_context(cafile=ca)
    ctx.check_hostname = False
    ctx.set_alpn_protocols(["h2"])
    with socket.create_connection((host, port), timeout=5) as raw:
        with ctx.wrap_socket(raw) as s:
            return s.getpeercert(binary_form=True)


def read(path):
    with open(path, "rb") as f:
        return f.read()


def pem_der(path):
    with open(path) as f:
        return ssl.PEM_cert_to_DER_cert(f.read())


def code_of(fn):
    try:
        fn()
        return OK, ""
    except grpc.RpcError as e:
        return e.code(), e.details() or ""


class Pki:
    """Everything the tests present: one CA, the relays' certificates, and
    the bad ones."""

    def __init__(self, root):
        p = TestPki(root)
        self.ca = p.ca("kvrelay-test-ca")
        self.relay = {n: p.issue(self.ca, f"relay-{n}", dns=[f"relay-{n}.mesh.test", "localhost"],
                                 ips=[f"127.0.0.1{i}"])
                      for i, n in enumerate("abcde", start=1)}
        # Relay E's certificate names neither its host nor a peer identity.
        self.relay["e"] = p.issue(self.ca, "relay-e-wrong", dns=["elsewhere.other.test"], ips=["127.0.0.99"],
                                  out_name="relay-e-wrong")
        self.rotated_a = p.issue(self.ca, "relay-a", dns=["relay-a.mesh.test", "localhost"], ips=["127.0.0.11"],
                                 out_name="relay-a-rotated")
        self.rogue = p.issue(self.ca, "rogue", dns=["rogue.other.test"])
        # An email SAN under the relays' domain is no relay identity.
        self.mailer = p.issue(self.ca, "mailer", emails=["x@y.mesh.test"])
        self.expired = p.issue(self.ca, "relay-b", dns=["relay-b.mesh.test"], ips=["127.0.0.12"], expired=True,
                               out_name="relay-b-expired")
        other = p.ca("another-ca")
        self.other_ca = other
        self.stranger = p.issue(other, "relay-b", dns=["relay-b.mesh.test"], ips=["127.0.0.12"],
                                out_name="relay-b-stranger")


class SecurityTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="kvrelay-sec-")
        cls.pki = Pki(os.path.join(cls.dir, "pki"))
        # Relay A's served files are copies, so rotation can replace them.
        cls.a_cert = os.path.join(cls.dir, "a.crt")
        cls.a_key = os.path.join(cls.dir, "a.key")
        shutil.copy(cls.pki.relay["a"].cert, cls.a_cert)
        shutil.copy(cls.pki.relay["a"].key, cls.a_key)
        agents = {"a1": "a", "a2": "b", "a3": "c", "a4": "d", "a5": "e"}
        cls.tokens = {a: f"tok-{a}-" + hashlib.sha256(a.encode()).hexdigest()[:24] for a in agents}
        cls.tokens_file = os.path.join(cls.dir, "tokens")
        write_tokens(cls.tokens_file, cls.tokens)
        cls.ports = {n: tl.free_port(f"127.0.0.1{i}") for i, n in enumerate("abcde", start=1)}
        cls.target = {n: f"127.0.0.1{i}:{cls.ports[n]}" for i, n in enumerate("abcde", start=1)}
        routes = [x for a, r in agents.items() for x in ("--route", f"{a}={cls.target[r]}")]
        cls.relays = {}
        for n in "abcde":
            cert, key = (cls.a_cert, cls.a_key) if n == "a" else (cls.pki.relay[n].cert, cls.pki.relay[n].key)
            # D takes forwards only from B: A's are refused.
            peers = ["relay-b.mesh.test"] if n == "d" else ["*.mesh.test"]
            args = ["--listen", cls.target[n], "--metrics-listen", "127.0.0.1:0", "--advertise", cls.target[n],
                    "--tls-cert", cert, "--tls-key", key, "--tls-client-ca", cls.pki.ca.cert,
                    "--tokens-file", cls.tokens_file, "--forward-timeout-seconds", "4",
                    "--forward-stall-seconds", "2", *routes]
            for p in peers:
                args += ["--peer-identity", p]
            if n == "a":
                args += ["--local-listen", f"unix:{cls.dir}/a.sock", "--health-listen", "127.0.0.1:0"]
            cls.relays[n] = Server(ARGS.server, cls.dir, args=args, name=f"relay-{n}", timeout=30)

    @classmethod
    def tearDownClass(cls):
        logs = {n: r.log() for n, r in cls.relays.items()}
        for r in cls.relays.values():
            r.stop()
        for n, log in logs.items():
            for agent, tok in cls.tokens.items():
                if tok in log:
                    raise AssertionError(f"relay {n}'s log contains agent {agent}'s token")
        shutil.rmtree(cls.dir, ignore_errors=True)

    # ---- helpers ----

    def client(self, relay, agent=None, token=None, ca=None, cert=None):
        kw = dict(tls_ca=ca or self.pki.ca.cert, token=self.tokens[agent] if agent else (token or ""))
        if cert:
            kw.update(tls_cert=cert.cert, tls_key=cert.key)
        return kvrelay.Client(self.target[relay], **kw)

    def stub(self, relay, cert=None, ca=None):
        creds = grpc.ssl_channel_credentials(read(ca or self.pki.ca.cert), read(cert.key) if cert else None,
                                             read(cert.cert) if cert else None)
        return pbg.RelayStub(grpc.secure_channel(self.target[relay], creds))

    def forward_calls(self, relay):
        return sum(v for (n, labels), v in tl.scrape(self.relays[relay]).items()
                   if n == "kvrelay_rpcs_total" and dict(labels).get("method") == "Forward")

    def stats(self, relay, agent):
        with self.client(relay, agent) as c:
            return c.stats()

    def visible(self, relay, agent):
        """What a refused call must leave unchanged."""
        s = self.stats(relay, agent)
        return (s.messages_committed, s.messages_delivered, s.messages_acked, s.sessions, s.mailbox_messages,
                s.mailbox_bytes, s.inflight_bytes, s.store_bytes)

    def assert_refused(self, code, fn, contains=None):
        got, details = code_of(fn)
        self.assertEqual(got, code, details)
        if contains:
            self.assertIn(contains, details)
        for tok in self.tokens.values():
            self.assertNotIn(tok, details)
        return details

    def status(self, relay, agent, sess, mid):
        return self.stub(relay).MessageStatus(pb.MessageStatusRequest(session_id=sess, message_id=mid), timeout=5,
                                              metadata=[("authorization", "Bearer " + self.tokens[agent])])

    def wait_state(self, relay, agent, sess, mid, state, seconds):
        """The message's status at `relay` once its first recipient reaches
        `state` (asserted), asked as `agent`."""
        deadline = time.time() + seconds
        while True:
            st = self.status(relay, agent, sess, mid)
            if st.recipients[0].state == state or time.time() > deadline:
                break
            time.sleep(0.2)
        self.assertEqual(pb.RecipientState.Name(st.recipients[0].state), pb.RecipientState.Name(state))
        return st

    def forward_header(self, sender, session="forged", mid="m-forged"):
        h = pb.ForwardHeader(protocol_version=1, origin="x:1", recipients=["a3"])
        h.message.session_id, h.message.message_id, h.message.sender = session, mid, sender
        return pb.ForwardRequest(header=h)

    # ---- tests ----

    def test_bad_transport_credentials_are_unavailable(self):
        before = self.visible("a", "a1")
        f0 = auth_failures(self.relays["a"])
        cases = {
            "plaintext client on the TLS port":
                lambda: pbg.RelayStub(grpc.insecure_channel(self.target["a"])).Stats(pb.StatsRequest(), timeout=5),
            "a CA that did not sign the relay's certificate":
                lambda: self.stub("a", ca=self.pki.other_ca.cert).Stats(
                    pb.StatsRequest(), timeout=5, metadata=[("authorization", "Bearer " + self.tokens["a1"])]),
            "an expired client certificate":
                lambda: self.stub("a", cert=self.pki.expired).Forward(iter([self.forward_header("a2")]), timeout=5),
            "a client certificate from another CA":
                lambda: self.stub("a", cert=self.pki.stranger).Forward(iter([self.forward_header("a2")]),
                                                                        timeout=5),
        }
        for name, fn in cases.items():
            with self.subTest(name):
                self.assert_refused(UV, fn)
        self.assertEqual(self.visible("a", "a1"), before)
        # The handshake failures never reached a call: nothing counted as a token or peer failure.
        f1 = auth_failures(self.relays["a"])
        self.assertEqual(f1["bad_token"], f0["bad_token"])
        self.assertEqual(f1["peer_not_allowed"], f0["peer_not_allowed"])

    def test_bad_agent_credentials_are_unauthenticated(self):
        turn = make_turn(1)
        before = self.visible("a", "a1")
        f0 = auth_failures(self.relays["a"])
        for name, token in (("no token", ""), ("a wrong token", "tok-nobody"),
                            ("a token with a byte more", self.tokens["a1"] + "x")):
            with self.subTest(name), self.client("a", token=token) as c:
                for what, fn in (("stats", c.stats), ("fetch", lambda: c.fetch("s-bad", "a1", timeout=2)),
                                 ("ack", lambda: c.ack("s-bad", "a1", "m-1")),
                                 ("close", lambda: c.close_session("s-bad")),
                                 ("compress", lambda: c.compress(turn, "h2o-head:k=8")),
                                 ("publish", lambda: c.publish(turn, "s-bad", "a1", ["a1"], retries=0))):
                    with self.subTest(what):
                        self.assert_refused(UA, fn)
        self.assertEqual(self.visible("a", "a1"), before)
        f1 = auth_failures(self.relays["a"])
        self.assertEqual(f1["missing_credentials"] - f0["missing_credentials"], 6)
        self.assertEqual(f1["bad_token"] - f0["bad_token"], 12)

    def test_a_token_from_an_older_tokens_file_is_refused_after_reload(self):
        old, new = self.tokens["a1"], "tok-a1-rotated-" + "r" * 20
        try:
            write_tokens(self.tokens_file, {**self.tokens, "a1": new})
            deadline = time.time() + 10
            while time.time() < deadline:
                with self.client("a", token=old) as c:
                    if code_of(c.stats)[0] == UA:
                        break
                time.sleep(0.2)
            with self.client("a", token=old) as c:
                self.assert_refused(UA, c.stats, "not one --tokens-file lists")
            with self.client("a", token=new) as c:
                self.assertGreaterEqual(c.stats().messages_committed, 0)
            # A bad file keeps the last good tokens.
            with open(self.tokens_file + ".tmp", "w") as f:
                f.write("a1 sha256:nothex\n")
            os.replace(self.tokens_file + ".tmp", self.tokens_file)
            self.assertTrue(tl.wait_for(lambda: "keeping the last good tokens" in self.relays["a"].log(), 15),
                            "a bad tokens file is logged within 15 s (polled every second)")
            with self.client("a", token=new) as c:
                c.stats()
        finally:
            reloads = self.relays["a"].log().count("reloaded --tokens-file=")
            write_tokens(self.tokens_file, self.tokens)
            tl.wait_for(lambda: self.relays["a"].log().count("reloaded --tokens-file=") > reloads, 15)

    def test_an_agent_acts_only_as_itself(self):
        turn = make_turn(2)
        sess = "s-authz"
        with self.client("a", "a1") as a1, kvrelay.Client(f"unix:{self.dir}/a.sock", token="") as pod:
            # Two agents on relay A: a1 (token) and "a6" through the pod's socket.
            r = pod.publish(turn, sess, "a6", ["a6"], policy="full")
            before = self.visible("a", "a1")
            self.assert_refused(PD, lambda: a1.fetch(sess, "a6", timeout=2), 'agent: caller is agent "a1", not "a6"')
            self.assert_refused(PD, lambda: a1.publish(turn, sess, "a6", ["a6"], retries=0),
                                'header.sender: caller is agent "a1", not "a6"')
            self.assert_refused(PD, lambda: a1.close_session(sess), "sent or received no message")
            self.assert_refused(PD, lambda: a1.ack(sess, "a6", r.message_id), 'not "a6"')
            st = self.stub("a")
            # Another agent's message reads as missing: the same answer as an
            # id that does not exist.
            for mid in (r.message_id, "m-nosuch"):
                self.assert_refused(grpc.StatusCode.NOT_FOUND, lambda: st.MessageStatus(
                    pb.MessageStatusRequest(session_id=sess, message_id=mid), timeout=5,
                    metadata=[("authorization", "Bearer " + self.tokens["a1"])]),
                    f"message_id: no message '{mid}' visible to agent \"a1\" in session '{sess}'")
            self.assertEqual(self.visible("a", "a1"), before)
            # Nothing happened to a6's message: it is fetched and acked by a6.
            m = pod.fetch(sess, "a6", timeout=5)
            self.assertEqual(m.message_id, r.message_id)
            pod.ack(sess, "a6", m.message_id)
            # A participant may close it.
            a1.publish(turn, sess, "a1", ["a1"], policy="full")
            self.assertGreaterEqual(a1.close_session(sess), 1)

    def test_a_relay_with_routes_takes_publishes_only_from_its_agents(self):
        with kvrelay.Client(f"unix:{self.dir}/a.sock", token="") as pod:
            self.assert_refused(PD, lambda: pod.publish(make_turn(3), "s-local", "a2", ["a1"], retries=0),
                                'header.sender: agent "a2" is not local to this relay')

    def test_forward_needs_a_peer_certificate_allowed_here(self):
        before = self.visible("c", "a3")
        f0 = auth_failures(self.relays["c"])
        self.assert_refused(UA, lambda: self.stub("c").Forward(iter([self.forward_header("a2")]), timeout=5),
                            "need a verified client certificate")
        self.assert_refused(PD, lambda: self.stub("c", cert=self.pki.rogue).Forward(
            iter([self.forward_header("a2")]), timeout=5), "match no --peer-identity")
        self.assert_refused(PD, lambda: self.stub("c", cert=self.pki.mailer).Forward(
            iter([self.forward_header("a2")]), timeout=5), "match no --peer-identity")
        # Relay B's certificate, speaking for a1 (whose relay is A): refused.
        self.assert_refused(PD, lambda: self.stub("c", cert=self.pki.relay["b"]).Forward(
            iter([self.forward_header("a1")]), timeout=5), 'header.message.sender: peer relay "relay-b.mesh.test"')
        # And a propagated close from a peer that exchanged nothing of the session.
        self.assert_refused(PD, lambda: self.stub("c", cert=self.pki.relay["b"]).CloseSession(
            pb.CloseSessionRequest(session_id="s-nothing", propagated=True), timeout=5), "exchanged no message")
        self.assertEqual(self.visible("c", "a3"), before)
        f1 = auth_failures(self.relays["c"])
        self.assertEqual(f1["missing_credentials"] - f0["missing_credentials"], 1)
        self.assertEqual(f1["peer_not_allowed"] - f0["peer_not_allowed"], 2)
        self.assertEqual(f1["forbidden"] - f0["forbidden"], 2)

    def test_a_peer_cannot_splice_in_a_message_it_does_not_hold(self):
        """Ancestor elision names a message of the session the destination
        holds; a peer may name only one it holds itself, else the
        destination answers ancestor_missing (as for one it lacks)."""
        sess = "s-splice"
        with self.client("c", "a3") as a3:
            # a3's own message on relay C: relay B never held it.
            r = a3.publish(make_turn(40), sess, "a3", ["a3"], policy="full")
            m = a3.fetch(sess, "a3", timeout=10)
            tokens = m.layers[0].k.shape[1]
            req = self.forward_header("a2", session=sess, mid="m-splice")
            h = req.header.message
            h.layers, h.kv_heads, h.head_dim, h.dtype, h.n_history = 2, 2, 32, pb.DTYPE_F32, tokens
            req.header.ancestor_id, req.header.ancestor_tokens = r.message_id, tokens
            resp = self.stub("c", cert=self.pki.relay["b"]).Forward(iter([req]), timeout=5)
            self.assertTrue(resp.ancestor_missing)
            a3.ack(sess, "a3", m.message_id)
            self.assertEqual(a3.close_session(sess), 1)  # only a3's message was ever there

    def test_another_senders_message_id_tells_nothing(self):
        sess = "s-ids"
        with self.client("a", "a1") as a1, kvrelay.Client(f"unix:{self.dir}/a.sock", token="") as pod:
            pod.publish(make_turn(41), sess, "a6", ["a6"], policy="full", message_id="turn-1")
            d = self.assert_refused(grpc.StatusCode.ALREADY_EXISTS, lambda: a1.publish(
                make_turn(42), sess, "a1", ["a1"], policy="full", message_id="turn-1", retries=0),
                "by another sender")
            self.assertNotIn("a6", d)
            pod.close_session(sess)

    def test_reports_come_only_from_the_recipients_relay(self):
        sess = "s-report"
        with self.client("a", "a1") as a1, self.client("b", "a2") as a2:
            r = a1.publish(make_turn(43), sess, "a1", ["a2"], policy="h2o-head:k=8")
            a2.fetch(sess, "a2", timeout=20)
            # Relay C reporting for a2 (whose relay is B): refused.
            self.assert_refused(PD, lambda: self.stub("a", cert=self.pki.relay["c"]).ReportRecipient(
                pb.ReportRecipientRequest(session_id=sess, message_id=r.message_id, agent="a2",
                                          state=pb.RECIPIENT_STATE_ACKED), timeout=5), "is not the relay of agent")
            st = self.wait_state("a", "a1", sess, r.message_id, pb.RECIPIENT_STATE_DELIVERED, 10)
            self.assertEqual(st.recipients[0].state, pb.RECIPIENT_STATE_DELIVERED)  # not acked by C's say
            a1.close_session(sess)

    def test_chain_over_mtls(self):
        sess = "s-chain"
        t1, t2 = make_turn(10), make_turn(11)
        with self.client("a", "a1") as a1, self.client("b", "a2") as a2, self.client("c", "a3") as a3:
            r1 = a1.publish(t1, sess, "a1", ["a2"], policy="h2o-head:k=8")
            m1 = a2.fetch(sess, "a2", timeout=20)
            self.assertEqual((m1.message_id, m1.sender), (r1.message_id, "a1"))
            a2.ack(sess, "a2", m1.message_id)
            r2 = a2.publish(t2, sess, "a2", ["a3"], parent_id=m1.message_id, policy="h2o-head:k=8")
            m2 = a3.fetch(sess, "a3", timeout=20)
            self.assertEqual((m2.message_id, m2.parent_id), (r2.message_id, m1.message_id))
            self.assertEqual(m2.n_history, m1.n_history + m1.n_anchor + m1.n_kept + m1.n_gen)
            a3.ack(sess, "a3", m2.message_id)
            # The destination recorded which relay forwarded each message.
            self.assertEqual(self.status("c", "a3", sess, r2.message_id).forwarded_by, "relay-b.mesh.test")
            # Deliveries and acks come back to the sender's relay over mTLS.
            st = self.wait_state("a", "a1", sess, r1.message_id, pb.RECIPIENT_STATE_ACKED, 10)
            self.assertEqual(st.forwarded_by, "")
            # The close reaches every relay of the session (peers it exchanged
            # messages with), and no relay refuses one that comes back to it.
            forbidden = {n: auth_failures(self.relays[n])["forbidden"] for n in "abc"}
            a1.close_session(sess)
            deadline = time.time() + 10
            while time.time() < deadline and not self._closed("c", sess):
                time.sleep(0.2)
            self.assertTrue(self._closed("c", sess))
            time.sleep(1.0)  # any close passed back has arrived
            self.assertEqual({n: auth_failures(self.relays[n])["forbidden"] for n in "abc"}, forbidden)

    def _closed(self, relay, sess):
        return f"session closed session={sess}" in self.relays[relay].log()

    def test_refusal_dead_letters_at_the_sender(self):
        sess = "s-dead"
        with self.client("a", "a1") as a1:
            r = a1.publish(make_turn(20), sess, "a1", ["a4"], policy="h2o-head:k=8")
            st = self.wait_state("a", "a1", sess, r.message_id, pb.RECIPIENT_STATE_DEAD_LETTERED, 15)
            self.assertTrue(st.recipients[0].reason.startswith("PERMISSION_DENIED"), st.recipients[0].reason)
        self.assertGreaterEqual(auth_failures(self.relays["d"])["peer_not_allowed"], 1)

    def test_a_destination_whose_certificate_names_another_host_is_not_sent_to(self):
        sess = "s-wrong-host"
        forwards_e = self.forward_calls("e")
        f0 = auth_failures(self.relays["a"])["bad_certificate"]
        with self.client("a", "a1") as a1:
            r = a1.publish(make_turn(21), sess, "a1", ["a5"], policy="h2o-head:k=8")
            self.wait_state("a", "a1", sess, r.message_id, pb.RECIPIENT_STATE_DEAD_LETTERED, 20)
        self.assertGreater(auth_failures(self.relays["a"])["bad_certificate"], f0)
        self.assertEqual(self.forward_calls("e"), forwards_e)  # the handshake never completed

    def test_certificate_rotation_by_atomic_rename(self):
        host, port = self.target["a"].rsplit(":", 1)
        port = int(port)
        self.assertEqual(served_cert_der(host, port, self.pki.ca.cert), pem_der(self.pki.relay["a"].cert))
        sess = "s-rotate"
        got = {}
        with self.client("a", "a1") as waiting:
            waiting.stats()  # the connection is up before the rotation
            t = threading.Thread(target=lambda: got.update(m=waiting.fetch(sess, "a1", timeout=30)))
            t.start()
            time.sleep(0.5)
            try:
                replace_atomically(self.pki.rotated_a.key, self.a_key)
                replace_atomically(self.pki.rotated_a.cert, self.a_cert)
                deadline, der = time.time() + 15, None
                while time.time() < deadline:
                    try:
                        der = served_cert_der(host, port, self.pki.ca.cert)
                    except (ssl.SSLError, OSError):
                        der = None
                    if der == pem_der(self.pki.rotated_a.cert):
                        break
                    time.sleep(0.2)
                self.assertEqual(der, pem_der(self.pki.rotated_a.cert), "a new connection sees the new certificate")
                # A new client connection (over the new certificate) publishes; the
                # fetch that waited on the old connection gets the message.
                with self.client("a", "a1") as fresh:
                    r = fresh.publish(make_turn(30), sess, "a1", ["a1"], policy="full")
                t.join(35)
                self.assertFalse(t.is_alive())
                self.assertEqual(got["m"].message_id, r.message_id)
            finally:
                t.join(35)
                replace_atomically(self.pki.relay["a"].key, self.a_key)
                replace_atomically(self.pki.relay["a"].cert, self.a_cert)

    def test_the_health_port_serves_health_alone(self):
        a = self.relays["a"]
        self.assertTrue(a.health)
        rc, out, err = tl.run([ARGS.server, "health", f"--addr={a.health}"], timeout=20)
        self.assertEqual((rc, out.strip()), (0, "SERVING"), err)
        ch = grpc.insecure_channel(a.health)
        st = pbg.RelayStub(ch)
        for name, fn in (("Stats", lambda: st.Stats(pb.StatsRequest(), timeout=5)),
                         ("Fetch", lambda: list(st.Fetch(pb.FetchRequest(session_id="s", agent="a1"), timeout=5))),
                         ("Forward", lambda: st.Forward(iter([self.forward_header("a1")]), timeout=5)),
                         ("reflection", lambda: next(ch.stream_stream(
                             "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")(iter([b""]),
                                                                                              timeout=5)))):
            with self.subTest(name):
                self.assert_refused(grpc.StatusCode.UNIMPLEMENTED, fn)

    def test_metrics_say_secure(self):
        self.assertEqual(gauge(self.relays["a"], "kvrelay_insecure"), 0)
        self.assertEqual(set(auth_failures(self.relays["a"])),
                         {"missing_credentials", "bad_token", "bad_certificate", "peer_not_allowed", "forbidden"})


class StartupTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="kvrelay-sec-start-")
        p = TestPki(os.path.join(cls.dir, "pki"))
        cls.ca = p.ca("ca")
        cls.cert = p.issue(cls.ca, "relay", dns=["localhost"], ips=["127.0.0.1"])
        cls.other = p.issue(cls.ca, "other", dns=["localhost"])

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir, ignore_errors=True)

    def refused(self, *args):
        r = subprocess.run([ARGS.server, "--metrics-listen", "off", *args], capture_output=True, text=True,
                           timeout=30)
        self.assertEqual(r.returncode, 2, r.stderr)
        return r.stderr

    def test_plaintext_off_loopback_needs_insecure(self):
        err = self.refused("--listen", "0.0.0.0:0")
        self.assertIn("--tls-cert FILE --tls-key FILE", err)
        self.assertIn("--insecure", err)
        with Server(ARGS.server, self.dir, args=["--listen", "0.0.0.0:0", "--insecure", "--metrics-listen",
                                                 "127.0.0.1:0"], name="insecure") as s:
            self.assertEqual(gauge(s, "kvrelay_insecure"), 1)
            self.assertIn("--insecure", s.log())
        with Server(ARGS.server, self.dir, args=["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"],
                    name="loopback") as s:
            self.assertEqual(gauge(s, "kvrelay_insecure"), 0)

    def test_other_refusals(self):
        c = self.cert
        for args, says in (
                (["--listen", "127.0.0.1:0", "--local-listen", "0.0.0.0:0"], "--local-listen=0.0.0.0:0"),
                (["--listen", "127.0.0.1:0", "--tls-cert", c.cert], "--tls-cert: expected together with --tls-key"),
                (["--listen", "127.0.0.1:0", "--tls-client-ca", self.ca.cert], "needs --tls-cert"),
                (["--listen", "127.0.0.1:0", "--tls-cert", c.cert, "--tls-key", c.key, "--route", "x=127.0.0.1:9"],
                 "--tls-peer-ca"),
                (["--listen", "127.0.0.1:0", "--tls-cert", c.cert, "--tls-key", self.other.key],
                 "not the key of the certificate"),
                (["--listen", "127.0.0.1:0", "--local-auth", "token"], "needs --tokens-file"),
                (["--listen", "127.0.0.1:0", "--peer-identity", "*.*.x"], "--peer-identity"),
        ):
            with self.subTest(args=args):
                self.assertIn(says, self.refused(*args))


def main():
    global ARGS
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ARGS, rest = ap.parse_known_args()
    tl.unittest_main(rest, watchdog_s=400)


if __name__ == "__main__":
    main()

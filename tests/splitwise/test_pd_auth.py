"""PD peers that prove who they are: HMAC-signed side-channel messages, tcp KV reads and KV
references; forged, unsigned, replayed, stale and redirected requests are refused and counted, and
honest traffic is unchanged."""

from __future__ import annotations

import json
import socket
import time

import pytest
import torch
from support import ManualClock

from fastdeploy.engine.admission import Admission
from fastdeploy.splitwise import side_channel, tcp_transport
from fastdeploy.splitwise.pd_auth import (
    AuthError,
    PDAuth,
    PrefillTrust,
    load_pd_secret,
    set_process_auth,
)
from fastdeploy.splitwise.prefill_control import PrefillControl
from fastdeploy.splitwise.protocol import RemotePrefill, kv_layout, prompt_fingerprint
from fastdeploy.splitwise.side_channel import SideChannelError, SideChannelServer, send_control
from fastdeploy.splitwise.tcp_transport import TcpKVTransport

KEY = b"k" * 32
LAYOUT = kv_layout("m", "float32", 2, 2, 8, 4)


def reference(host="127.0.0.1", port=5601, **kw) -> dict:
    params = RemotePrefill(
        "p0", "p-1", host, port, [3, 4, 5], 11, 42, 30.0, {"transport": "tcp"}, LAYOUT,
        prompt_hash=prompt_fingerprint(range(11)),  # the prompt check_leg sends
    ).to_dict()  # fmt: skip
    return params | kw


# ------------------------------------------------------------------------- the MAC itself
def test_sign_then_verify_once_and_every_refusal_is_named_and_counted():
    clock = ManualClock(1000.0)
    auth = PDAuth(KEY, window_s=30, clock=clock)
    signed = auth.sign("side-channel", {"op": "CLAIM", "request_ids": ["r1"]})
    auth.verify("side-channel", signed)  # honest: accepted once
    cases = [
        ("unsigned", {"op": "CLAIM", "request_ids": ["r1"]}, "side-channel"),
        ("malformed", signed | {"auth": {"ts": "x"}}, "side-channel"),
        ("bad_signature", signed | {"request_ids": ["r2"]}, "side-channel"),  # altered
        ("bad_signature", PDAuth(b"w" * 32, clock=clock).sign("side-channel", {"op": "DONE"}),
         "side-channel"),  # another secret
        ("bad_signature", auth.sign("side-channel", {"op": "DONE"}), "kv-read"),  # purpose
        ("replayed", signed, "side-channel"),  # the same nonce again
    ]  # fmt: skip
    for reason, message, purpose in cases:
        with pytest.raises(AuthError, match=rf"\({reason}\)") as e:
            auth.verify(purpose, message)
        assert e.value.reason == reason
    old = auth.sign("side-channel", {"op": "DONE"})
    clock.now += 31
    with pytest.raises(AuthError, match=r"\(stale\): signed 31.0 s ago .*within 30 s"):
        auth.verify("side-channel", old)
    clock.now -= 62  # a message from 31 s in the future is as stale
    with pytest.raises(AuthError, match=r"\(stale\): signed 31.0 s in the future"):
        auth.verify("side-channel", old)
    assert auth.rejected == {
        "unsigned": 1,
        "malformed": 1,
        "bad_signature": 3,
        "replayed": 1,
        "stale": 2,
    }


def test_the_secret_comes_from_a_file_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("FD_PD_SECRET", raising=False)
    assert load_pd_secret(None) is None
    monkeypatch.setenv("FD_PD_SECRET", "e" * 20)
    assert load_pd_secret(None) == b"e" * 20
    path = tmp_path / "secret"
    path.write_bytes(b"f" * 32 + b"\n")
    assert load_pd_secret(str(path)) == b"f" * 32  # the file wins, newline stripped
    path.write_bytes(b"short\n")
    with pytest.raises(ValueError, match="--pd-secret-file=.* has 5 bytes; allowed: at least 16"):
        load_pd_secret(str(path))
    with pytest.raises(ValueError, match="'/nonexistent' cannot be read"):
        load_pd_secret("/nonexistent")


# ------------------------------------------------------------------------- side channel
def raw_exchange(port: int, message: dict) -> dict:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall((json.dumps(message) + "\n").encode())
        return json.loads(sock.makefile("rb").readline())


def test_side_channel_refuses_unsigned_forged_replayed_and_stale_messages():
    seen = []
    auth = PDAuth(KEY)
    server = SideChannelServer("127.0.0.1", 0, lambda op, m: seen.append(op) or {}, auth).start()
    try:
        # Honest: signed by a peer with the secret (explicitly, or as the process default).
        assert send_control("127.0.0.1", server.port, "HEARTBEAT", ["r"], auth=PDAuth(KEY)) == {
            "ok": True
        }
        set_process_auth(PDAuth(KEY))
        try:
            assert send_control("127.0.0.1", server.port, "DONE", ["r"]) == {"ok": True}
        finally:
            set_process_auth(None)
        assert seen == ["HEARTBEAT", "DONE"]
        with pytest.raises(SideChannelError, match=r"ABORT .* refused: .*\(unsigned\)"):
            send_control("127.0.0.1", server.port, "ABORT", ["r"])
        with pytest.raises(SideChannelError, match=r"refused: .*\(bad_signature\)"):
            send_control("127.0.0.1", server.port, "ABORT", ["r"], auth=PDAuth(b"x" * 32))
        signed = PDAuth(KEY).sign("side-channel", {"op": "ABORT", "request_ids": ["r"]})
        assert raw_exchange(server.port, signed) == {"ok": True}
        replay = raw_exchange(server.port, signed)
        assert replay["ok"] is False and replay["reason"] == "replayed"
        forged = signed | {"request_ids": ["someone-elses"]}
        assert raw_exchange(server.port, forged)["reason"] == "bad_signature"
        stale = PDAuth(KEY, clock=lambda: time.time() - 60).sign(
            "side-channel", {"op": "DONE", "request_ids": ["r"]}
        )
        reply = raw_exchange(server.port, stale)
        assert reply["ok"] is False and reply["reason"] == "stale"
        assert "allowed: within 30 s" in reply["error"]
        assert seen == ["HEARTBEAT", "DONE", "ABORT"]  # no refused message reached the handler
        assert auth.rejected == {"unsigned": 1, "bad_signature": 2, "replayed": 1, "stale": 1}
    finally:
        server.close()


def test_forged_heartbeats_do_not_hold_prefill_blocks():
    """The probe's attack: HEARTBEATs from anyone kept 78 of 90 blocks held. With a secret they
    are refused; and even an honest peer's heartbeats end at ``max_hold_s``."""
    clock = ManualClock()
    control = PrefillControl(lease_s=2, transfer_s=5, clock=clock, max_hold_s=10)
    server = SideChannelServer("127.0.0.1", 0, control.handle, PDAuth(KEY)).start()
    try:
        control.hold("victim", [3, 4])
        control.hold("honest", [5])
        for t in (1.5, 3.0, 4.5, 6.0, 7.5, 9.0, 10.5):
            clock.now = t
            with pytest.raises(SideChannelError, match=r"\(unsigned\)"):
                send_control("127.0.0.1", server.port, "HEARTBEAT", ["victim"])
            send_control("127.0.0.1", server.port, "HEARTBEAT", ["honest"], auth=PDAuth(KEY))
            freed = control.take_freed()
            if t == 3.0:  # the forged heartbeats did not extend the 2 s lease
                assert freed == [("victim", [3, 4], "expired")]
            elif t == 10.5:  # the honest ones, at most 10 s after the hold
                assert freed == [("honest", [5], "expired")]
            else:
                assert freed == []
    finally:
        server.close()


def test_side_channel_caps_connections_and_closes_idle_ones(monkeypatch):
    monkeypatch.setattr(side_channel._Connection, "timeout", 1.0)
    server = SideChannelServer("127.0.0.1", 0, lambda op, m: {}, max_connections=2).start()
    idle = []
    try:
        idle = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(2)]
        time.sleep(0.2)
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as extra:
            line = extra.makefile("rb").readline()
        assert b"too many connections; allowed: 2 at once (--pd-max-connections)" in line
        assert server.refused_connections == 1
        for sock in idle:  # the idle ones are closed after the timeout, freeing their slots
            assert sock.recv(1) == b""
        time.sleep(0.2)
        assert send_control("127.0.0.1", server.port, "HEARTBEAT", ["r"]) == {"ok": True}
    finally:
        for sock in idle:
            sock.close()
        server.close()


# ------------------------------------------------------------------------- tcp KV reads
SHAPE = (12, 2, 4, 2, 8)


@pytest.fixture
def kv_pair():
    g = torch.Generator().manual_seed(0)
    src = [torch.randn(SHAPE, generator=g) for _ in range(2)]
    prefill = TcpKVTransport(auth=PDAuth(KEY), max_connections=2)
    prefill.register(src)
    transports = [prefill]
    yield src, prefill, transports
    for t in transports:
        t.close()


def decode_transport(transports, auth):
    t = TcpKVTransport(auth=auth)
    t.register([torch.zeros(SHAPE) for _ in range(2)])
    transports.append(t)
    return t


def test_tcp_reads_must_be_signed_and_fresh(kv_pair):
    src, prefill, transports = kv_pair
    meta = prefill.local_metadata()
    honest = decode_transport(transports, PDAuth(KEY))
    transfer = honest.start_pull("r1", meta, [3, 4], [1, 2])
    assert transfer.wait(30) and transfer.error is None
    assert torch.equal(honest.kv_caches[1][[1, 2]], src[1][[3, 4]])
    for auth, reason in ((None, "unsigned"), (PDAuth(b"x" * 32), "bad_signature")):
        thief = decode_transport(transports, auth)
        transfer = thief.start_pull("r2", meta, [3, 4], [1, 2])
        assert transfer.wait(30) and f"({reason})" in transfer.error
        assert torch.count_nonzero(thief.kv_caches[0]) == 0
    # A captured signed read, sent again: refused before any byte of KV.
    line = json.dumps(PDAuth(KEY).sign("kv-read", {"block_ids": [3]})).encode() + b"\n"
    answers = []
    for _ in range(2):
        with socket.create_connection(("127.0.0.1", meta["port"]), timeout=5) as sock:
            sock.sendall(line)
            answers.append(json.loads(tcp_transport._read_line(sock, time.monotonic() + 5)))
    assert answers[0]["ok"] is True
    assert answers[1]["ok"] is False and "(replayed)" in answers[1]["error"]
    assert prefill.auth.rejected == {"unsigned": 1, "bad_signature": 1, "replayed": 1}


def test_tcp_port_times_out_silent_clients_and_caps_connections(kv_pair, monkeypatch):
    """The probe's attack: 300 idle connections held 300 threads. Now a client has
    ``REQUEST_DEADLINE_S`` to send its request, and at most ``max_connections`` are served."""
    monkeypatch.setattr(tcp_transport, "REQUEST_DEADLINE_S", 1.0)
    src, prefill, transports = kv_pair
    port = prefill.local_metadata()["port"]
    idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(2)]
    try:
        time.sleep(0.2)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as extra:
            answer = json.loads(tcp_transport._read_line(extra, time.monotonic() + 5))
        assert answer["ok"] is False and "PD KV port: too many connections" in answer["error"]
        assert prefill.refused_connections == 1
        start = time.monotonic()
        for sock in idle:
            sock.sendall(b'{"block_ids": [3]')  # a trickle that never ends its line
        for sock in idle:
            assert sock.recv(1) == b""  # closed at the request deadline
        assert time.monotonic() - start < 4
    finally:
        for sock in idle:
            sock.close()
    honest = decode_transport(transports, PDAuth(KEY))
    transfer = honest.start_pull("r1", prefill.local_metadata(), [5], [1])
    assert transfer.wait(30) and transfer.error is None


# ------------------------------------------------------------------------- decode admission
def check_leg(trust, params):
    admission = Admission(64, 100, False, splitwise_role="decode", kv_layout=LAYOUT, block_size=4)
    admission = Admission(**{**admission.__dict__, "pd_trust": trust})
    return admission.check(list(range(11)), None, params)


def test_a_decode_node_refuses_prefill_addresses_it_does_not_trust():
    """The probe's attack: a client wrote any host and port into kv_transfer_params and the
    decode node connected there. Now the address is checked before anything connects."""
    allowed = PrefillTrust(allowed=(("10.0.0.5", 5601), ("::1", 5602)))
    assert check_leg(allowed, reference("10.0.0.5", 5601)).remote_host == "10.0.0.5"
    assert check_leg(allowed, reference("::1", 5602)).remote_port == 5602
    with pytest.raises(ValueError) as e:
        check_leg(allowed, reference("169.254.169.254", 80))
    assert str(e.value) == (
        "kv_transfer_params.remote_host:remote_port=169.254.169.254:80 is not allowed; "
        "allowed (--pd-allowed-prefill): 10.0.0.5:5601,::1:5602"
    )
    with pytest.raises(ValueError, match="10.0.0.5:5602 is not allowed"):
        check_leg(allowed, reference("10.0.0.5", 5602))  # the right host, another port
    # Without a secret or a list: loopback prefill nodes only (the default trust too).
    for trust in (PrefillTrust(), None):
        assert check_leg(trust, reference("127.0.0.1")) is not None
        with pytest.raises(ValueError, match="remote_host='10.1.2.3' is not allowed.*loopback"):
            check_leg(trust, reference("10.1.2.3"))


def test_a_decode_node_with_a_secret_takes_only_signed_unaltered_references():
    trust = PrefillTrust(key=KEY)
    signed = PDAuth(KEY).sign_reference(reference("10.0.0.7", 5601))
    assert check_leg(trust, signed).remote_host == "10.0.0.7"  # any host: it proved the secret
    assert check_leg(trust, json.loads(json.dumps(signed))) is not None  # through a router
    with pytest.raises(AuthError, match=r"\(unsigned\).*prefill node's signature"):
        check_leg(trust, reference("10.0.0.7", 5601))
    for change in ({"remote_host": "10.6.6.6"}, {"remote_block_ids": [1, 2, 3]},
                   {"transport": {"transport": "tcp", "host": "10.6.6.6", "port": 1}}):  # fmt: skip
        with pytest.raises(AuthError, match=r"\(bad_signature\).*altered"):
            check_leg(trust, signed | change)
    forged = PDAuth(b"x" * 32).sign_reference(reference("10.0.0.7", 5601))
    with pytest.raises(AuthError, match=r"\(bad_signature\)"):
        check_leg(trust, forged)
    both = PrefillTrust(allowed=(("10.0.0.8", 5601),), key=KEY)
    with pytest.raises(ValueError, match="10.0.0.7:5601 is not allowed"):
        check_leg(both, signed)  # signed, but not on the list


def test_pd_flags_are_checked_once_with_clear_errors():
    from fastdeploy.config.splitwise import SplitwiseConfig
    from fastdeploy.engine.args_utils import _split_peers

    assert _split_peers("10.0.0.5:5601, [::1]:5602") == ["10.0.0.5:5601", "[::1]:5602"]
    config = SplitwiseConfig(pd_allowed_prefill=["10.0.0.5:5601", "[::1]:5602"])
    assert config.allowed_prefill_peers == (("10.0.0.5", 5601), ("::1", 5602))
    for bad in (["10.0.0.5"], ["host:0"], ["host:http"]):
        with pytest.raises(ValueError, match=f"entry '{bad[0]}' is invalid; allowed: host:port"):
            SplitwiseConfig(pd_allowed_prefill=bad)
    with pytest.raises(ValueError, match="pd_allowed_prefill=\\[\\] is invalid"):
        SplitwiseConfig(pd_allowed_prefill=[])
    with pytest.raises(ValueError, match="pd_max_hold_s=10 is invalid; allowed: seconds >= "):
        SplitwiseConfig(pd_lease_s=30, pd_max_hold_s=10)
    with pytest.raises(ValueError, match="pd_max_connections=0 is invalid"):
        SplitwiseConfig(pd_max_connections=0)


def test_the_nonce_store_forgets_what_is_stale_anyway():
    clock = ManualClock(1000.0)
    auth = PDAuth(KEY, window_s=30, clock=clock)
    for _ in range(100):
        auth.verify("side-channel", auth.sign("side-channel", {"op": "DONE"}))
    assert len(auth._nonces) == 100
    clock.now += 31  # all 100 would be refused as stale now: no need to remember them
    auth.verify("side-channel", auth.sign("side-channel", {"op": "DONE"}))
    assert len(auth._nonces) == 1 and len(auth._expiry) == 1


def test_a_refused_leg_is_released_only_at_a_prefill_node_this_node_trusts():
    """A decode node that refuses a leg tells the prefill node named in it (ABORT), but only
    one it trusts: otherwise a client could make it connect to any address it writes."""
    from fastdeploy.splitwise.roles import release_refused_leg

    seen = []
    side = SideChannelServer("127.0.0.1", 0, lambda op, m: seen.append((op, m)) or {}).start()
    try:
        leg = reference("127.0.0.1", side.port)
        elsewhere = PrefillTrust(allowed=(("127.0.0.1", side.port + 1),))
        assert release_refused_leg(leg, elsewhere) is False  # not on the list: no connection
        assert release_refused_leg(reference("10.9.9.9", side.port), None) is False  # not loopback
        keyed = PrefillTrust(key=KEY)
        assert release_refused_leg(leg, keyed) is False  # unsigned reference under a secret
        time.sleep(0.3)
        assert seen == []
        assert release_refused_leg(PDAuth(KEY).sign_reference(leg), keyed) is True
        deadline = time.monotonic() + 5
        while not seen and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [op for op, _ in seen] == ["ABORT"]
        assert "auth" in seen[0][1]  # signed with the trust's secret
    finally:
        side.close()

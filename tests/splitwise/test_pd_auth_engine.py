"""PD with a shared secret at the engine level, in one process (tiny random-weight Llama, ``tcp``
transport, the real side channel): honest legs equal mixed output; an unsigned, altered or
redirected KV reference is refused at admission; a peer without the secret can neither extend nor
free a prefill node's blocks; every refusal is counted in the node's stats and ``/metrics``."""

from __future__ import annotations

import pytest
from test_pd_engine import (
    GREEDY,
    assert_all_free,
    engine,
    pd_generate,
    prompts,
    run,
    settle,
    tiny_dir,  # noqa: F401 - a fixture
    tokens,
)

from fastdeploy.metrics import ServerMetrics
from fastdeploy.splitwise.pd_auth import PDAuth
from fastdeploy.splitwise.side_channel import SideChannelError, send_control
from fastdeploy.splitwise.tcp_transport import TcpKVTransport

SECRET = b"s3cret-for-pd-tests-0123456789abcdef"


@pytest.fixture(scope="module")
def nodes(tiny_dir, tmp_path_factory):  # noqa: F811
    path = tmp_path_factory.mktemp("pd_secret") / "secret"
    path.write_bytes(SECRET + b"\n")
    started = []
    try:
        for kw in (
            {},
            {"role": "prefill", "pd_secret_file": str(path)},
            {"role": "decode", "pd_secret_file": str(path)},
        ):
            started.append(engine(tiny_dir, **kw))
        prefill = started[1]
        allowed = f"127.0.0.1:{prefill.pd.side_channel.port + 1}"  # not the prefill node
        started.append(
            engine(tiny_dir, "decode", pd_secret_file=str(path), pd_allowed_prefill=allowed)
        )
        yield started
    finally:
        for e in started:
            e.shutdown()


def test_honest_legs_are_signed_and_equal_mixed(nodes):
    mixed, prefill, decode, _ = nodes
    for i, prompt in enumerate(prompts(2, 20, 60, seed=11)):
        p_outs, d_outs = pd_generate(prefill, decode, f"auth{i}", prompt)
        assert set(p_outs[-1].kv_transfer_params["auth"]) == {"mac"}
        assert tokens(d_outs) == tokens(run(mixed, f"m-auth{i}", prompt))
    settle(prefill)
    settle(decode)
    assert prefill.get_stats()["pd"]["auth_rejected"] == {}
    assert decode.get_stats()["pd"]["transfer_bytes"] > 0
    assert_all_free(prefill)


def test_unsigned_altered_or_redirected_references_are_refused(nodes):
    mixed, prefill, decode, picky = nodes
    prompt = prompts(1, 40, 41, seed=12)[0]
    kv = run(prefill, "p-ref", prompt, GREEDY, {"do_remote_decode": True})[-1].kv_transfer_params
    unsigned = {k: v for k, v in kv.items() if k != "auth"}
    with pytest.raises(ValueError, match=r"\(unsigned\)"):
        decode.add_request("d-unsigned", prompt, GREEDY, unsigned)
    for change in (
        {"remote_host": "10.9.9.9"},
        {"remote_port": kv["remote_port"] + 1},
        {"transport": {"transport": "tcp", "host": "10.9.9.9", "port": 80}},
    ):
        with pytest.raises(ValueError, match=r"\(bad_signature\)"):
            decode.add_request("d-altered", prompt, GREEDY, kv | change)
    # Signed, but this decode node's --pd-allowed-prefill names another peer.
    with pytest.raises(ValueError, match=f"127.0.0.1:{kv['remote_port']} is not allowed; allowed"):
        picky.add_request("d-picky", prompt, GREEDY, kv)
    assert not decode.has_unfinished_requests() and not picky.has_unfinished_requests()
    # The real reference still works, once.
    outs = run(decode, "d-ref", prompt, GREEDY, kv)
    assert outs[-1].error is None and tokens(outs) == tokens(run(mixed, "m-ref", prompt))
    settle(prefill)
    assert_all_free(prefill)


def test_peers_without_the_secret_cannot_touch_prefill_blocks(nodes):
    _, prefill, _, _ = nodes
    prompt = prompts(1, 40, 41, seed=13)[0]
    kv = run(prefill, "p-held", prompt, GREEDY, {"do_remote_decode": True})[-1].kv_transfer_params
    port, rid = kv["remote_port"], kv["remote_request_id"]
    before = dict(prefill.get_stats()["pd"]["auth_rejected"])
    for op, auth in (("HEARTBEAT", None), ("ABORT", None), ("DONE", PDAuth(b"w" * 32))):
        with pytest.raises(SideChannelError, match="PD authentication failed"):
            send_control("127.0.0.1", port, op, [rid], auth=auth)
    thief = TcpKVTransport(auth=None)
    thief.register([t.clone().zero_() for t in prefill.worker.runner.kv_caches])
    try:
        transfer = thief.start_pull("t", kv["transport"], kv["remote_block_ids"][:1], [1])
        assert transfer.wait(30) and "(unsigned)" in transfer.error
    finally:
        thief.close()
    prefill.step()
    stats = prefill.get_stats()["pd"]
    assert stats["pending_sends"] == 1  # nothing freed or extended by the forgeries
    rejected = stats["auth_rejected"]
    assert rejected["unsigned"] - before.get("unsigned", 0) == 3
    assert rejected["bad_signature"] - before.get("bad_signature", 0) == 1
    metrics = ServerMetrics()
    metrics.observe_stats({"pd": stats})
    text = metrics.render().decode()
    unsigned = rejected["unsigned"]
    assert f'fastdeploy:pd_auth_rejected_total{{reason="unsigned"}} {unsigned:.1f}' in text
    # The node's own secret frees them.
    send_control("127.0.0.1", port, "ABORT", [rid], auth=PDAuth(SECRET))
    settle(prefill)
    assert_all_free(prefill)

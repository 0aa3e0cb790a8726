"""Fields that ``vllm-router`` and ``sglang-router`` add to request bodies: accepted at the values
that change nothing, refused otherwise with a message naming the field and the allowed value, and
the routers' exact bodies validate (fast: pydantic models, plus one call to the fake server).

The bodies below were captured from ``vllm-router`` 0.1.17 and ``sglang-router`` 0.3.2 (PyPI) in
front of a server that logged what reached it; the client sent ``{"model": "m", "messages":
[{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0}`` (chat) or the same
with ``"prompt": "hi"`` (completions).
"""

from __future__ import annotations

import httpx
import pytest
from http_server_utils import fake_server
from pydantic import ValidationError

from fastdeploy.entrypoints.openai.errors import validation_message
from fastdeploy.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from fastdeploy.entrypoints.openai.serving_utils import sampling_params_from

MSG = [{"role": "user", "content": "hi"}]
CLIENT_CHAT = {"model": "m", "messages": MSG, "max_tokens": 8, "temperature": 0}
CLIENT_COMPLETION = {"model": "m", "prompt": "hi", "max_tokens": 8, "temperature": 0}

# vllm-router 0.1.17, plain mode (--worker-urls).
VLLM_ROUTER_CHAT = {
    "model": "m",
    "messages": MSG,
    "temperature": 0.0,
    "stream": False,
    "max_tokens": 8,
    "logprobs": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "continue_final_message": False,
    "skip_special_tokens": True,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "return_hidden_states": False,
    "include_reasoning": True,
}
VLLM_ROUTER_COMPLETION = {
    "model": "m",
    "prompt": "hi",
    "max_tokens": 8,
    "temperature": 0.0,
    "stream": False,
    "echo": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "return_hidden_states": False,
}
# vllm-router 0.1.17, PD mode (--vllm-pd-disaggregation): the prefill leg (decode leg: the plain
# body plus the prefill node's kv_transfer_params).
VLLM_ROUTER_PREFILL_KV = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
VLLM_ROUTER_PREFILL_CHAT = {
    **VLLM_ROUTER_CHAT,
    "max_tokens": 1,
    "min_tokens": 1,
    "kv_transfer_params": VLLM_ROUTER_PREFILL_KV,
}
VLLM_ROUTER_PREFILL_COMPLETION = {
    **VLLM_ROUTER_COMPLETION,
    "max_tokens": 1,
    "min_tokens": 1,
    "kv_transfer_params": VLLM_ROUTER_PREFILL_KV,
}
# sglang-router 0.3.2, plain mode (launch --worker-urls): max_tokens becomes max_completion_tokens.
SGLANG_ROUTER_CHAT = {
    "messages": MSG,
    "model": "m",
    "logprobs": False,
    "max_completion_tokens": 8,
    "stream": False,
    "temperature": 0.0,
    "no_stop_trim": False,
    "ignore_eos": False,
    "continue_final_message": False,
    "skip_special_tokens": True,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "return_hidden_states": False,
}
SGLANG_ROUTER_COMPLETION = VLLM_ROUTER_COMPLETION  # the same fields, in the same order

ROUTER_BODIES = [
    (ChatCompletionRequest, VLLM_ROUTER_CHAT, CLIENT_CHAT),
    (CompletionRequest, VLLM_ROUTER_COMPLETION, CLIENT_COMPLETION),
    (ChatCompletionRequest, SGLANG_ROUTER_CHAT, CLIENT_CHAT),
    (CompletionRequest, SGLANG_ROUTER_COMPLETION, CLIENT_COMPLETION),
]


def refusal(model: type, body: dict) -> tuple[str, str | None]:
    """The 400 message and param that a body gets (as the server renders it)."""
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    return validation_message(info.value.errors())


def params_of(req: ChatCompletionRequest | CompletionRequest):
    max_tokens = getattr(req, "max_completion_tokens", None) or req.max_tokens
    return sampling_params_from(req, max_tokens, None)


@pytest.mark.parametrize("model,body,client_body", ROUTER_BODIES)
def test_router_bodies_validate_and_change_nothing(model, body, client_body):
    routed = model.model_validate(body)
    assert params_of(routed) == params_of(model.model_validate(client_body))


@pytest.mark.parametrize(
    "model,body", [(ChatCompletionRequest, VLLM_ROUTER_PREFILL_CHAT),
                   (CompletionRequest, VLLM_ROUTER_PREFILL_COMPLETION)]
)  # fmt: skip
def test_vllm_router_prefill_leg_validates(model, body):
    req = model.model_validate(body)
    assert req.kv_transfer_params == VLLM_ROUTER_PREFILL_KV
    params = params_of(req)
    assert params.max_tokens == 1 and params.min_tokens == 1


NEUTRAL = [
    (ChatCompletionRequest, "no_stop_trim", False),
    (ChatCompletionRequest, "return_hidden_states", False),
    (ChatCompletionRequest, "continue_final_message", False),
    (CompletionRequest, "no_stop_trim", False),
    (CompletionRequest, "return_hidden_states", False),
]


def base(model: type) -> dict:
    return {"messages": MSG} if model is ChatCompletionRequest else {"prompt": "hi"}


@pytest.mark.parametrize("model,field,neutral", NEUTRAL)
def test_neutral_value_accepted_other_refused_naming_field(model, field, neutral):
    assert getattr(model.model_validate({**base(model), field: neutral}), field) is neutral
    message, param = refusal(model, {**base(model), field: not neutral})
    assert message == f"{field}=true is not supported; allowed: false"
    assert param == field
    message, param = refusal(model, {**base(model), field: "false"})  # strict: no coercion
    assert param == field and "valid boolean" in message


@pytest.mark.parametrize("field", ["separate_reasoning", "stream_reasoning", "include_reasoning"])
def test_reasoning_flags_take_either_value_and_change_nothing(field):
    plain = params_of(ChatCompletionRequest.model_validate({"messages": MSG}))
    for value in (True, False):
        req = ChatCompletionRequest.model_validate({"messages": MSG, field: value})
        assert getattr(req, field) is value and params_of(req) == plain
    message, param = refusal(ChatCompletionRequest, {"messages": MSG, field: "yes"})
    assert param == field and field in message


def test_chat_only_fields_are_unknown_on_completions():
    for field in ("continue_final_message", "separate_reasoning", "include_reasoning"):
        message, param = refusal(CompletionRequest, {"prompt": "hi", field: False})
        assert message == f"unknown field {field!r}" and param == field


@pytest.mark.parametrize(
    "field,value",
    [("rid", "r-1"), ("lora_path", None), ("bootstrap_room", 7), ("bootstrap_host", "127.0.0.1")],
)
def test_fields_routers_only_forward_stay_unknown(field, value):
    message, param = refusal(ChatCompletionRequest, {"messages": MSG, field: value})
    assert message == f"unknown field {field!r}" and param == field


def test_kv_transfer_params_is_an_object_or_null():
    for value in (None, {}, {"do_remote_decode": True}, {"remote_block_ids": [1, 2], "x": None}):
        for model in (ChatCompletionRequest, CompletionRequest):
            req = model.model_validate({**base(model), "kv_transfer_params": value})
            assert req.kv_transfer_params == value
    for value in ([1], "do_remote_decode", 1):
        message, param = refusal(CompletionRequest, {"prompt": "hi", "kv_transfer_params": value})
        assert param == "kv_transfer_params" and "kv_transfer_params" in message


def test_router_bodies_get_200_over_http():
    """A plain mixed server answers a router's body as it answers the client's own body."""
    with fake_server("m") as (url, _engine, _async_engine):
        for path, routed, direct in [
            ("/v1/chat/completions", VLLM_ROUTER_CHAT, CLIENT_CHAT),
            ("/v1/chat/completions", SGLANG_ROUTER_CHAT, CLIENT_CHAT),
            ("/v1/completions", VLLM_ROUTER_COMPLETION, CLIENT_COMPLETION),
        ]:
            got = httpx.post(url + path, json=routed, timeout=10)
            want = httpx.post(url + path, json=direct, timeout=10)
            assert got.status_code == 200, got.text
            assert got.json()["choices"] == want.json()["choices"]

"""Chat message shapes a new user sends in the first hour (issue #44): an image or audio part,
a part of an unknown type, a user message without ``content``. Each is a 400 whose message says
what is wrong and where (the message index, the part's index), never pydantic's dump of every
member of the content union; an assistant message may still leave ``content`` out."""

from __future__ import annotations

import httpx
import pytest
from http_server_utils import fake_server
from pydantic import ValidationError

from fastdeploy.entrypoints.openai.protocol import ChatCompletionRequest, check_chat_messages

MODEL = "fake-model"
IMAGE = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
AUDIO = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
TEXT = {"type": "text", "text": "What is in this picture?"}

# (messages, words the 400's message must contain)
REFUSED = [
    (
        [{"role": "user", "content": [TEXT, IMAGE]}],
        [
            "messages[0].content[1]",
            "image_url",
            "images are not supported",
            "allowed part types: text",
        ],
    ),
    (
        [{"role": "user", "content": [AUDIO]}],
        ["messages[0].content[0]", "input_audio", "audio is not supported"],
    ),
    (
        [{"role": "user", "content": [{"type": "video", "video": {}}]}],
        ["messages[0].content[0]", '"video"', "unknown part type", "allowed part types: text"],
    ),
    (
        [{"role": "user", "content": [{"text": "no type"}]}],
        ["messages[0].content[0]", "no 'type'", "allowed part types: text"],
    ),
    (
        [{"role": "system", "content": "Be brief."}, {"role": "user"}],
        ["messages[1].content", "required", "user message"],
    ),
    ([{"role": "user", "content": None}], ["messages[0].content", "required"]),
    (
        [{"role": "system"}, {"role": "user", "content": "x"}],
        ["messages[0].content", "system message"],
    ),
]

ACCEPTED = [
    [{"role": "user", "content": "hi"}],
    [{"role": "user", "content": [TEXT]}],
    [{"role": "user", "content": "hi"}, {"role": "assistant"}, {"role": "user", "content": "?"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}],
]


@pytest.mark.parametrize("messages,words", REFUSED)
def test_the_protocol_refuses_with_one_readable_message(messages, words):
    with pytest.raises(ValueError) as raised:
        check_chat_messages(messages)
    for word in words:
        assert word in str(raised.value), str(raised.value)
    with pytest.raises(ValidationError) as raised:
        ChatCompletionRequest.model_validate({"messages": messages})
    (error,) = raised.value.errors()  # one error, not one per union member
    assert error["loc"] == ("messages",)


@pytest.mark.parametrize("messages", ACCEPTED)
def test_the_protocol_accepts_text_and_assistant_without_content(messages):
    check_chat_messages(messages)
    ChatCompletionRequest.model_validate({"messages": messages})


@pytest.fixture(scope="module")
def server():
    with fake_server(MODEL) as running:
        yield running[0]


@pytest.mark.parametrize("messages,words", REFUSED)
def test_the_server_answers_400_naming_the_place(server, messages, words):
    r = httpx.post(server + "/v1/chat/completions", json={"messages": messages}, timeout=10)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages" and err["type"] == "invalid_request_error"
    for word in words:
        assert word in err["message"], err
    assert "TextPart" not in err["message"] and "Input should be" not in err["message"]


def test_the_server_serves_an_assistant_message_without_content(server):
    body = {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant"},
            {"role": "user", "content": "x"},
        ],
        "max_tokens": 2,
    }
    r = httpx.post(server + "/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "fields, param, words",
    [
        ({"modalities": ["text", "audio"]}, "modalities", "audio is not supported"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio", "audio is not supported"),
    ],
)
def test_audio_output_is_refused_by_name(server, fields, param, words):
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, **fields}
    r = httpx.post(server + "/v1/chat/completions", json=body, timeout=10)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and words in err["message"], r.text
    assert "Extra inputs" not in err["message"] and "unknown field" not in err["message"]


def test_text_modality_is_served(server):
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "modalities": ["text"]}
    r = httpx.post(server + "/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 200, r.text

"""The routes a fleet's probes and gateways call besides the OpenAI API, with vLLM's paths and
bodies (vLLM v0.11.0, ``vllm/entrypoints/openai/api_server.py`` and
``vllm/entrypoints/openai/serving_tokenization.py``):

* ``POST /tokenize``: a text (``prompt``) or a conversation (``messages``, rendered by the chat
  endpoint's own template path, :meth:`OpenAIServingChat.render_messages`) to token ids:
  ``{"count", "max_model_len", "tokens", "token_strs"}``;
* ``POST /detokenize``: ``{"tokens"}`` to ``{"prompt": text}``;
* ``GET /version``: ``{"version": <this package's version>}``;
* ``GET /v1/models/{model_id}``: the card ``/v1/models`` lists for that name, or 404
  ``model_not_found`` (OpenAI's retrieve-model route, ``client.models.retrieve``).

``/ping`` (vLLM's SageMaker alias of ``/health``) is wired next to ``/health`` in the app.
Like vLLM, neither tokenizer route counts the request or runs the engine; unlike vLLM, both need
the ``--api-key`` key when one is set (see :mod:`~fastdeploy.entrypoints.openai.auth`).
"""

from __future__ import annotations

from typing import Any

from fastapi import Body, FastAPI
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from fastdeploy.core.version import __version__
from fastdeploy.entrypoints.openai.errors import bad_request, validation_error
from fastdeploy.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from fastdeploy.entrypoints.openai.protocol_responses import ModelCard, dump
from fastdeploy.entrypoints.openai.serving_chat import OpenAIServingChat
from fastdeploy.entrypoints.openai.tool_request import check_tools


class OpenAIServingTokenization:
    """``/tokenize`` and ``/detokenize`` for the served model, on the chat handler's tokenizer,
    tokenizing thread and template path (so a conversation's tokens here are the prompt tokens
    the chat endpoint counts in ``usage.prompt_tokens``)."""

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    def tokenize_sync(self, req: TokenizeCompletionRequest | TokenizeChatRequest) -> dict:
        """The ``/tokenize`` answer, computed on the calling thread.

        Raises:
            APIError: 404 unknown ``model``; 400 without a tokenizer, a text with a lone
                surrogate or too long for any prompt of ``max_model_len``
                (``context_length_exceeded``), a conversation the template rejects.
        """
        chat = self.chat
        chat.check_model(req.model)
        if isinstance(req, TokenizeChatRequest):
            _, ids = chat.render_messages(
                req.messages,
                req.add_generation_prompt,
                req.add_special_tokens,
                req.chat_template_kwargs,
                check_tools(req.tools) if req.tools else None,
            )
        else:
            chat.require_tokenizer("/tokenize", "prompt")
            ids = chat.encode(req.prompt, "prompt", add_special_tokens=req.add_special_tokens)
        strs = chat.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        body = TokenizeResponse(
            count=len(ids), max_model_len=chat.engine.max_model_len, tokens=ids, token_strs=strs
        )
        return dump(body)

    def detokenize_sync(self, req: DetokenizeRequest) -> dict:
        """The ``/detokenize`` answer: the text of ``req.tokens`` as the tokenizer decodes it
        (special tokens kept, as vLLM does).

        Raises:
            APIError: 404 unknown ``model``; 400 without a tokenizer, or naming the first token
                id outside ``0..len(tokenizer)-1`` and its position.
        """
        chat = self.chat
        chat.check_model(req.model)
        chat.require_tokenizer("/detokenize", "tokens")
        size = len(chat.tokenizer)
        for i, t in enumerate(req.tokens):
            if not 0 <= t < size:
                raise bad_request(
                    f"tokens[{i}]={t} is outside the vocabulary; allowed: token ids in "
                    f"0..{size - 1}",
                    "tokens",
                )
        text = chat.tokenizer.decode(req.tokens, skip_special_tokens=False)
        return dump(DetokenizeResponse(prompt=text))


def tokenize_request(body: dict[str, Any]) -> TokenizeChatRequest | TokenizeCompletionRequest:
    """The ``/tokenize`` body as vLLM tells its two forms apart: a chat request when it has
    ``messages``, else a text request.

    Raises:
        APIError: 400 naming the field at fault (:func:`validation_error`).
    """
    model = TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise validation_error(list(e.errors())) from None


def model_card(engine: Any, served_model_name: str) -> ModelCard:
    """The served model's card, as ``/v1/models`` and ``/v1/models/{id}`` answer it."""
    return ModelCard(
        id=served_model_name, root=served_model_name, max_model_len=engine.max_model_len
    )


def add_fleet_routes(app: FastAPI, chat: OpenAIServingChat) -> None:
    """Add ``/tokenize``, ``/detokenize``, ``/version`` and ``/v1/models/{model_id}`` to
    ``app`` (module docstring). Errors are :class:`APIError`, answered and counted by the app's
    handler like the other routes'."""
    tokenization = OpenAIServingTokenization(chat)

    @app.post("/tokenize")
    async def tokenize(body: dict[str, Any] = Body(...)) -> JSONResponse:
        req = tokenize_request(body)
        return JSONResponse(await chat.off_loop(tokenization.tokenize_sync, req))

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> JSONResponse:
        return JSONResponse(await chat.off_loop(tokenization.detokenize_sync, req))

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> JSONResponse:
        chat.check_model(model_id)
        return JSONResponse(dump(model_card(chat.engine, chat.served_model_name)))

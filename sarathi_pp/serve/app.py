"""The FastAPI app: OpenAI's routes over one ``EngineLoop``.

``create_app(engine_loop, served_model_name, api_key)``; the app's lifespan starts the engine
thread and, at the end, stops it (in-flight requests aborted, run records written, engine
shut down). Every handler is a coroutine on uvicorn's event loop; none touches the engine:
they hand work to the engine thread and await their request's outputs.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from sarathi_pp.engine import EngineDeadError
from sarathi_pp.scheduler.base import QueueFullError
from sarathi_pp.serve import protocol as p
from sarathi_pp.serve.engine_loop import EngineFailure, EngineLoop, Sink
from sarathi_pp.serve.protocol import ApiError, GenerateRequest

# Seconds between checks that the client of a non-streamed request is still there.
DISCONNECT_POLL_S = 0.5


def create_app(
    engine_loop: EngineLoop, served_model_name: str, api_key: str | None = None
) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine_loop.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine_loop.stop)

    app = FastAPI(title="sarathi-pp", lifespan=lifespan)
    app.state.engine_loop = engine_loop
    server = _Routes(engine_loop, served_model_name)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # an unknown route (404) or method (405): OpenAI's shape too
        body = p.error_body(str(exc.detail), "invalid_request_error")
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    async def check_api_key(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), api_key.encode()
        ):
            raise ApiError(
                401,
                "invalid or missing API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )

    auth = [Depends(check_api_key)]
    app.add_api_route("/v1/models", server.models, methods=["GET"], dependencies=auth)
    app.add_api_route("/v1/completions", server.completions, methods=["POST"], dependencies=auth)
    app.add_api_route(
        "/v1/chat/completions", server.chat_completions, methods=["POST"], dependencies=auth
    )
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/metrics", server.metrics, methods=["GET"])
    return app


class _Routes:
    def __init__(self, engine_loop: EngineLoop, served_model_name: str) -> None:
        self.engine_loop = engine_loop
        self.model = served_model_name
        self.created = int(time.time())

    # --- plain routes --------------------------------------------------------------------
    async def models(self) -> dict[str, Any]:
        card = {"id": self.model, "object": "model", "created": self.created}
        return {"object": "list", "data": [{**card, "owned_by": "sarathi-pp"}]}

    async def health(self) -> Response:
        engine = self.engine_loop.engine
        if not engine.is_alive():
            message = f"the engine is dead: {engine.dead_reason}"
            return JSONResponse(p.error_body(message, "service_unavailable"), status_code=503)
        if not self.engine_loop.accepting:
            body = p.error_body("the server is stopping", "service_unavailable")
            return JSONResponse(body, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics(self) -> Response:
        return Response(self.engine_loop.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # --- generation ----------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        req = p.completion_request(await _json_body(request))
        request_id = f"cmpl-{uuid.uuid4().hex}"

        def add(engine: Any) -> None:
            engine.add_request(
                request_id, req.prompt, req.params, prompt_token_ids=req.prompt_token_ids
            )

        return await self._generate(request, req, request_id, add, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        req = p.chat_request(await _json_body(request))
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        messages = req.messages

        def add(engine: Any) -> None:  # on the engine thread: it owns the tokenizer
            prompt, token_ids = render_chat(engine, messages)
            engine.add_request(request_id, prompt, req.params, prompt_token_ids=token_ids)

        return await self._generate(request, req, request_id, add, chat=True)

    async def _generate(
        self,
        http_request: Request,
        req: GenerateRequest,
        request_id: str,
        add: Callable[[Any], None],
        chat: bool,
    ) -> Response:
        if req.model is not None and req.model != self.model:
            raise ApiError(
                404,
                f"The model `{req.model}` does not exist (this server serves `{self.model}`)",
                code="model_not_found",
                param="model",
            )
        if not self.engine_loop.accepting:
            raise ApiError(503, "the server is stopping", "service_unavailable")
        sink = Sink(asyncio.get_running_loop(), asyncio.Queue())
        try:
            await asyncio.wrap_future(self.engine_loop.add(request_id, sink, add))
        except (ValueError, TypeError) as e:
            raise p.bad_request(str(e)) from None
        except QueueFullError as e:
            raise ApiError(429, str(e), "rate_limit_exceeded", code="queue_full") from None
        except (EngineDeadError, EngineFailure) as e:
            raise ApiError(503, str(e), "service_unavailable") from None
        if req.stream:
            events = self._stream(req, request_id, sink, chat)
            return StreamingResponse(events, media_type="text/event-stream")
        try:
            return JSONResponse(await self._complete(http_request, request_id, sink, chat))
        except _ClientGone:  # aborted; nobody reads this
            return Response(status_code=499)

    async def _complete(
        self, request: Request, request_id: str, sink: Sink, chat: bool
    ) -> dict[str, Any]:
        out = None
        reader = _Reader(sink, request)
        try:
            while out is None or not out.finished:
                out = _checked(await reader.next())
        finally:
            if out is None or not out.finished:  # the client is gone (or we were cancelled)
                self.engine_loop.abort(request_id)
        completion = out.outputs[0]
        use = p.usage(len(out.prompt_token_ids), len(completion.token_ids))
        response = p.chat_response if chat else p.completion_response
        return response(request_id, self.model, completion.text, completion.finish_reason, use)

    async def _stream(
        self, req: GenerateRequest, request_id: str, sink: Sink, chat: bool
    ) -> AsyncIterator[str]:
        """Server-sent events: a chunk per new text, the finish reason, usage if asked for,
        ``[DONE]``. A client gone mid-stream cancels this generator: its request is aborted."""
        finished = False
        try:
            if chat:
                yield _sse(p.chat_chunk(request_id, self.model, {"role": "assistant"}, None))
            num_sent = 0  # characters of the text streamed so far
            stops = req.params.stop
            out = None
            while not finished:
                try:
                    out = _checked(await sink.queue.get())
                except ApiError as e:
                    finished = True
                    yield _sse(e.body())
                    break
                finished = out.finished
                completion = out.outputs[0]
                end = len(completion.text) if finished else _safe_end(completion.text, stops)
                delta, num_sent = completion.text[num_sent:end], max(num_sent, end)
                if delta or finished:
                    yield _sse(self._chunk(request_id, delta, completion.finish_reason, chat))
            if req.include_usage and out is not None and out.finished:
                chunk = self._chunk(request_id, "", None, chat)
                chunk["choices"] = []
                chunk["usage"] = p.usage(len(out.prompt_token_ids), len(out.outputs[0].token_ids))
                yield _sse(chunk)
            yield "data: [DONE]\n\n"
        finally:
            if not finished:
                self.engine_loop.abort(request_id)

    def _chunk(self, request_id: str, text: str, finish_reason: str | None, chat: bool) -> dict:
        if chat:
            delta = {"content": text} if text else {}
            return p.chat_chunk(request_id, self.model, delta, finish_reason)
        return p.completion_chunk(request_id, self.model, text, finish_reason)


class _ClientGone(Exception):
    """The client of a non-streamed request disconnected: nobody reads the answer."""


class _Reader:
    """A non-streamed request's outputs, one at a time; ``_ClientGone`` once its client has
    disconnected (checked every ``DISCONNECT_POLL_S``: a long answer nobody reads would hold
    its blocks)."""

    def __init__(self, sink: Sink, request: Request) -> None:
        self.sink = sink
        self.request = request
        self.next_check = time.monotonic() + DISCONNECT_POLL_S

    async def next(self) -> Any:
        get = asyncio.ensure_future(self.sink.queue.get())
        try:
            while True:
                timeout = max(0.0, self.next_check - time.monotonic())
                done, _ = await asyncio.wait({get}, timeout=timeout)
                if time.monotonic() >= self.next_check:
                    self.next_check = time.monotonic() + DISCONNECT_POLL_S
                    if await self.request.is_disconnected():
                        raise _ClientGone
                if done:
                    return get.result()
        finally:
            get.cancel()


def _checked(item: Any) -> Any:
    """A ``RequestOutput`` from a sink, or the ``ApiError`` its failure means."""
    if isinstance(item, EngineFailure):
        raise ApiError(503, f"the request could not finish: {item}", "service_unavailable")
    completion = item.outputs[0]
    if completion.finish_reason == "error":
        message = completion.error or item.error or "the request failed"
        raise ApiError(500, message, "server_error")
    return item


def _safe_end(text: str, stops: tuple[str, ...]) -> int:
    """How much of an unfinished ``text`` may be streamed: all but a tail that could be the
    start of a stop string (the engine cuts a stop string out of the text once it is
    whole, so a streamed part of it could not be taken back)."""
    for k in range(min(len(text), max((len(s) for s in stops), default=1) - 1), 0, -1):
        if any(s.startswith(text[-k:]) for s in stops):
            return len(text) - k
    return len(text)


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _json_body(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except ValueError as e:
        raise p.bad_request(f"the request body is not valid JSON: {e}") from None


def render_chat(engine: Any, messages: Any) -> tuple[str, list[int]]:
    """The prompt of a chat and its token ids (``InputProcessor.render_chat``: the one
    place that renders chats, for ``LLM.chat`` and ``generate --chat`` too); a model
    without a template, or messages it refuses, is a 400."""
    try:
        return engine.inputs.render_chat(messages)
    except ValueError as e:
        raise p.bad_request(f"{e}; use /v1/completions for plain prompts", "messages") from e

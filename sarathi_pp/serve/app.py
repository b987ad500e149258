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

from sarathi_pp.engine import EngineDeadError, parallel_sampling
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
    app.add_api_route("/tokenize", server.tokenize, methods=["POST"], dependencies=auth)
    app.add_api_route("/detokenize", server.detokenize, methods=["POST"], dependencies=auth)
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/version", server.version, methods=["GET"])
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

    async def version(self) -> Response:
        """vLLM's ``GET /version``: ``{"version": ...}``, this package's."""
        from sarathi_pp import __version__

        return JSONResponse({"version": __version__})

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

    # --- the tokenizer (vLLM's /tokenize and /detokenize) -----------------------------------
    async def tokenize(self, request: Request) -> Response:
        req = p.tokenize_request(await _json_body(request))
        self._check_model(req.model)

        def run(engine: Any) -> dict[str, Any]:  # on the engine thread: it owns the tokenizer
            if req.messages is not None:
                _, tokens = render_chat(engine, req.messages)
            else:
                assert req.prompt is not None
                try:
                    tokens = engine.tokenize(req.prompt, req.add_special_tokens)
                except ValueError as e:  # no tokenizer
                    raise p.bad_request(str(e), "prompt") from None
            strs = engine.tokenizer.convert_ids_to_tokens(tokens) if req.return_token_strs else None
            return p.tokenize_response(list(tokens), engine.max_model_len, strs)

        return JSONResponse(await self._on_engine(run))

    async def detokenize(self, request: Request) -> Response:
        model, tokens = p.detokenize_request(await _json_body(request))
        self._check_model(model)

        def run(engine: Any) -> dict[str, Any]:
            if engine.tokenizer is None:
                raise p.bad_request(f"model folder {engine.model_dir!r} has no tokenizer", "tokens")
            vocab = engine.spec.vocab_size
            for t in tokens:
                if t >= vocab:
                    raise p.bad_request(
                        f"token id {t} is not below the vocabulary size {vocab}", "tokens"
                    )
            # special tokens kept: the text tokenize() turns back into these ids (vLLM's)
            return {"prompt": engine.detokenize(tokens, skip_special_tokens=False)}

        return JSONResponse(await self._on_engine(run))

    async def _on_engine(self, fn: Callable[[Any], Any]) -> Any:
        try:
            return await asyncio.wrap_future(self.engine_loop.call(fn))
        except EngineFailure as e:
            raise ApiError(503, str(e), "service_unavailable") from None

    def _check_model(self, model: str | None) -> None:
        """A 404 (OpenAI's ``model_not_found``) for a model this server does not serve."""
        if model is not None and model != self.model:
            raise ApiError(
                404,
                f"The model `{model}` does not exist (this server serves `{self.model}`)",
                code="model_not_found",
                param="model",
            )

    # --- generation ----------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        req = p.completion_request(await _json_body(request))
        request_id = f"cmpl-{uuid.uuid4().hex}"
        many = len(req.prompts) > 1
        # One engine request per choice: prompt i's completion j is choice i * n + j.
        children = [
            (child, params, prompt, i)
            for i, prompt in enumerate(req.prompts)
            for child, params in parallel_sampling.child_requests(
                f"{request_id}-{i}" if many else request_id, req.params
            )
        ]

        def add(engine: Any) -> None:  # every prompt or none: one bad prompt fails the request
            added: list[str] = []
            tokens = [
                _prompt_tokens(engine, req, i, prompt) for i, prompt in enumerate(req.prompts)
            ]
            if req.echo:  # token id prompts echo as text (the engine thread owns the tokenizer)
                texts = [
                    p.text if p.text is not None else engine.detokenize(t)
                    for p, t in zip(req.prompts, tokens, strict=True)
                ]
                choices.echo = [texts[i] for _, _, _, i in children]
                if req.params.logprobs is not None:  # the first prompt token's own text
                    firsts = [_text_of(engine, t[0]) for t in tokens]
                    choices.first_text = [firsts[i] for _, _, _, i in children]
            try:
                for rid, params, _, i in children:
                    engine.add_request(rid, req.prompts[i].text, params, tokens[i])
                    added.append(rid)
            except BaseException:
                for rid in added:
                    engine.abort(rid)
                raise

        choices = _Choices([c[0] for c in children], [c[3] for c in children])
        choices.echo_only = req.echo_only
        return await self._generate(request, req, request_id, choices, add, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        req = p.chat_request(await _json_body(request))
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        messages = req.messages
        children = parallel_sampling.child_requests(request_id, req.params)

        def add(engine: Any) -> None:  # on the engine thread: it owns the tokenizer
            prompt, token_ids = render_chat(engine, messages)
            token_ids = engine.inputs.truncated(token_ids, req.params)
            p.check_room(len(token_ids), req.max_tokens, engine.max_model_len, "messages")
            added: list[str] = []
            try:
                for rid, params in children:
                    engine.add_request(rid, prompt, params, prompt_token_ids=token_ids)
                    added.append(rid)
            except BaseException:
                for rid in added:
                    engine.abort(rid)
                raise

        choices = _Choices([rid for rid, _ in children], [0] * len(children))
        return await self._generate(request, req, request_id, choices, add, chat=True)

    async def _generate(
        self,
        http_request: Request,
        req: GenerateRequest,
        request_id: str,
        choices: _Choices,
        add: Callable[[Any], None],
        chat: bool,
    ) -> Response:
        """Add the engine requests of ``choices`` (one per choice) and answer with their
        outputs."""
        self._check_model(req.model)
        if not self.engine_loop.accepting:
            raise ApiError(503, "the server is stopping", "service_unavailable")
        sink = Sink(asyncio.get_running_loop(), asyncio.Queue())  # every choice's outputs
        try:
            await asyncio.wrap_future(self.engine_loop.add(choices.ids, sink, add))
        except (ValueError, TypeError) as e:
            raise p.bad_request(str(e), getattr(e, "param", None)) from None
        except QueueFullError as e:
            raise ApiError(429, str(e), "rate_limit_exceeded", code="queue_full") from None
        except (EngineDeadError, EngineFailure) as e:
            raise ApiError(503, str(e), "service_unavailable") from None
        if req.stream:
            events = self._stream(req, request_id, choices, sink, chat)
            return StreamingResponse(events, media_type="text/event-stream")
        try:
            answer = await self._complete(http_request, req, request_id, choices, sink, chat)
            return JSONResponse(answer)
        except _ClientGone:  # aborted; nobody reads this
            return Response(status_code=499)

    async def _complete(
        self,
        request: Request,
        req: GenerateRequest,
        request_id: str,
        choices: _Choices,
        sink: Sink,
        chat: bool,
    ) -> dict[str, Any]:
        reader = _Reader(sink, request)
        try:
            while not choices.all_finished:
                choices.update(_checked(await reader.next()))
        finally:
            for rid in choices.unfinished:  # the client is gone (or we were cancelled)
                self.engine_loop.abort(rid)
        answers = []
        for index, out in enumerate(choices.final):
            c = out.outputs[0]
            echo = choices.echo[index] if choices.echo else ""
            token_ids, text = ([], "") if req.echo_only else (c.token_ids, c.text)
            logprobs = None if c.logprobs is None else c.logprobs[: len(token_ids)]
            lp = _logprobs(req, token_ids, logprobs, chat, text_offset=len(echo))
            if echo and lp is not None:
                lp = p.joined_logprobs(choices.echoed_logprobs(index, out), lp)
            answer = {"text": echo + text, "finish_reason": c.finish_reason, "logprobs": lp}
            if req.params.prompt_logprobs is not None:  # vLLM's field
                answer["prompt_logprobs"] = p.prompt_logprobs_json(out.prompt_logprobs)
            answers.append(answer)
        use = choices.usage()
        if chat:
            return p.chat_response(request_id, self.model, answers, use)
        return p.completion_response(request_id, self.model, answers, use)

    async def _stream(
        self, req: GenerateRequest, request_id: str, choices: _Choices, sink: Sink, chat: bool
    ) -> AsyncIterator[str]:
        """Server-sent events: a chunk per new text of a choice (with the log-probabilities
        of its new tokens when asked for), its finish reason, usage if asked for,
        ``[DONE]``. A client gone mid-stream cancels this generator: its requests are
        aborted."""
        try:
            if chat:
                for index in range(len(choices.ids)):
                    delta = {"role": "assistant"}
                    yield _sse(p.chat_chunk(request_id, self.model, delta, None, index))
            num_sent = [0] * len(choices.ids)  # characters of each choice's text streamed
            tokens_sent = [0] * len(choices.ids)  # and tokens (their log-probabilities)
            stops = req.params.stop
            while not choices.all_finished:
                try:
                    out = _checked(await sink.queue.get())
                except ApiError as e:
                    choices.failed = True
                    yield _sse(e.body())
                    break
                index = choices.update(out)
                completion = out.outputs[0]
                text = "" if req.echo_only else completion.text
                token_ids = [] if req.echo_only else completion.token_ids
                end = len(text) if out.finished else _safe_end(text, stops)
                delta, num_sent[index] = text[num_sent[index] : end], max(num_sent[index], end)
                if delta or out.finished:
                    first, tokens_sent[index] = tokens_sent[index], len(token_ids)
                    new = token_ids[first:]
                    lp = None
                    echo = choices.echo[index] if choices.echo else ""
                    if completion.logprobs is not None:
                        lp = _logprobs(
                            req, new, completion.logprobs[first : len(token_ids)], chat,
                            text_offset=len(echo) + num_sent[index] - len(delta),
                        )  # fmt: skip
                    reason = completion.finish_reason
                    if echo and not choices.echoed[index]:  # the first chunk: its prompt
                        choices.echoed[index] = True
                        delta = echo + delta
                        if lp is not None:
                            lp = p.joined_logprobs(choices.echoed_logprobs(index, out), lp)
                    yield _sse(self._chunk(request_id, delta, reason, chat, index, lp))
            if req.include_usage and choices.all_finished and not choices.failed:
                chunk = self._chunk(request_id, "", None, chat, 0)
                chunk["choices"] = []
                chunk["usage"] = choices.usage()
                yield _sse(chunk)
            yield "data: [DONE]\n\n"
        finally:
            for rid in choices.unfinished:
                self.engine_loop.abort(rid)

    def _chunk(
        self,
        request_id: str,
        text: str,
        finish_reason: str | None,
        chat: bool,
        index: int,
        logprobs: dict[str, Any] | None = None,
    ) -> dict:
        if chat:
            delta = {"content": text} if text else {}
            return p.chat_chunk(request_id, self.model, delta, finish_reason, index, logprobs)
        return p.completion_chunk(request_id, self.model, text, finish_reason, index, logprobs)


def _text_of(engine: Any, token_id: int) -> str:
    """A token's text as log-probabilities show it (vLLM's ``token_id:<id>`` without a
    tokenizer)."""
    text = engine.token_text(token_id)
    return text if text is not None else f"token_id:{token_id}"


def _logprobs(
    req: GenerateRequest,
    token_ids: list[int],
    logprobs: Any,
    chat: bool,
    text_offset: int = 0,
) -> dict[str, Any] | None:
    """A choice's ``logprobs`` object over ``token_ids``, or ``None`` when not asked for."""
    top = req.params.logprobs
    if top is None or logprobs is None:
        return None
    if chat:
        return p.chat_logprobs(token_ids, logprobs, top)
    return p.completion_logprobs(token_ids, logprobs, text_offset)


class _Choices:
    """The engine requests of one HTTP request (one per choice, ``ids`` in choice order,
    ``prompts[i]``: the prompt choice ``i`` completes) and their latest outputs."""

    def __init__(self, ids: list[str], prompts: list[int]) -> None:
        self.ids = ids
        self.prompts = prompts
        self._index = {rid: i for i, rid in enumerate(ids)}
        self._latest: list[Any] = [None] * len(ids)
        self.failed = False  # the stream ended on an error
        self.echo: list[str] = []  # with echo: each choice's prompt text, set when added
        self.first_text: list[str] = []  # and with logprobs: its first token's text
        self.echoed = [False] * len(ids)  # streaming: the prompt has been sent
        self.echo_only = False  # ``max_tokens: 0`` with echo: no completion tokens

    def echoed_logprobs(self, index: int, out: Any) -> dict[str, Any]:
        """The ``logprobs`` of choice ``index``'s echoed prompt (``out``: its output), its
        text offsets from 0; empty if the prompt's never came (the request failed first)."""
        if out.prompt_logprobs is None:
            return p.completion_logprobs([], [])
        return p.completion_logprobs(
            out.prompt_token_ids, out.prompt_logprobs, first_text=self.first_text[index]
        )

    def update(self, out: Any) -> int:
        """Record ``out``; its choice index."""
        index = self._index[out.request_id]
        self._latest[index] = out
        return index

    @property
    def unfinished(self) -> list[str]:
        return [rid for rid, o in zip(self.ids, self._latest, strict=True) if not _done(o)]

    @property
    def all_finished(self) -> bool:
        return all(_done(o) for o in self._latest)

    @property
    def final(self) -> list[Any]:
        return self._latest

    def usage(self) -> dict[str, int]:
        """Each prompt's tokens once (``n`` choices of one prompt share it, as OpenAI
        counts) and the completion tokens of every choice."""
        prompt_tokens = {
            prompt: len(o.prompt_token_ids)
            for prompt, o in zip(self.prompts, self._latest, strict=True)
            if o is not None
        }
        outs = [o for o in self._latest if o is not None]
        completion_tokens = 0 if self.echo_only else sum(len(o.outputs[0].token_ids) for o in outs)
        return p.usage(sum(prompt_tokens.values()), completion_tokens)


def _done(out: Any) -> bool:
    return out is not None and out.finished


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


def _prompt_tokens(engine: Any, req: GenerateRequest, index: int, prompt: Any) -> list[int]:
    """Prompt ``index``'s token ids, checked before any prompt of the request is added:
    ids the model has, and room for an explicit ``max_tokens`` (400s naming ``prompt`` or
    ``max_tokens``)."""
    where = f"'prompt[{index}]'" if len(req.prompts) > 1 else "'prompt'"
    try:
        tokens = prompt.token_ids if prompt.token_ids is not None else engine.tokenize(prompt.text)
        tokens = engine.inputs.truncated(list(tokens), req.params)
        engine.validate_prompt(tokens, where)
    except ValueError as e:
        raise p.ParamError(str(e), "prompt") from None
    p.check_room(len(tokens), req.max_tokens, engine.max_model_len, where)
    return list(tokens)


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

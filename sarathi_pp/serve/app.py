"""The FastAPI app: OpenAI's routes over one ``EngineLoop``.

``create_app(engine_loop, served_model_name, api_key)``; the app's lifespan starts the engine
thread and, at the end, stops it (in-flight requests aborted, run records written, engine
shut down). Every handler is a coroutine on uvicorn's event loop; none touches the engine:
they hand work to the engine thread and await their request's outputs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
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

from sarathi_pp.engine import EngineDeadError, LLMEngine, ReplicatedEngine
from sarathi_pp.engine.input_processor import ChatOptions, RequestInput
from sarathi_pp.scheduler.base import QueueFullError
from sarathi_pp.serve import protocol as p
from sarathi_pp.serve import responses as shapes
from sarathi_pp.serve.answer import Answer, ClientGone, Reader, checked, safe_end
from sarathi_pp.serve.engine_loop import EngineFailure, EngineLoop, Sink
from sarathi_pp.serve.protocol import ApiError, GenerateRequest
from sarathi_pp.serve.tools import ToolPlan, new_call_id, tool_parser


def create_app(
    engine_loop: EngineLoop,
    served_model_name: str | list[str],
    api_key: str | None = None,
    chat_template: str | None = None,
    tool_call_parser: str = "hermes",
) -> FastAPI:
    """``chat_template``: the server's (``--chat-template``) instead of the tokenizer's; a
    request's own ``chat_template`` wins. ``tool_call_parser``: how ``tool_choice: auto``
    reads a reply's calls (``serve/tools.py``'s ``TOOL_PARSERS``)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine_loop.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine_loop.stop)

    app = FastAPI(title="sarathi-pp", lifespan=lifespan)
    app.state.engine_loop = engine_loop
    server = _Routes(engine_loop, served_model_name, chat_template, tool_call_parser)
    engine_loop.metrics.vllm.name_model(server.model)  # vLLM's ``model_name`` label

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
    def __init__(
        self,
        engine_loop: EngineLoop,
        served_model_name: str | list[str],
        chat_template: str | None = None,
        tool_call_parser: str = "hermes",
    ) -> None:
        self.engine_loop = engine_loop
        self.chat_template = chat_template
        tool_parser(tool_call_parser)  # an unknown name: a ValueError listing the valid ones
        self.tool_call_parser = tool_call_parser
        names = [served_model_name] if isinstance(served_model_name, str) else served_model_name
        if not names:
            raise ValueError("served_model_name: give at least one name")
        self.names = list(dict.fromkeys(names))  # each accepted as a request's ``model``
        self.model = self.names[0]  # the one responses carry (vLLM's)
        self.created = int(time.time())
        # the model folder's generation_config.json sampling defaults (read once)
        self.defaults = engine_loop.engine.default_sampling

    # --- plain routes --------------------------------------------------------------------
    async def models(self) -> dict[str, Any]:
        """One card per served name, with vLLM's ``max_model_len`` and ``root`` (the model
        folder) beside OpenAI's fields."""
        engine = self.engine_loop.engine
        cards = [
            {
                "id": name,
                "object": "model",
                "created": self.created,
                "owned_by": "sarathi-pp",
                "root": engine.model_dir,
                "parent": None,
                "max_model_len": engine.max_model_len,
            }
            for name in self.names
        ]
        return {"object": "list", "data": cards}

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
        if isinstance(engine, ReplicatedEngine):  # degraded (still serving) once one is lost
            live, total = engine.num_live, engine.num_replicas
            status = "ok" if live == total else "degraded"
            return JSONResponse({"status": status, "replicas": total, "replicas_live": live})
        return JSONResponse({"status": "ok"})

    async def metrics(self) -> Response:
        return Response(self.engine_loop.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # --- the tokenizer (vLLM's /tokenize and /detokenize) -----------------------------------
    async def tokenize(self, request: Request) -> Response:
        req = p.tokenize_request(await _json_body(request))
        self._check_model(req.model)

        def run(engine: LLMEngine) -> dict[str, Any]:  # on the engine thread: it owns the tokenizer
            if req.messages is not None:
                _, tokens = render_chat(engine, req.messages, self._chat_options(req.chat))
            else:
                assert req.prompt is not None
                try:
                    tokens = engine.tokenize(req.prompt, req.add_special_tokens)
                except ValueError as e:  # no tokenizer
                    raise p.bad_request(str(e), "prompt") from None
            strs = engine.tokenizer.convert_ids_to_tokens(tokens) if req.return_token_strs else None
            return shapes.tokenize_response(list(tokens), engine.max_model_len, strs)

        return JSONResponse(await self._on_engine(run))

    async def detokenize(self, request: Request) -> Response:
        model, tokens = p.detokenize_request(await _json_body(request))
        self._check_model(model)

        def run(engine: LLMEngine) -> dict[str, Any]:
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

    async def _on_engine(self, fn: Callable[[LLMEngine], Any]) -> Any:
        try:
            return await asyncio.wrap_future(self.engine_loop.call(fn))
        except EngineFailure as e:
            raise ApiError(503, str(e), "service_unavailable") from None

    def _chat_options(self, options: ChatOptions | None) -> ChatOptions:
        """A request's chat options, the server's template where it names none."""
        options = options or ChatOptions()
        if options.chat_template is None and self.chat_template is not None:
            return dataclasses.replace(options, chat_template=self.chat_template)
        return options

    def _check_model(self, model: str | None) -> None:
        """A 404 (OpenAI's ``model_not_found``) for a model this server does not serve."""
        if model is not None and model not in self.names:
            served = ", ".join(f"`{n}`" for n in self.names)
            raise ApiError(
                404,
                f"The model `{model}` does not exist (this server serves {served})",
                code="model_not_found",
                param="model",
            )

    # --- generation ----------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        req = p.completion_request(await _json_body(request), self.defaults)
        request_id = f"cmpl-{req.request_id or uuid.uuid4().hex}"
        many = len(req.prompts) > 1
        must_fit = req.max_tokens is not None  # an explicit max_tokens must fit the context
        inputs = [  # one engine request per prompt; its n completions are choices i*n .. i*n+n-1
            RequestInput(
                f"{request_id}-{i}" if many else request_id,
                req.params,
                prompt.text
                if prompt.token_ids is None
                else {"prompt_token_ids": prompt.token_ids, "prompt": prompt.text},
                where=f"'prompt[{i}]'" if many else "'prompt'",
                max_tokens_must_fit=must_fit,
                add_special_tokens=req.add_special_tokens,
                cache_salt=req.cache_salt,
            )  # fmt: skip
            for i, prompt in enumerate(req.prompts)
        ]
        answer = Answer([r.request_id for r in inputs], req.params.n)
        answer.echo_only = req.echo_only

        def add(engine: LLMEngine) -> None:  # on the engine thread: it owns the tokenizer
            added = engine.add_requests(inputs)  # every prompt or none
            if req.echo:  # token id prompts echo as text
                answer.echo = [
                    r.text if r.text is not None else engine.detokenize(r.token_ids) for r in added
                ]
                if req.params.logprobs is not None:  # the first prompt token's own text
                    answer.first_text = [_text_of(engine, r.token_ids[0]) for r in added]

        return await self._generate(request, req, request_id, answer, add, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        req = p.chat_request(await _json_body(request), self.defaults, self.tool_call_parser)
        request_id = f"chatcmpl-{req.request_id or uuid.uuid4().hex}"
        chat = RequestInput(
            request_id, req.params, messages=req.messages, where="'messages'",
            max_tokens_must_fit=req.max_tokens is not None,
            chat=self._chat_options(req.chat), add_special_tokens=req.add_special_tokens,
            cache_salt=req.cache_salt,
        )  # fmt: skip

        def add(engine: LLMEngine) -> None:  # on the engine thread: it owns the tokenizer
            engine.add_requests([chat])

        answer = Answer([request_id], req.params.n)
        return await self._generate(request, req, request_id, answer, add, chat=True)

    async def _generate(
        self,
        http_request: Request,
        req: GenerateRequest,
        request_id: str,
        answer: Answer,
        add: Callable[[LLMEngine], None],
        chat: bool,
    ) -> Response:
        """Add the engine requests of ``answer`` (``add``: through the engine's front door,
        ``LLMEngine.add_requests``) and answer with their outputs."""
        self._check_model(req.model)
        if not self.engine_loop.accepting:
            raise ApiError(503, "the server is stopping", "service_unavailable")
        sink = Sink(asyncio.get_running_loop(), asyncio.Queue())  # every choice's outputs
        try:
            await asyncio.wrap_future(self.engine_loop.add(answer.ids, sink, add))
        except (ValueError, TypeError) as e:
            raise p.bad_request(str(e), getattr(e, "param", None)) from None
        except QueueFullError as e:
            raise ApiError(429, str(e), "rate_limit_exceeded", code="queue_full") from None
        except (EngineDeadError, EngineFailure) as e:
            raise ApiError(503, str(e), "service_unavailable") from None
        if req.stream:
            events = self._stream(req, request_id, answer, sink, chat)
            return StreamingResponse(events, media_type="text/event-stream")
        try:
            body = await self._complete(http_request, req, request_id, answer, sink, chat)
            return JSONResponse(body)
        except ClientGone:  # aborted; nobody reads this
            return Response(status_code=499)

    async def _complete(
        self,
        request: Request,
        req: GenerateRequest,
        request_id: str,
        answer: Answer,
        sink: Sink,
        chat: bool,
    ) -> dict[str, Any]:
        reader = Reader(sink, request)
        try:
            while not answer.all_finished:
                answer.update(checked(await reader.next()))
        finally:
            for rid in answer.unfinished:  # the client is gone (or we were cancelled)
                self.engine_loop.abort(rid)
        answers = []
        for _, prompt_idx, out, c in answer.choices():
            echo = answer.echo[prompt_idx] if answer.echo else ""
            token_ids, text = ([], "") if req.echo_only else (c.token_ids, c.text)
            logprobs = None if c.logprobs is None else c.logprobs[: len(token_ids)]
            lp = _logprobs(req, token_ids, logprobs, chat, text_offset=len(echo))
            if echo and lp is not None:
                lp = shapes.joined_logprobs(answer.echoed_logprobs(prompt_idx, out), lp)
            choice = {"text": echo + text, "finish_reason": c.finish_reason, "logprobs": lp}
            if req.tools is not None and req.tools.makes_calls:
                choice.update(_tool_answer(req.tools, text, c.finish_reason))
            if req.params.prompt_logprobs is not None:  # vLLM's field
                choice["prompt_logprobs"] = shapes.prompt_logprobs_json(out.prompt_logprobs)
            answers.append(choice)
        use = answer.usage()
        if chat:
            return shapes.chat_response(request_id, self.model, answers, use)
        return shapes.completion_response(request_id, self.model, answers, use)

    async def _stream(
        self, req: GenerateRequest, request_id: str, answer: Answer, sink: Sink, chat: bool
    ) -> AsyncIterator[str]:
        """Server-sent events: a chunk per new text of a choice (with the log-probabilities
        of its new tokens when asked for), its finish reason, usage if asked for,
        ``[DONE]``. A client gone mid-stream cancels this generator: its requests are
        aborted."""
        try:
            if chat:
                for index in range(answer.num_choices):
                    role = {"role": "assistant"}
                    yield _sse(shapes.chat_chunk(request_id, self.model, role, None, index))
            num_sent = [0] * answer.num_choices  # characters of each choice's text streamed
            tokens_sent = [0] * answer.num_choices  # and tokens (their log-probabilities)
            stops = req.params.stop
            while not answer.all_finished:
                try:
                    out = checked(await sink.queue.get())
                except ApiError as e:
                    answer.failed = True
                    yield _sse(e.body())
                    break
                prompt_idx = answer.update(out)
                for completion in out.outputs:  # every completion of the prompt, merged
                    index = prompt_idx * answer.n + completion.index
                    named = req.tools is not None and req.tools.choice == "named"
                    if req.tools is not None and req.tools.makes_calls and not named:  # at the end
                        if completion.finished and not answer.sent_end[index]:
                            answer.sent_end[index] = True
                            yield _sse(self._tool_chunk(req, request_id, index, completion))
                        continue
                    text = "" if req.echo_only else completion.text
                    token_ids = [] if req.echo_only else completion.token_ids
                    end = len(text) if completion.finished else safe_end(text, stops)
                    delta = text[num_sent[index] : end]
                    num_sent[index] = max(num_sent[index], end)
                    if not (delta or (completion.finished and not answer.sent_end[index])):
                        continue
                    answer.sent_end[index] = completion.finished
                    first, tokens_sent[index] = tokens_sent[index], len(token_ids)
                    new = token_ids[first:]
                    lp = None
                    echo = answer.echo[prompt_idx] if answer.echo else ""
                    if completion.logprobs is not None:
                        lp = _logprobs(
                            req, new, completion.logprobs[first : len(token_ids)], chat,
                            text_offset=len(echo) + num_sent[index] - len(delta),
                        )  # fmt: skip
                    reason = completion.finish_reason
                    if echo and not answer.echoed[index]:  # the first chunk: its prompt
                        answer.echoed[index] = True
                        delta = echo + delta
                        if lp is not None:
                            lp = shapes.joined_logprobs(answer.echoed_logprobs(prompt_idx, out), lp)
                    if named:  # the text is the call's arguments, streamed as they come
                        yield _sse(
                            self._arguments_chunk(req, request_id, answer, delta, reason, index, lp)
                        )
                        continue
                    yield _sse(self._chunk(request_id, delta, reason, chat, index, lp))
            if req.include_usage and answer.all_finished and not answer.failed:
                chunk = self._chunk(request_id, "", None, chat, 0)
                chunk["choices"] = []
                chunk["usage"] = answer.usage()
                yield _sse(chunk)
            yield "data: [DONE]\n\n"
        finally:
            for rid in answer.unfinished:
                self.engine_loop.abort(rid)

    def _tool_chunk(
        self, req: GenerateRequest, request_id: str, index: int, completion: Any
    ) -> dict:
        """A chat reply that may hold tool calls, in one chunk once finished (its calls
        are known only then): its content, calls (each with its ``index``) and finish
        reason, with the log-probabilities of all its tokens when asked for."""
        assert req.tools is not None
        answer = _tool_answer(req.tools, completion.text, completion.finish_reason)
        delta: dict[str, Any] = {"content": answer["text"]} if answer["text"] else {}
        if answer.get("tool_calls"):
            delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(answer["tool_calls"])]
        lp = _logprobs(req, completion.token_ids, completion.logprobs, True)
        return shapes.chat_chunk(request_id, self.model, delta, answer["finish_reason"], index, lp)

    def _arguments_chunk(
        self,
        req: GenerateRequest,
        request_id: str,
        answer: Answer,
        text: str,
        finish_reason: str | None,
        index: int,
        logprobs: dict[str, Any] | None,
    ) -> dict:
        """A named function's call streamed as OpenAI streams it: the first chunk names the
        call (its id, type and name), every chunk carries the next piece of its
        ``arguments``."""
        assert req.tools is not None and req.tools.name is not None
        call: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
        if index not in answer.call_ids:
            call["id"] = answer.call_ids[index] = new_call_id()
            call["type"] = "function"
            call["function"]["name"] = req.tools.name
        delta: dict[str, Any] = {"tool_calls": [call]} if text or "id" in call else {}
        return shapes.chat_chunk(request_id, self.model, delta, finish_reason, index, logprobs)

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
            return shapes.chat_chunk(request_id, self.model, delta, finish_reason, index, logprobs)
        return shapes.completion_chunk(request_id, self.model, text, finish_reason, index, logprobs)


def _tool_answer(plan: ToolPlan, text: str, finish_reason: str | None) -> dict[str, Any]:
    """A finished chat reply as ``content`` (``text``) and ``tool_calls``; a reply with
    calls from ``required`` or ``auto`` finishes with ``tool_calls`` (OpenAI's; a named
    function's keeps its own reason, as OpenAI's forced calls)."""
    content, calls = plan.answer(text)
    if calls and plan.choice != "named" and finish_reason == "stop":
        finish_reason = "tool_calls"
    return {"text": content, "tool_calls": calls, "finish_reason": finish_reason}


def _text_of(engine: LLMEngine, token_id: int) -> str:
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
        return shapes.chat_logprobs(token_ids, logprobs, top)
    return shapes.completion_logprobs(token_ids, logprobs, text_offset)


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _json_body(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except ValueError as e:
        raise p.bad_request(f"the request body is not valid JSON: {e}") from None


def render_chat(
    engine: LLMEngine, messages: Any, options: ChatOptions | None = None
) -> tuple[str, list[int]]:
    """``/tokenize``'s chat: its prompt and token ids (``InputProcessor.render_chat``, the
    one place that renders chats, which the front door uses too); a model without a
    template, or messages it refuses, is a 400."""
    try:
        return engine.inputs.render_chat(messages, options)
    except ValueError as e:
        raise p.bad_request(f"{e}; use /v1/completions for plain prompts", "messages") from e

"""``LLM``: the offline API in vLLM's shape: ``LLM(...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import logging
import numbers
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sarathi_pp.config import EngineConfig, make_config
from sarathi_pp.config_file import load_config
from sarathi_pp.engine import LLMEngine
from sarathi_pp.engine.input_processor import ChatOptions, Prompt, RequestInput
from sarathi_pp.engine.replicas import ReplicatedEngine, create_engine
from sarathi_pp.outputs import RequestOutput
from sarathi_pp.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        config = kwargs.pop("config", None)
        if config is None:
            overrides = dict(kwargs)
            if model is not None:
                overrides["model"] = model
            config = make_config(**overrides)
        elif model is not None or kwargs:
            config = config.replace(**({"model": model} if model else {}), **kwargs)
        self.config: EngineConfig = config
        # One engine, or data_parallel_size of them behind a router, alike to this API.
        self.engine: LLMEngine | ReplicatedEngine = create_engine(config)
        self._request_counter = 0

    @classmethod
    def from_config(cls, path: str | Path, **overrides: Any) -> LLM:
        """From a YAML config; keyword overrides (flat names or ``section.key``) win."""
        return cls(config=load_config(path, **overrides))

    def shutdown(self) -> None:
        """Release the executor (stage actors, process groups); the LLM is unusable after."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """``SamplingParams()`` with the model folder's ``generation_config.json`` sampling
        defaults (vLLM's): what ``generate`` and ``chat`` use without ``sampling_params``."""
        return self.engine.default_sampling_params()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's name): the next requests prefill their whole
        prompts. ``False``, and nothing forgotten, while requests are unfinished."""
        return self.engine.reset_prefix_cache()

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        on_finished: Callable[[int, RequestOutput], None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        All prompts and parameters are checked before any work runs: a bad one raises
        ``ValueError`` naming its index. A request that fails while running finishes with
        ``finish_reason == "error"`` in its own output; the others complete. With
        ``SamplingParams(n=k)`` a prompt's output has ``k`` completions (``index`` 0..k-1;
        ``engine/parallel_sampling.py``). Every request goes through the engine's one front
        door, ``LLMEngine.add_requests``.
        ``on_finished(index, output)`` is called as each request finishes (in completion
        order; the CLI streams ``--output`` with it). If the call is interrupted (Ctrl-C) or
        the pipeline is lost, this call's unfinished requests are aborted (they leave the
        engine, their blocks freed) before the exception propagates.
        """
        items = _as_prompt_list(prompts)
        params = self._params_per_prompt(sampling_params, len(items))
        requests = [
            RequestInput(self._next_id(), sp, prompt, where=f"prompt {i}")
            for i, (prompt, sp) in enumerate(zip(items, params))
        ]
        return self._generate(requests, use_tqdm, on_finished)

    def _generate(
        self,
        requests: list[RequestInput],
        use_tqdm: bool,
        on_finished: Callable[[int, RequestOutput], None] | None,
    ) -> list[RequestOutput]:
        """Add ``requests`` (all or none: ``LLMEngine.add_requests``), run them to the end,
        write the run's records; their outputs in order."""
        try:
            self.engine.add_requests(requests)
        except BaseException:
            self._request_counter -= len(requests)  # refused: their ids were never used
            raise
        try:
            outputs = self._run([r.request_id for r in requests], use_tqdm, on_finished)
        except BaseException:
            for r in requests:  # none of this call's requests outlives it
                self.engine.abort(r.request_id)
            raise
        try:  # with a run dir: the report over every request so far
            self.engine.write_run_records()
        except Exception:  # noqa: BLE001 - records failing to write never cost the outputs
            logger.exception("writing the run's records failed; the outputs are returned")
        return outputs

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        on_finished: Callable[[int, RequestOutput], None] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """As vLLM's ``LLM.chat``: one conversation (a list of ``{"role", "content"}``) or a
        list of them, each rendered by the chat template (the tokenizer's, or
        ``chat_template``) with the generation prompt (or, ``continue_final_message``, the
        last message continued), ``chat_template_kwargs`` as template variables, then
        ``generate``. ``ValueError`` for a model without a chat template."""
        if add_generation_prompt and continue_final_message:
            raise ValueError(
                "continue_final_message=True needs add_generation_prompt=False (the last "
                "message is continued, not answered)"
            )
        options = ChatOptions(
            add_generation_prompt, continue_final_message, chat_template,
            dict(chat_template_kwargs or {}),
        )  # fmt: skip
        conversations: list[Any]
        if isinstance(messages, list) and messages and isinstance(messages[0], dict):
            conversations = [messages]
        elif isinstance(messages, list) and messages:
            conversations = list(messages)
        else:
            raise ValueError(f"messages must be a conversation or a list of them, got {messages!r}")
        params = self._params_per_prompt(sampling_params, len(conversations))
        requests = [
            RequestInput(
                self._next_id(),
                sp,
                messages=conversation,
                where=f"conversation {i}",
                chat=options,
            )  # fmt: skip
            for i, (conversation, sp) in enumerate(zip(conversations, params))
        ]
        return self._generate(requests, use_tqdm, on_finished)

    def _next_id(self) -> str:
        request_id = str(self._request_counter)
        self._request_counter += 1
        return request_id

    def _params_per_prompt(self, sp, n: int) -> list[SamplingParams]:
        if sp is None:  # vLLM's: with the model folder's generation_config.json defaults
            return [self.engine.default_sampling_params()] * n
        if isinstance(sp, SamplingParams):
            return [sp] * n
        if not isinstance(sp, (list, tuple)):  # a dict would be read as its keys
            raise TypeError(
                f"sampling_params must be a SamplingParams or a list of them (one per "
                f"prompt), got {type(sp).__name__}"
            )
        sp = list(sp)
        if len(sp) != n:
            raise ValueError(f"got {len(sp)} sampling params for {n} prompts")
        for i, p in enumerate(sp):
            if not isinstance(p, SamplingParams):
                raise TypeError(
                    f"sampling_params[{i}] must be SamplingParams, got {type(p).__name__}"
                )
        return sp

    def _run(
        self,
        request_ids: list[str],
        use_tqdm: bool,
        on_finished: Callable[[int, RequestOutput], None] | None = None,
    ) -> list[RequestOutput]:
        """Step until every request of ``request_ids`` has finished; their final outputs, in
        that order (a request of ``n > 1`` completions comes merged from the engine)."""
        from tqdm.auto import tqdm

        index = {request_id: i for i, request_id in enumerate(request_ids)}
        done: dict[int, RequestOutput] = {}
        bar = tqdm(
            total=len(request_ids), desc="generate", disable=not use_tqdm or len(request_ids) < 2,
            unit="req",
        )  # fmt: skip
        try:
            while len(done) < len(request_ids):
                for out in self.engine.step():
                    i = index.get(out.request_id)
                    if not out.finished or i is None or i in done:
                        continue
                    done[i] = out
                    bar.update(1)
                    if on_finished is not None:
                        on_finished(i, out)
            self.engine.settle()  # nothing left in flight: the engine is idle
        finally:
            bar.close()
        return [done[i] for i in range(len(request_ids))]


def _as_prompt_list(prompts: Prompt | list[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    items: list[Any] = list(prompts)
    if not items:
        raise ValueError("no prompts given")
    if all(isinstance(t, numbers.Integral) for t in items):
        # One prompt given as token ids (numpy's too); a bool among them is refused later,
        # naming its position.
        return [items]
    return items

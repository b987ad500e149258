"""``LLM``: the offline API in vLLM's shape: ``LLM(...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import logging
import numbers
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sarathi_pp.config import EngineConfig, load_config, make_config
from sarathi_pp.engine import LLMEngine, parallel_sampling
from sarathi_pp.engine.input_processor import as_token_ids
from sarathi_pp.outputs import RequestOutput
from sarathi_pp.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# A prompt: text, {"prompt_token_ids": [...]} (vLLM's TokensPrompt) or a list of token ids.
Prompt = str | dict | list


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
        self.engine = LLMEngine(config)
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
        ``engine/parallel_sampling.py``).
        ``on_finished(index, output)`` is called as each request finishes (in completion
        order; the CLI streams ``--output`` with it). If the call is interrupted (Ctrl-C) or
        the pipeline is lost, this call's unfinished requests are aborted (they leave the
        engine, their blocks freed) before the exception propagates.
        """
        items = _as_prompt_list(prompts)
        params = self._params_per_prompt(sampling_params, len(items))
        requests = [self._prepare(i, p, sp) for i, (p, sp) in enumerate(zip(items, params))]
        groups: list[tuple[str, list[str]]] = []  # each prompt's id and its engine requests'
        added: list[str] = []
        try:
            for (text, token_ids), sp in zip(requests, params):
                request_id = str(self._request_counter)
                self._request_counter += 1
                children = []
                for child_id, child_params in parallel_sampling.child_requests(request_id, sp):
                    self.engine.add_request(
                        child_id, text, child_params, prompt_token_ids=token_ids
                    )
                    added.append(child_id)
                    children.append(child_id)
                groups.append((request_id, children))
            outputs = self._run(groups, use_tqdm, on_finished)
        except BaseException:
            for child_id in added:  # none of this call's requests outlives it
                self.engine.abort(child_id)
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
    ) -> list[RequestOutput]:
        """As vLLM's ``LLM.chat``: one conversation (a list of ``{"role", "content"}``) or a
        list of them, each rendered by the tokenizer's chat template with the generation
        prompt, then ``generate``. ``ValueError`` for a model without a chat template."""
        conversations: list[Any]
        if isinstance(messages, list) and messages and isinstance(messages[0], dict):
            conversations = [messages]
        elif isinstance(messages, list) and messages:
            conversations = list(messages)
        else:
            raise ValueError(f"messages must be a conversation or a list of them, got {messages!r}")
        prompts: list[Prompt] = []
        for i, conversation in enumerate(conversations):
            try:
                text, token_ids = self.engine.inputs.render_chat(conversation)
            except ValueError as e:
                raise ValueError(f"conversation {i}: {e}") from None
            prompts.append({"prompt": text, "prompt_token_ids": token_ids})
        return self.generate(prompts, sampling_params, use_tqdm, on_finished)

    def _params_per_prompt(self, sp, n: int) -> list[SamplingParams]:
        if sp is None:
            return [SamplingParams()] * n
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

    def _prepare(
        self, index: int, prompt: Prompt, params: SamplingParams
    ) -> tuple[str | None, list[int]]:
        """The prompt's text and token ids (truncated as ``params`` ask), checked with
        ``params`` as ``add_request`` will check them."""
        where = f"prompt {index}"
        text: str | None
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(f"{where} is empty")
            text, token_ids = prompt, self.engine.tokenize(prompt)
        elif isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                text = prompt.get("prompt")
                token_ids = as_token_ids(prompt["prompt_token_ids"], where)
            elif isinstance(prompt.get("prompt"), str):
                return self._prepare(index, prompt["prompt"], params)
            else:
                raise ValueError(f"{where}: a dict prompt needs 'prompt_token_ids' or 'prompt'")
        elif isinstance(prompt, (list, tuple)):
            text, token_ids = None, as_token_ids(prompt, where)
        else:
            raise TypeError(
                f"{where} must be a string, a token id list or a dict, got {type(prompt).__name__}"
            )
        inputs = self.engine.inputs
        token_ids = inputs.truncated(token_ids, params)
        self.engine.validate_prompt(token_ids, where)
        inputs.check_params(inputs.with_bad_words(params, where), where)
        return text, token_ids

    def _run(
        self,
        groups: list[tuple[str, list[str]]],
        use_tqdm: bool,
        on_finished: Callable[[int, RequestOutput], None] | None = None,
    ) -> list[RequestOutput]:
        """Step until every prompt's engine requests (``groups``: the prompt's id and its
        children's) have finished; each prompt's output, in prompt order."""
        from tqdm.auto import tqdm

        owner = {child: i for i, (_, children) in enumerate(groups) for child in children}
        left = [len(children) for _, children in groups]  # unfinished children per prompt
        done: dict[str, RequestOutput] = {}
        merged: dict[int, RequestOutput] = {}
        bar = tqdm(
            total=len(groups), desc="generate", disable=not use_tqdm or len(groups) < 2, unit="req"
        )
        try:
            while len(merged) < len(groups):
                for out in self.engine.step():
                    i = owner.get(out.request_id)
                    if not out.finished or i is None or out.request_id in done:
                        continue
                    done[out.request_id] = out
                    left[i] -= 1
                    if left[i] == 0:
                        request_id, children = groups[i]
                        merged[i] = parallel_sampling.merge(request_id, [done[c] for c in children])
                        bar.update(1)
                        if on_finished is not None:
                            on_finished(i, merged[i])
            # Scheduled ahead, a decode of a request that has since stopped may still be
            # in flight: the engine is left idle (its blocks freed, set_scheduler allowed).
            while self.engine.num_inflight and not self.engine.scheduler.has_unfinished():
                self.engine.step()
        finally:
            bar.close()
        return [merged[i] for i in range(len(groups))]


def _as_prompt_list(prompts: Prompt | list[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if not prompts:
        raise ValueError("no prompts given")
    if all(isinstance(t, numbers.Integral) for t in prompts):
        # One prompt given as token ids (numpy's too); a bool among them is refused later,
        # naming its position.
        return [prompts]
    return prompts

"""A vLLM user's habits against a live ``sarathi-pp serve`` (the tiny random Llama, the
official ``openai`` client): the per-endpoint ``max_tokens`` defaults, the model folder's
``generation_config.json`` (its sampling defaults and extra EOS ids), every request field of
``sarathi_pp/serve/request_fields.py`` honoured or refused as listed, and vLLM's metric
names."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from serving import running_server  # noqa: E402

from sarathi_pp import LLM, SamplingParams  # noqa: E402

MODEL = "tiny"
MAX_MODEL_LEN = 96
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
PROMPT = "The pipeline"


@pytest.fixture(scope="module")
def chat_dir(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with a chat template."""
    path = tmp_path_factory.mktemp("habits") / "llama"
    shutil.copytree(llama_dir, path)
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def server(chat_dir: Path) -> Iterator:
    with running_server(chat_dir, max_model_len=MAX_MODEL_LEN) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> Any:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


# --- honest defaults -----------------------------------------------------------------------
def test_chat_without_max_tokens_runs_to_the_end_of_the_context(client) -> None:
    # vLLM's chat default: the rest of the context (the random model never says EOS here)
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=0.0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    use = r.usage
    assert r.choices[0].finish_reason == "length"
    assert use.prompt_tokens + use.completion_tokens == MAX_MODEL_LEN > 16 + use.prompt_tokens


def test_completion_default_is_vllms_16(client) -> None:
    r = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0.0)
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"


def test_max_tokens_none_offline_runs_to_the_end_of_the_context(chat_dir: Path) -> None:
    with LLM(model=str(chat_dir), max_model_len=40) as llm:
        params = SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)
        out = llm.generate([PROMPT], params, use_tqdm=False)[0]
        assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 40
        assert out.outputs[0].finish_reason == "length"


def test_generation_config_defaults_and_extra_eos(chat_dir: Path, tmp_path: Path) -> None:
    """The folder's temperature (0: greedy) is the default a request overrides; its extra
    EOS id stops every request."""
    with LLM(model=str(chat_dir)) as llm:
        greedy = SamplingParams(max_tokens=8, temperature=0.0)
        tokens = llm.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0].token_ids
    folder = tmp_path / "genconf"
    shutil.copytree(chat_dir, folder)
    eos = tokens[3]
    first = tokens.index(eos)  # the first time it comes
    (folder / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [2, eos], "temperature": 0.0, "top_k": 5})
    )
    with running_server(folder) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8)
        assert r.choices[0].finish_reason == "stop"  # at the extra EOS
        assert r.usage.completion_tokens == first + 1
        again = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8)
        assert again.choices[0].text == r.choices[0].text  # greedy by default
        sampled = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.5, seed=1,
            extra_body={"ignore_eos": True, "top_k": 0},
        )  # fmt: skip
        assert sampled.usage.completion_tokens == 8  # the request's values win

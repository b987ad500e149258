"""``LLM.chat`` and ``sarathi-pp generate --chat``: conversations through the tokenizer's
chat template, equal to ``generate`` on the rendered text (the tiny Llama with a template
added: its byte tokenizer has none)."""

from __future__ import annotations

import json
import shutil

import pytest

from sarathi_pp import LLM, SamplingParams
from sarathi_pp.cli import main

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def chat_dir(llama_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("chat") / "llama"
    shutil.copytree(llama_dir, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def test_chat_equals_generate_on_the_rendered_text(chat_dir):
    talks = [
        [{"role": "user", "content": "Hello there"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}],
    ]
    with LLM(str(chat_dir), max_model_len=256) as llm:
        outs = llm.chat(talks, GREEDY, use_tqdm=False)
        one = llm.chat(talks[1], GREEDY, use_tqdm=False)  # a single conversation
        tok = llm.get_tokenizer()
        rendered = [tok.apply_chat_template(t, tokenize=False, add_generation_prompt=True)
                    for t in talks]  # fmt: skip
        assert rendered[1] == "<|system|>Be brief.\n<|user|>Why?\n<|assistant|>"
        ref = llm.generate(rendered, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in ref]
    assert one[0].outputs[0].token_ids == ref[1].outputs[0].token_ids
    assert outs[0].prompt == rendered[0]


def test_no_template_and_bad_messages_are_clear_errors(llama_dir, chat_dir):
    no_template = LLM(str(llama_dir), max_model_len=256)
    try:
        with pytest.raises(ValueError, match="conversation 0: the tokenizer .* no chat template"):
            no_template.chat([{"role": "user", "content": "hi"}], GREEDY)
    finally:
        no_template.shutdown()
    chat = LLM(str(chat_dir), max_model_len=256)
    try:
        with pytest.raises(ValueError, match="conversation 0: a conversation must be"):
            chat.chat([[{"role": "user"}]], GREEDY)
    finally:
        chat.shutdown()


def test_cli_chat_with_system(chat_dir, llama_dir, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    argv = ["generate", "--model", str(chat_dir), "--set", "model.max_model_len=256",
            "--chat", "--system", "Be brief.", "--prompt", "Why?", "--max-tokens", "6",
            "--ignore-eos", "--output", str(out)]  # fmt: skip
    assert main(argv) == 0
    record = json.loads(out.read_text())
    with LLM(str(chat_dir), max_model_len=256) as llm:
        talk = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}]
        ref = llm.chat(talk, GREEDY, use_tqdm=False)[0]
    assert record["prompt"] == "Why?" and record["token_ids"] == ref.outputs[0].token_ids
    for bad, message in (
        (["--model", str(llama_dir), "--chat"], "has no chat template"),
        (["--model", str(chat_dir), "--system", "x"], "--system goes with --chat"),
    ):
        with pytest.raises(SystemExit) as e:
            main(["generate", *bad, "--prompt", "hi", "--set", "model.max_model_len=256"])
        assert e.value.code == 2 and message in capsys.readouterr().err

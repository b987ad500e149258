"""``sarathi-pp generate``: a completion for each prompt, printed or written as JSON Lines.

The pieces that need no model (the sampling parameters, collecting prompts, the output
records) are plain functions so they can be tested in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import IO, Any

from sarathi_pp.cli.common import (
    PROG,
    add_engine_args,
    config_from_args,
    hold_signals,
    received_signal,
    user_errors,
)
from sarathi_pp.engine import EngineDeadError
from sarathi_pp.executors import StageError
from sarathi_pp.sampling_params import SamplingParams, SamplingParamsError

# Above this many prompts a progress bar is drawn even when stderr is not a terminal.
PROGRESS_MIN_PROMPTS = 64


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "generate",
        help="generate completions for prompts",
        description="Generate a completion for each prompt (greedy unless --temperature).",
    )
    add_engine_args(p)
    g = p.add_argument_group("prompts (--prompt ones first, then the file's)")
    g.add_argument("--prompt", dest="prompts", action="append", default=[], metavar="TEXT")
    g.add_argument(
        "--prompts-file", metavar="FILE", help="one prompt a line, blank lines skipped; - = stdin"
    )
    g.add_argument(
        "--chat",
        action="store_true",
        help="each prompt is one user turn of its own conversation, rendered by the model's "
        "chat template",
    )
    g.add_argument("--system", metavar="TEXT", help="with --chat: a system message first")
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=16, metavar="N", help="default: 16")
    g.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        metavar="T",
        help="default: 0 (greedy, unlike vLLM's 1; the sampling defaults of the model "
        "folder's generation_config.json apply to serve and LLM(), not to these flags)",
    )
    g.add_argument("--top-p", type=float, default=1.0, metavar="P", help="default: 1 (off)")
    g.add_argument("--top-k", type=int, default=0, metavar="K", help="default: 0 (off)")
    g.add_argument("--min-p", type=float, default=0.0, metavar="P", help="default: 0 (off)")
    g.add_argument(
        "--presence-penalty", type=float, default=0.0, metavar="X", help="-2..2, default: 0"
    )
    g.add_argument(
        "--frequency-penalty", type=float, default=0.0, metavar="X", help="-2..2, default: 0"
    )
    g.add_argument(
        "--repetition-penalty", type=float, default=1.0, metavar="X", help="> 0, default: 1 (off)"
    )
    g.add_argument(
        "--min-tokens", type=int, default=0, metavar="N",
        help="no EOS or stop token before N tokens (default: 0)",
    )  # fmt: skip
    g.add_argument("--ignore-eos", action="store_true", help="keep going past EOS")
    g.add_argument(
        "--stop", action="append", default=[], metavar="STR", help="stop string (repeatable)"
    )
    g.add_argument(
        "--bad-word", dest="bad_words", action="append", default=[], metavar="STR",
        help="a word never generated (repeatable; vLLM's bad_words)",
    )  # fmt: skip
    g.add_argument(
        "--truncate-prompt-tokens", type=int, metavar="N",
        help="use only each prompt's last N tokens (-1: the last max_model_len)",
    )  # fmt: skip
    g.add_argument(
        "--num-completions", type=int, default=1, metavar="N",
        help="completions per prompt, SamplingParams.n (default: 1; they differ with "
        "--temperature > 0)",
    )  # fmt: skip
    g.add_argument(
        "--logprobs", type=int, metavar="K",
        help="report each generated token's log-probability and the K most likely tokens' "
        "(0-20; with --output: a 'logprobs' field)",
    )  # fmt: skip
    g.add_argument(
        "--prompt-logprobs", type=int, metavar="K",
        help="report each prompt token's log-probability (after the first) and the K most "
        "likely tokens' at its position (0-20; with --output: a 'prompt_logprobs' field, "
        "null for the first token)",
    )  # fmt: skip
    g.add_argument(
        "--structured-outputs", type=_json_object, metavar="JSON",
        help="constrain the output (SamplingParams.structured_outputs): a JSON object with "
        'one of json (a schema), regex, choice, grammar, json_object, e.g. \'{"regex": "[ab]+"}\'',
    )  # fmt: skip
    g = p.add_argument_group("output")
    g.add_argument(
        "--output",
        metavar="FILE",
        help="write JSON Lines, one object per prompt in prompt order (- = stdout); "
        "default: print readable results to stdout",
    )
    g.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: when stderr is a terminal or there are "
        f"more than {PROGRESS_MIN_PROMPTS} prompts)",
    )
    p.set_defaults(func=run)


# --- pieces that need no model --------------------------------------------------------------
# SamplingParams' field -> the flag that sets it (``SamplingParamsError.param``)
SAMPLING_FLAGS = {
    "max_tokens": "--max-tokens", "temperature": "--temperature", "top_p": "--top-p",
    "top_k": "--top-k", "stop": "--stop", "n": "--num-completions", "min_p": "--min-p",
    "presence_penalty": "--presence-penalty", "frequency_penalty": "--frequency-penalty",
    "repetition_penalty": "--repetition-penalty", "logprobs": "--logprobs",
    "min_tokens": "--min-tokens", "prompt_logprobs": "--prompt-logprobs",
    "bad_words": "--bad-word", "truncate_prompt_tokens": "--truncate-prompt-tokens",
    "structured_outputs": "--structured-outputs",
}  # fmt: skip


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    """``SamplingParams`` from the flags; a ``ValueError`` names the flag."""
    try:
        return _sampling_params(args)
    except SamplingParamsError as e:
        raise _naming_the_flag(e) from None


def _naming_the_flag(e: SamplingParamsError) -> ValueError:
    flag = SAMPLING_FLAGS.get(e.param)
    return ValueError(f"{flag}: {e}" if flag else str(e))


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        ignore_eos=args.ignore_eos,
        stop=tuple(args.stop),
        n=args.num_completions,
        min_tokens=args.min_tokens,
        min_p=args.min_p,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        logprobs=args.logprobs,
        prompt_logprobs=args.prompt_logprobs,
        bad_words=tuple(args.bad_words),
        truncate_prompt_tokens=args.truncate_prompt_tokens,
        structured_outputs=getattr(args, "structured_outputs", None),
    )


def collect_prompts(args: argparse.Namespace, stdin: IO[str] | None = None) -> list[str]:
    """``--prompt`` ones first, then ``--prompts-file`` lines (blank ones skipped)."""
    prompts = list(args.prompts)
    if args.prompts_file is not None:
        prompts += read_prompts_file(args.prompts_file, stdin)
    if not prompts:
        raise ValueError("no prompts: give --prompt TEXT or --prompts-file FILE")
    if getattr(args, "system", None) is not None and not getattr(args, "chat", False):
        raise ValueError("--system goes with --chat")
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty")
    return prompts


def read_prompts_file(path: str, stdin: IO[str] | None = None) -> list[str]:
    if path == "-":
        text = (stdin or sys.stdin).read()
    else:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"prompts file {path!r} does not exist")
        text = p.read_text(encoding="utf-8")
    return [line for line in text.splitlines() if line.strip()]


def check_output_path(path: str | None) -> None:
    """Fail before the model loads, not after the run, when the output can't be written."""
    if path is None or path == "-":
        return
    parent = Path(path).parent
    if not parent.is_dir():
        raise FileNotFoundError(f"output folder {str(parent)!r} does not exist")
    if Path(path).is_dir():
        raise ValueError(f"--output {path!r} is a folder")


def should_show_progress(choice: bool | None, num_prompts: int, stderr: IO[str]) -> bool:
    """``--progress``/``--no-progress`` if given; else a bar on a terminal (where ``\\r``
    redraws in place) or for a long run even in a log (where it is a heartbeat)."""
    if choice is not None:
        return choice
    return stderr.isatty() or num_prompts > PROGRESS_MIN_PROMPTS


# --- results --------------------------------------------------------------------------------
def result_record(index: int, out: Any) -> dict[str, Any]:
    """One JSON Lines object for ``out`` (a ``RequestOutput``): its first completion's
    fields and, with ``--num-completions`` > 1, every completion in ``completions``."""
    completion = out.outputs[0]
    record = {
        "index": index,
        "prompt": out.prompt,
        "prompt_token_ids": list(out.prompt_token_ids),
        **_completion_fields(completion),
        "error": out.error or completion.error,
        "ttft_s": out.metrics.ttft,
    }
    if out.prompt_logprobs is not None:  # per prompt token: null for the first
        record["prompt_logprobs"] = [
            None if entry is None else _logprob_entries(entry) for entry in out.prompt_logprobs
        ]
    if len(out.outputs) > 1:
        record["completions"] = [
            {"index": c.index, **_completion_fields(c), "error": c.error} for c in out.outputs
        ]
    return record


def _logprob_entries(entry: dict[int, Any]) -> list[dict[str, Any]]:
    """One position's tokens: the sampled (or prompt) one first, then the most likely."""
    return [
        {"token_id": t, "text": e.decoded_token, "logprob": e.logprob, "rank": e.rank}
        for t, e in entry.items()
    ]


def _completion_fields(c: Any) -> dict[str, Any]:
    fields = {
        "token_ids": list(c.token_ids),
        "text": c.text,
        "finish_reason": c.finish_reason,
    }
    if c.logprobs is not None:  # per token: the sampled one first, then the most likely
        fields["logprobs"] = [_logprob_entries(entry) for entry in c.logprobs]
        fields["cumulative_logprob"] = c.cumulative_logprob
    return fields


def _completions(record: dict[str, Any]) -> list[dict[str, Any]]:
    return record.get("completions", [record])


def write_jsonl(records: list[dict[str, Any]], stream: IO[str]) -> None:
    for record in records:
        stream.write(json.dumps(record, ensure_ascii=False) + "\n")


def print_readable(records: list[dict[str, Any]], stream: IO[str]) -> None:
    # repr: a random or small model emits newlines and control bytes; keep one field a line.
    for r in records:
        print(f"[{r['index']}] prompt: {r['prompt']!r}", file=stream)
        if "prompt_logprobs" in r:  # per prompt token after the first
            steps = " ".join(
                f"{p[0]['text']!r}:{p[0]['logprob']:.2f}" for p in r["prompt_logprobs"][1:]
            )
            print(f"    prompt logprobs: {steps}", file=stream)
        many = "completions" in r
        for c in _completions(r):
            label = f"output {c['index']}" if many else "output"
            print(f"    {label}: {c['text']!r}", file=stream)
            if "logprobs" in c:  # per token: its text and log-probability
                steps = " ".join(f"{p[0]['text']!r}:{p[0]['logprob']:.2f}" for p in c["logprobs"])
                print(f"    logprobs: {steps}", file=stream)
            status = f"{c['finish_reason']}, {len(c['token_ids'])} tokens"
            if "cumulative_logprob" in c:
                status += f", cumulative logprob {c['cumulative_logprob']:.3f}"
            if c["error"]:
                status += f", error: {c['error']}"
            print(f"    finish: {status}", file=stream)


def summary_line(records: list[dict[str, Any]], wall_s: float) -> str:
    num_tokens = sum(len(c["token_ids"]) for r in records for c in _completions(r))
    num_failed = sum(1 for r in records if r["error"])
    rate = num_tokens / wall_s if wall_s > 0 else float("inf")
    failed = f", {num_failed} failed" if num_failed else ""
    plural = "" if len(records) == 1 else "s"
    return (
        f"{PROG}: {len(records)} request{plural}{failed}, {num_tokens} generated tokens "
        f"in {wall_s:.2f} s ({rate:.1f} tokens/s)"
    )


# --- the subcommand ---------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    """Generate; a run stopped by Ctrl-C or SIGTERM (exit 130 / 143) or by a lost pipeline
    (exit 1) keeps every request that finished: ``--output FILE`` gets one line per request
    as it finishes (completion order) and, at a clean end, is rewritten in prompt order."""
    from sarathi_pp.llm import LLM  # loads the engine: only once the arguments are known good

    with user_errors():
        config = config_from_args(args)
        params = sampling_params_from_args(args)
        prompts = collect_prompts(args)
        check_output_path(args.output)
        llm = LLM(config=config)
    sink = None
    try:  # from here on the stages are up: released whatever happens
        with user_errors():
            chat = conversation_of(args.system) if args.chat else None
            requests = [tokenized_prompt(llm, i, p, chat, params) for i, p in enumerate(prompts)]
        sink = FinishedSink(args.output)
        use_tqdm = should_show_progress(args.progress, len(prompts), sys.stderr)
        start = time.perf_counter()
        outputs = llm.generate(requests, params, use_tqdm=use_tqdm, on_finished=sink.add)
        # until the last request finished: not the run dir's report written after it
        wall_s = (sink.last_finished_at or time.perf_counter()) - start
    except (KeyboardInterrupt, StageError, EngineDeadError) as e:
        return stopped(e, llm, sink, len(prompts))
    finally:
        llm.shutdown()
        if sink is not None:
            sink.close()
    records = [result_record(i, out) for i, out in enumerate(outputs)]
    if args.output is None:
        print_readable(records, sys.stdout)
    elif args.output == "-":
        write_jsonl(records, sys.stdout)
    else:
        write_atomically(args.output, records)
    print(summary_line(records, wall_s), file=sys.stderr)
    return 1 if any(r["error"] for r in records) else 0


class FinishedSink:
    """``--output FILE``: one JSON line per request as it finishes, flushed at once."""

    def __init__(self, path: str | None) -> None:
        self.file = None
        if path is not None and path != "-":
            self.file = open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self.num_finished = 0
        self.last_finished_at: float | None = None  # time.perf_counter()

    def add(self, index: int, out: Any) -> None:
        self.last_finished_at = time.perf_counter()
        self.num_finished += 1
        if self.file is not None:
            write_jsonl([result_record(index, out)], self.file)
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def write_atomically(path: str, records: list[dict[str, Any]]) -> None:
    """The records in prompt order, replacing ``path`` in one step (never half a file)."""
    tmp = Path(path).with_name(Path(path).name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        write_jsonl(records, f)
    os.replace(tmp, path)


def stopped(error: BaseException, llm: Any, sink: FinishedSink | None, num_prompts: int) -> int:
    """A run that could not finish: records flushed, what finished kept, a clear line (a
    further SIGTERM or Ctrl-C meanwhile is held, not raised)."""
    hold_signals()
    try:
        llm.engine.write_run_records()
    except Exception as e:  # noqa: BLE001 - the finished outputs matter more
        print(f"{PROG}: could not write the run's records: {e}", file=sys.stderr)
    done = sink.num_finished if sink is not None else 0
    kept = f" (in {sink.file.name})" if sink is not None and sink.file is not None else ""
    if isinstance(error, KeyboardInterrupt):
        signum = received_signal() or signal.SIGINT
        print(f"{PROG}: stopped by {signal.Signals(signum).name}: {done} of {num_prompts} "
              f"requests finished{kept}", file=sys.stderr)  # fmt: skip
        return 128 + signum
    print(f"{PROG}: error: {error}; {done} of {num_prompts} requests finished{kept}",
          file=sys.stderr)  # fmt: skip
    return 1


def conversation_of(system: str | None) -> Any:
    """``--chat``: a prompt's conversation (``--system`` first, when given)."""
    head = [{"role": "system", "content": system}] if system is not None else []
    return lambda text: [*head, {"role": "user", "content": text}]


def tokenized_prompt(
    llm: Any, index: int, text: str, chat: Any = None, params: SamplingParams | None = None
) -> dict[str, Any]:
    """Tokenize and check one prompt before any runs, naming it on error; ``chat``: the
    prompt is a user turn rendered by the chat template (``conversation_of``); ``params``:
    truncated as they ask (``truncate_prompt_tokens``), and checked with them.

    Why not let ``LLM.generate`` do it: it would, but its ``ValueError`` could not be told
    apart from one raised by the engine loop, which must not be reported as a usage error.
    """
    if chat is None:
        token_ids = llm.engine.tokenize(text)
    else:
        try:
            token_ids = llm.engine.inputs.render_chat(chat(text))[1]
        except ValueError as e:
            raise ValueError(f"prompt {index}: {e}") from None
    where = f"prompt {index}"
    inputs = llm.engine.inputs
    if params is not None:
        token_ids = inputs.truncated(token_ids, params)
    llm.engine.validate_prompt(token_ids, where)
    if params is not None:
        try:
            inputs.check_params(inputs.with_bad_words(params, where), where)
        except SamplingParamsError as e:
            raise _naming_the_flag(e) from None
    return {"prompt": text, "prompt_token_ids": token_ids}

"""What does structured output cost? Tokens/s with a JSON schema against the same requests
unconstrained (issue 53's target: at least 0.9x), and the last stage's mask time per
constrained token (``MicroBatchResult.grammar_mask_s``, the figure ``/metrics`` exports).

Both runs sample at temperature 1 with the same seeds and prompts, and produce exactly
``--max-tokens`` tokens per request: the unconstrained ones ignore EOS, and the schema (a
list of at least 64 strings) cannot close earlier. Runs alternate, ``--repeats`` times
each (a slow spell on a shared machine hits both); each figure is the median.

Run from the repository root: ``python benchmarks/structured_output.py [--quick]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/common.py

from common import machine_line, median  # noqa: E402
from results import Run, add_record_flag  # noqa: E402

from sarathi_pp import LLM, SamplingParams  # noqa: E402
from sarathi_pp.records.observer import Observer  # noqa: E402
from sarathi_pp.sampling_params import StructuredOutputsParams  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"type": "string"}, "minItems": 64}},
    "required": ["items"],
}
TARGET = 0.9  # issue 53: constrained tokens/s at least this fraction of unconstrained


class MaskTime(Observer):
    """The last stage's mask count and seconds, summed over completed micro-batches."""

    def __init__(self) -> None:
        self.num_masks = 0
        self.seconds = 0.0

    def completed(self, microbatch: Any, result: Any, now: float, wait=None, full=None) -> None:
        self.num_masks += result.num_grammar_masks
        self.seconds += result.grammar_mask_s


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="builtin:smollm2-135m")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--pipeline-parallel-size", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="4 requests, 24 tokens, 2 repeats")
    add_record_flag(p)
    args = p.parse_args(argv)
    if args.quick:
        args.num_requests, args.max_tokens, args.repeats = 4, 24, 2
    return args


def run_once(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> tuple[float, int]:
    """Seconds for the requests and the tokens they generated."""
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    for o in outs:
        assert o.error is None, o.error
    return seconds, sum(len(o.outputs[0].token_ids) for o in outs)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    run = Run("structured_output", argv, quick=args.quick, enabled=not args.no_record)
    n, m = args.num_requests, args.max_tokens
    prompts = [f"Request {i}: list things you like, as JSON." for i in range(n)]
    free = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=m, ignore_eos=True) for i in range(n)
    ]
    schema = StructuredOutputsParams(json=SCHEMA)
    constrained = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=m, structured_outputs=schema)
        for i in range(n)
    ]
    rates: dict[str, list[float]] = {"free": [], "json": []}
    masks = MaskTime()
    with LLM(args.model, pipeline_parallel_size=args.pipeline_parallel_size) as llm:
        print(machine_line(__import__("torch").get_num_threads()))
        llm.engine.add_observer(masks)
        run_once(llm, prompts[:2], constrained[:2])  # warm-up: the tokenizer, the grammar
        masks.num_masks, masks.seconds = 0, 0.0
        for _ in range(args.repeats):
            for name, params in (("free", free), ("json", constrained)):
                seconds, tokens = run_once(llm, prompts, params)
                assert tokens == n * m, (name, tokens)
                rates[name].append(tokens / seconds)
                print(f"{name}: {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.1f} tok/s")
    free_rate, json_rate = median(rates["free"]), median(rates["json"])
    mask_us = masks.seconds / masks.num_masks * 1e6 if masks.num_masks else None
    ratio = json_rate / free_rate
    print(f"JSON schema: {json_rate:.1f} tok/s vs {free_rate:.1f} unconstrained = {ratio:.3f}x")
    print(f"mask time: {mask_us:.1f} us per constrained token ({masks.num_masks} masks)")
    run.settings.update(
        model=args.model, num_requests=n, max_tokens=m, repeats=args.repeats,
        pipeline_parallel_size=args.pipeline_parallel_size, grammar_engine="llguidance",
    )  # fmt: skip
    spread = ", ".join(
        f"{name} {min(r):.1f}-{max(r):.1f} tok/s"
        for name, r in (("unconstrained", rates["free"]), ("JSON", rates["json"]))
    )
    run.measure(
        "tokens/s with a JSON schema", json_rate, "tok/s", baseline=free_rate,
        baseline_label="unconstrained", better="higher", headline="JSON schema vs unconstrained",
        detail=f"range over the repeats: {spread}",
    )  # fmt: skip
    run.measure("mask time per constrained token", mask_us, "us", better="lower")
    run.check(f"JSON schema at least {TARGET}x unconstrained tokens/s", ratio >= TARGET)
    run.note(
        "Same prompts and seeds, temperature 1, every request exactly max_tokens tokens; "
        "runs alternate, medians of the repeats. The masks are computed on a thread of the "
        "last stage while its layers run (on a CPU that thread shares the cores with "
        "torch's); mask time includes llguidance building its lexer states lazily."
    )
    written = run.write()
    if written:
        print(f"recorded in {written}")


if __name__ == "__main__":
    main()

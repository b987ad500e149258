"""What every subcommand of ``sarathi-pp`` shares: the engine flags, the config they build,
and how a user's mistake becomes ``sarathi-pp: error: ...`` with exit status 2.

Exit status: 0 on success; 1 when some request finished with an error (the others still
complete and are written); 2 for a usage error. A usage error is a mistake in what the user
gave: bad flags (argparse), a bad config value, a missing config file, model folder or
prompts file, an invalid prompt. It prints ``sarathi-pp: error: <message>`` to stderr with
no traceback. Anything else is a bug and propagates with its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

from sarathi_pp.config import DTYPES, FLAT_KEYS, EngineConfig
from sarathi_pp.config_file import load_config, parse_set_value

PROG = "sarathi-pp"

# Flag dest -> config key (a flat ``LLM(...)`` keyword, see ``config.FLAT_KEYS``).
OVERRIDE_FLAGS: dict[str, str] = {
    "model": "model",
    "scheduler": "scheduler",
    "chunk_size": "chunk_size",
    "pipeline_parallel_size": "pipeline_parallel_size",
    "tensor_parallel_size": "tensor_parallel_size",
    "data_parallel_size": "data_parallel_size",
    "seed": "seed",
    "dtype": "dtype",
    "max_model_len": "max_model_len",
    "gpu_memory_utilization": "gpu_memory_utilization",
    "max_num_seqs": "max_num_seqs",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "tokenizer": "tokenizer",
    "block_size": "block_size",
    "enable_prefix_caching": "enable_prefix_caching",
    "enforce_eager": "enforce_eager",
    "run_dir": "run_dir",
    "overwrite": "overwrite",
}


class UsageError(Exception):
    """A mistake in the user's input; ``main`` prints it and exits with status 2."""


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Turn the errors validation raises for bad input into ``UsageError``.

    Why a scope instead of catching in ``main``: only the setup phases (config, model,
    prompts) are wrapped, so a ``ValueError`` from a bug in the engine loop still
    propagates with its traceback.
    """
    try:
        yield
    except (ValueError, FileNotFoundError, TypeError) as e:
        raise UsageError(str(e)) from e


def add_engine_args(parser: argparse.ArgumentParser, run_dirs: str | None = None) -> None:
    """The config flags every model-running subcommand shares; ``run_dirs``: ``--run-dir``
    is required and holds one run dir per run (``bench``, ``simulate``), as that says."""
    g = parser.add_argument_group("engine config (later wins: defaults < --config < flags)")
    g.add_argument("--config", metavar="FILE", help="YAML config (default: built-in defaults)")
    g.add_argument(
        "--model", metavar="PATH", help="model folder, builtin:NAME or hub id org/name (model.path)"
    )
    g.add_argument("--scheduler", metavar="POLICY", help="scheduler.policy (sarathi, vllm, ...)")
    g.add_argument(
        "--chunk-size", type=chunk_size_arg, metavar="N|auto", help="scheduler.chunk_size"
    )
    g.add_argument(
        "-pp",
        "--pipeline-parallel-size",
        type=int,
        metavar="N",
        help="parallel.pipeline_parallel_size",
    )
    g.add_argument(
        "-dp",
        "--data-parallel-size",
        type=int,
        metavar="N",
        help="parallel.data_parallel_size: copies of the pipeline behind one router (Ray)",
    )
    g.add_argument(
        "-tp",
        "--tensor-parallel-size",
        type=int,
        metavar="1",
        help="parallel.tensor_parallel_size (only 1: no tensor parallelism yet)",
    )
    g.add_argument("--seed", type=int, metavar="N", help="model.seed: default for sampled requests")
    g.add_argument(
        "--dtype",
        type=dtype_arg,
        metavar="{" + ",".join((*DTYPES, *DTYPE_ALIASES)) + "}",
        help="model.dtype (vLLM's half = float16, float = float32)",
    )
    g.add_argument(
        "--max-model-len", type=int, metavar="N", help="model.max_model_len (prompt + output)"
    )
    g.add_argument("--tokenizer", metavar="DIR", help="model.tokenizer (default: the model's)")
    g.add_argument(
        "--gpu-memory-utilization", type=float, metavar="F", help="cache.gpu_memory_utilization"
    )
    g.add_argument("--block-size", type=int, metavar="N", help="cache.block_size")
    g.add_argument("--max-num-seqs", type=int, metavar="N", help="scheduler.max_num_seqs")
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        metavar="N",
        help="scheduler.max_num_batched_tokens: vllm/orca policies only (under sarathi and "
        "simple_chunking the budget is --chunk-size)",
    )
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="cache.enable_prefix_caching (on by default, as in vLLM)",
    )
    g.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="model.enforce_eager: no CUDA graphs (on by default here, unlike vLLM, until a "
        "GPU run has checked them; --no-enforce-eager captures them for decode micro-batches)",
    )
    if run_dirs is None:
        g.add_argument("--run-dir", metavar="DIR", help="run.run_dir: where the run's records go")
    else:
        g.add_argument("--run-dir", metavar="DIR", required=True, help=run_dirs)
    g.add_argument(
        "--overwrite",
        action="store_true",
        default=None,
        help="run.overwrite: allow writing into a non-empty run dir",
    )
    g.add_argument(
        "--set",
        dest="set_items",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="any config key, value parsed as YAML (repeatable; e.g. scheduler.chunk_size=512)",
    )


# vLLM's ``--dtype`` spellings that are other names of ours.
DTYPE_ALIASES = {"half": "float16", "float": "float32"}


def dtype_arg(text: str) -> str:
    """``--dtype``: one of ``DTYPES`` or vLLM's ``half``/``float`` (argparse ``type=``)."""
    text = DTYPE_ALIASES.get(text, text)
    if text not in DTYPES:
        valid = ", ".join((*DTYPES, *DTYPE_ALIASES))
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {valid})")
    return text


def chunk_size_arg(text: str) -> int | str:
    """``--chunk-size``: a token count or ``auto`` (argparse ``type=``)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {text!r}") from None


def parse_set_items(items: list[str]) -> dict[str, Any]:
    """``["scheduler.chunk_size=7", ...]`` -> ``{"scheduler.chunk_size": 7}`` (last wins)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set expects SECTION.KEY=VALUE, got {item!r}")
        out[key.strip()] = parse_set_value(value)
    return out


def _dotted(key: str) -> str:
    """The ``section.key`` name of a flat or dotted config key (unknown ones unchanged)."""
    if key in FLAT_KEYS:
        section, name = FLAT_KEYS[key]
        return f"{section}.{name}"
    return key


def config_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The dedicated flags and ``--set`` items as ``section.key`` overrides.

    A key given both by a flag and by ``--set`` with different values is an error: neither
    silently winning would surprise someone.
    """
    flags = {
        _dotted(key): getattr(args, dest)
        for dest, key in OVERRIDE_FLAGS.items()
        if getattr(args, dest, None) is not None
    }
    sets = {_dotted(k): v for k, v in parse_set_items(args.set_items).items()}
    for key in flags.keys() & sets.keys():
        if flags[key] != sets[key]:
            raise ValueError(
                f"{key} is given twice: {flags[key]!r} by its flag and {sets[key]!r} by --set"
            )
    return {**flags, **sets}


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The engine config: defaults < ``--config`` file < flags and ``--set``."""
    return load_config(args.config, **config_overrides(args))


_received: list[int] = []  # the last signal ``sigterm_as_interrupt`` or ``hold_signals`` caught


def sigterm_as_interrupt() -> None:
    """Treat SIGTERM like Ctrl-C (``KeyboardInterrupt`` where the engine allows one), so a
    run stopped by a job scheduler flushes its records and keeps its finished outputs."""

    def handler(signum: int, frame: Any) -> None:
        _received[:] = [signum]
        signal.raise_signal(signal.SIGINT)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)
        # Python leaves SIGINT ignored when it started ignored (a background job of a
        # script, a parent that ignores it): SIGTERM would then stop nothing.
        if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
            signal.signal(signal.SIGINT, signal.default_int_handler)


def hold_signals() -> None:
    """From here on SIGTERM and Ctrl-C are only recorded (``received_signal``), not raised: a
    run that is already stopping flushes its records and prints its last line whole. Without
    it, torchrun's agent, which terminates the other ranks when one rank fails, could cut the
    surviving rank's error line short with a ``KeyboardInterrupt`` mid-print."""

    def record(signum: int, frame: Any) -> None:
        _received[:] = [signum]

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, record)
        signal.signal(signal.SIGINT, record)


def received_signal() -> int | None:
    """The last signal ``sigterm_as_interrupt``'s or ``hold_signals``' handler caught (SIGTERM,
    or after ``hold_signals`` SIGINT too), else ``None``."""
    return _received[-1] if _received else None


def progress_bar(desc: str, total: int) -> Any:
    """A progress bar on stderr (``update``, ``close``), counting requests."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr)

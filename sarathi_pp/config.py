"""Typed configuration, one frozen dataclass per concern; YAML only at the edge.

The YAML is nested by section (``scheduler: {policy: sarathi, chunk_size: 256}``). The flat
keywords of ``LLM(...)`` map onto the sections through ``FLAT_KEYS`` (the documentation's
configuration reference is generated from these classes). Unknown keys are rejected with
the list of allowed ones; every value is checked in ``__post_init__`` and a bad one raises
``ValueError`` naming it. Nothing is written to a
config after construction: values derived from the checkpoint (``max_model_len``) or the
memory (the number of KV blocks) live in the engine's runtime state.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any

from sarathi_pp.fault_injection import parse_faults

GiB = 1 << 30
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
# The attention backends by name (``stages/model/attention.py``'s registry, plus "auto").
ATTENTION_BACKEND_NAMES = ("auto", "torch", "cpu_paged", "flex_paged", "flash_attn")
EXECUTORS = ("auto", "uniproc", "ray", "ray_compiled", "torchrun")
# Executors that pass sampled tokens from the last stage to stage 0 (``schedule_ahead``).
RING_EXECUTORS = ("uniproc", "ray")
# Executors that can run several replicas of the pipeline side by side (``data_parallel_size``).
REPLICA_EXECUTORS = ("ray", "ray_compiled")
# The scheduler policies (``scheduler/registry.py`` maps each to its class).
SCHEDULER_POLICIES = ("sarathi", "vllm", "orca", "simple_chunking")
# The policies that run whole prompts (``chunk_size`` unused); the others split prompts by it.
WHOLE_PROMPT_POLICIES = ("vllm", "orca")
BUILTIN_PREFIX = "builtin:"  # model.path of a model the project builds itself
# Builtin models with random weights, whose text means nothing (a notice says so).
RANDOM_WEIGHT_MODELS = frozenset({"builtin:tiny-llama"})
REAL_BUILTIN_MODEL = "builtin:smollm2-135m"


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_opt_int(name: str, value: Any, minimum: int) -> None:
    if value is not None:
        _check_int(name, value, minimum)


ACTIVATION_MEMORY = ("estimate", "profile")


@dataclass(frozen=True)
class ModelConfig:
    path: str = "builtin:tiny-llama"
    """A local Hugging Face model folder (config.json + safetensors), ``builtin:NAME`` for a
    model the project builds itself (``builtin:tiny-llama``, the embedded default with random
    weights; ``builtin:smollm2-135m``, a real one), or a Hugging Face hub id ``org/name``
    (the local hub cache first, then a download where the network allows)."""
    dtype: str = "auto"
    """``float32``, ``bfloat16``, ``float16``; ``auto`` = bfloat16 on CUDA, float32 on CPU."""
    max_model_len: int | None = None
    """Prompt + output tokens of one sequence; ``None`` = the checkpoint's limit."""
    tokenizer: str | None = None
    """Tokenizer folder; ``None`` = the model folder (token-id prompts need none)."""
    device: str = "auto"
    """``cpu``, ``cuda`` or ``auto`` (CUDA when available)."""
    seed: int | None = None
    """The engine-wide default seed: a sampled request without its own ``seed`` gets one
    derived from this and its order of arrival, so a rerun of the same requests samples the
    same tokens, however they are batched. ``None``: such requests draw fresh randomness."""
    attention_backend: str = "auto"
    """Which attention runs on every stage: ``torch`` (SDPA over K/V gathered from the paged
    cache; anywhere), ``cpu_paged`` (C kernels that read the paged cache in place; CPU,
    float32), ``flex_paged`` (FlexAttention over the paged cache in place, compiled, for
    prefill chunks and decodes; CUDA with KV blocks of a multiple of 16 tokens, or CPU),
    ``flash_attn`` (flash-attn's paged kernels; CUDA, float16/bfloat16, KV blocks of a
    multiple of 256 tokens) or ``auto``: on CPU ``cpu_paged`` for float32 where its kernel
    builds, else ``torch``; on CUDA ``flash_attn`` where installed and the dtype and block
    size suit it (never for float32), else ``flex_paged``, else ``torch``. A backend that
    cannot run where it was asked for falls back (to ``auto``'s choice, or per call to
    gather + SDPA), logs a warning once per reason, and the run dir records it
    (``summary.json``'s ``attention``: per stage, the backend and every fallback)."""
    strict_attention_backend: bool = False
    """Make every attention fallback an error: a backend that cannot run where it was asked
    for fails the start, and one that fails on a micro-batch fails its requests, instead of
    running another backend (a benchmark then measures what it names)."""
    enforce_eager: bool = True
    """Run every micro-batch eagerly, op by op (vLLM's name). ``false``: on CUDA, decode-only
    micro-batches replay CUDA graphs captured at start-up for batch-size buckets (1, 2, 4,
    8, then steps of 8 up to ``max_num_seqs``, padded to the bucket); other micro-batches,
    and decodes with no graph, run eagerly, each fallback logged and recorded. On by default
    here (unlike vLLM) until a GPU run has checked the graphs (``make gpu-check``); no
    effect on CPU. ``--no-enforce-eager`` on the command line."""

    def __post_init__(self) -> None:
        _check_opt_int("seed", self.seed, 0)
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"model must be a non-empty path, got {self.path!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        _check_opt_int("max_model_len", self.max_model_len, 1)
        if self.attention_backend not in ATTENTION_BACKEND_NAMES:
            raise ValueError(
                f"unknown attention_backend {self.attention_backend!r}; valid: "
                f"{', '.join(ATTENTION_BACKEND_NAMES)}"
            )
        if not isinstance(self.strict_attention_backend, bool):
            raise ValueError(
                "strict_attention_backend must be true or false, got "
                f"{self.strict_attention_backend!r}"
            )
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be true or false, got {self.enforce_eager!r}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int | None = None
    """Tokens per KV block; ``None`` = 16, or 256 on CUDA with flash-attn (its paged
    kernels want blocks of 256 tokens)."""
    kv_cache_memory: int | None = None
    """Bytes of KV cache per stage; ``None`` = sized from the memory budget (the
    configuration guide, "KV cache sizing")."""
    num_kv_blocks: int | None = None
    """Fixes the number of KV blocks instead (wins over ``kv_cache_memory``)."""
    cpu_memory_budget: int = 4 * GiB
    """On CPU, the memory M_G one stage may use for parameters + KV cache."""
    gpu_memory_utilization: float = 0.9
    """On CUDA, the fraction of device memory one stage may use (M_G), as in vLLM."""
    prefault: bool = False
    """On CPU, map every page of the KV cache at start-up instead of as blocks are first
    written: the memory is committed (a cache the machine cannot hold fails before any
    request) and no step pays a first touch (costly in VMs whose host backs memory on
    demand: Note [KV cache prefault]). Start-up takes longer by the cache's size over the
    page-fault rate. CUDA caches are always committed."""
    enable_prefix_caching: bool = True
    """Reuse the KV of full blocks whose tokens (and every token before them) another
    request computed already: blocks identified by a hash chained over the prefix, kept
    after their requests finish and evicted least-recently-used (vLLM's automatic prefix
    caching, on by default as there; ``--no-enable-prefix-caching`` turns it off)."""
    activation_memory: str = "estimate"
    """How a CUDA stage's peak activation memory ``M_A``, which its KV cache cannot use, is
    found: ``estimate`` (from the layer shapes and the largest micro-batch the policy can
    issue; what the simulator and ``sarathi-pp plan`` use too) or ``profile`` (vLLM's way:
    a profiling forward of that micro-batch on the stage, its peak memory measured, on the
    single-process executor). ``profile`` is unchecked on a GPU yet; it changes nothing on
    CPU, where ``M_A`` is 0 (``cpu_memory_budget`` sizes the parameters and the cache)."""

    def __post_init__(self) -> None:
        _check_opt_int("block_size", self.block_size, 1)
        _check_opt_int("kv_cache_memory", self.kv_cache_memory, 1)
        _check_opt_int("num_kv_blocks", self.num_kv_blocks, 1)
        _check_int("cpu_memory_budget", self.cpu_memory_budget, 1)
        if not 0.0 < float(self.gpu_memory_utilization) <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )
        if not isinstance(self.prefault, bool):
            raise ValueError(f"prefault must be true or false, got {self.prefault!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(
                f"enable_prefix_caching must be true or false, got {self.enable_prefix_caching!r}"
            )
        if self.activation_memory not in ACTIVATION_MEMORY:
            raise ValueError(
                f"activation_memory must be one of {ACTIVATION_MEMORY}, got "
                f"{self.activation_memory!r}"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    policy: str = "sarathi"
    """``sarathi``, ``vllm``, ``orca`` or ``simple_chunking`` (the design page "Schedulers")."""
    chunk_size: int | str = 256
    """Token budget of one micro-batch: prefill + decode rows (sarathi, simple_chunking);
    ``auto`` = planned from the memory bound and adjusted online from the P:D ratio of
    the finished requests (``sarathi-pp plan`` shows the arithmetic)."""
    min_chunk_size: int = 128
    """Planner and ``chunk_size: auto``: the smallest prefill chunk C (a smaller one starves
    the matmuls; ``sarathi-pp profile`` measures where that is on the machine at hand)."""
    max_chunk_size: int = 2048
    """Planner and ``chunk_size: auto``: the largest prefill chunk C."""
    auto_chunk_window: int = 32
    """``chunk_size: auto``: finished requests in the sliding window the P:D ratio is
    observed over."""
    tile_align: bool = True
    """Trim the prefill chunk so the micro-batch's rows are a multiple of ``tile_size``."""
    tile_size: int = 128
    """Matmul tile in rows."""
    max_num_seqs: int = 256
    """Most sequences running (holding KV blocks) at once."""
    max_num_batched_tokens: int | None = None
    """Token cap of one prefill micro-batch for vllm/orca; ``None`` = ``max_model_len``.
    Refused under the chunking policies, whose budget is ``chunk_size``."""
    max_waiting: int | None = None
    """Most requests waiting to be admitted; a request past it is refused with
    ``QueueFullError`` (an HTTP server answers 429). ``None`` = unbounded."""
    balance_microbatches: bool = True
    """Decodes shared evenly across the micro-batches in flight, every policy: a
    micro-batch takes ``min(ceil(R / M), ceil(r / f))`` decodes, R the running sequences
    past their prompt, M the in-flight limit in force, r the decodes ready now and f the
    micro-batches that may still be issued (M less those in flight, at least one), so the
    decode counts of the micro-batches in flight differ by at most one. ``false``: the rule
    before it, ``ceil(R / M)`` with the prompts in prefill counted in R (5 decodes over 4
    micro-batches went 2, 2, 1 and none), for measuring against."""
    prefill_pacing: bool = False
    """``sarathi``: a micro-batch's prefill tokens paced by the prefill work pending (as
    gLLM's token throttling), ``max(tile_size, ceil(W / M))`` at most (never above the
    budget), W the prompt tokens left to issue of the admitted prompts plus those of the
    arrived waiting ones that the free KV blocks hold, M the in-flight limit in force;
    only while at least M sequences decode. The last prompts' chunks then spread over the
    micro-batches in flight instead of filling the first and leaving the others
    decode-only, and prefill work reaches into what would be the decode-only tail. Off by
    default: it delays a prompt's last chunks, so the time to the first token rises (the
    design page "Schedulers" says where it pays)."""

    @property
    def chunks_prompts(self) -> bool:
        """Whether ``policy`` splits prompts by the ``chunk_size`` budget (vllm/orca: no)."""
        return self.policy not in WHOLE_PROMPT_POLICIES

    def __post_init__(self) -> None:
        if self.policy not in SCHEDULER_POLICIES:
            raise ValueError(
                f"unknown scheduler {self.policy!r}; valid: {', '.join(SCHEDULER_POLICIES)}"
            )
        if self.chunk_size != "auto":
            try:
                _check_int("chunk_size", self.chunk_size, 1)
            except ValueError:
                raise ValueError(
                    f"chunk_size must be an integer >= 1 or 'auto', got {self.chunk_size!r}"
                ) from None
        _check_int("min_chunk_size", self.min_chunk_size, 1)
        _check_int("max_chunk_size", self.max_chunk_size, 1)
        if self.min_chunk_size > self.max_chunk_size:
            raise ValueError(
                f"min_chunk_size={self.min_chunk_size} exceeds max_chunk_size={self.max_chunk_size}"
            )
        _check_int("auto_chunk_window", self.auto_chunk_window, 1)
        _check_int("tile_size", self.tile_size, 1)
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_opt_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        if self.max_num_batched_tokens is not None and self.chunks_prompts:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} caps whole-prompt "
                f"micro-batches (policies {', '.join(WHOLE_PROMPT_POLICIES)}); under "
                f"{self.policy!r} a micro-batch's token budget is chunk_size: set "
                f"chunk_size={self.max_num_batched_tokens} (--chunk-size) instead"
            )
        _check_opt_int("max_waiting", self.max_waiting, 1)
        if not isinstance(self.tile_align, bool):
            raise ValueError(f"tile_align must be true or false, got {self.tile_align!r}")
        if not isinstance(self.balance_microbatches, bool):
            raise ValueError(
                f"balance_microbatches must be true or false, got {self.balance_microbatches!r}"
            )
        if not isinstance(self.prefill_pacing, bool):
            raise ValueError(f"prefill_pacing must be true or false, got {self.prefill_pacing!r}")


@dataclass(frozen=True)
class ParallelConfig:
    pipeline_parallel_size: int = 1
    """Number of pipeline stages."""
    data_parallel_size: int = 1
    """Copies of the pipeline (vLLM's name), each its own executor, stage actors and KV
    cache, behind one router (``sarathi_pp/routing.py``: least pending tokens, with prefix
    affinity when ``cache.enable_prefix_caching`` is on). More than 1 needs Ray (``ray`` or
    ``ray_compiled``; ``auto`` picks ``ray``): each replica's stages are placed by a
    placement group of their own, packed on one node where they fit. With a run dir each
    replica records into ``<run_dir>/replica-<i>/`` and the run dir gets the total."""
    tensor_parallel_size: int = 1
    """Accepted as in vLLM; only 1 (no tensor parallelism: split a model over pipeline
    stages instead)."""
    num_microbatches_in_flight: int | str | None = "auto"
    """Micro-batches outstanding at once. ``auto`` (TBT first; ``ParallelConfig.in_flight_limit``
    states the rule): the stages, P, so a decode waits behind the fewest micro-batches;
    where the placement turns scheduling ahead on, the micro-batch ahead comes on top and
    hides the loop back through the driver (tokens back, scheduling, dispatch) without a
    decode group more. Throughput first: a number, ``P + 1``: the micro-batch above P hides
    the loop back where nothing is scheduled ahead, but every decode then waits behind one
    micro-batch more, so the time between tokens grows by about one micro-batch (the design
    page "The control plane", "What to choose", has the measurements). ``null`` = P."""
    num_decode_microbatches_in_flight: int | None = None
    """The limit while every micro-batch is decode-only (no prompt has tokens left to issue
    and no arrived request waits); ``None`` = ``pipeline_parallel_size``, never more than
    ``num_microbatches_in_flight``. A decode-only micro-batch reads all of a stage's weights
    whatever its size, so spreading a step's decodes over more micro-batches than stages
    adds weight reads without keeping a stage busier; set it to
    ``num_microbatches_in_flight`` to keep every micro-batch in flight (where decodes are
    compute-bound and the loop back to the driver is long against a decode)."""
    executor: str = "auto"
    """``uniproc`` (one process), ``ray`` (one actor per stage, a Ray task per stage per
    micro-batch, hidden states over torch.distributed), ``ray_compiled`` (the same actors
    driven by one Ray Compiled Graph: hidden states over its channels) or ``torchrun`` (set
    by the torchrun launcher); ``auto`` = ``uniproc`` for one stage and one replica, else
    ``ray``."""
    num_threads_per_stage: int | None = None
    """CPU threads of each stage process; ``None`` = max(1, usable cores // stages)."""
    stage_timeout_s: float = 300.0
    """How long to wait for a stage (a micro-batch's result or its input) before failing
    with an error that names the stage."""
    max_stage_restarts: int = 1
    """Ray: how many times a lost stage actor is replaced (new actors, weights reloaded,
    running requests recomputed) before the engine gives up with ``StageError``."""
    inject_fault: str | None = None
    """Testing only: faults the stages inject (``sarathi_pp/fault_injection.py`` has the format)."""
    schedule_ahead: bool | str = "auto"
    """Build and hand over the next micro-batch while the last stage is still sampling the
    oldest one's tokens: its decodes of those tokens get their input token from the last
    stage's result on the way to stage 0 (the token ring), not through the driver, so the
    driver's work (applying tokens, scheduling, dispatch) leaves the critical path. One
    micro-batch more is in flight, waiting at stage 0 for the ring. ``auto``: on for the
    ``ray`` executor with 2+ stages when the driver has a core of its own (the placement
    decides: ``placement.resolve_schedule_ahead``); ``ray_compiled`` and ``torchrun`` have no
    ring."""

    def __post_init__(self) -> None:
        _check_int("pipeline_parallel_size", self.pipeline_parallel_size, 1)
        _check_int("data_parallel_size", self.data_parallel_size, 1)
        if self.tensor_parallel_size != 1 or isinstance(self.tensor_parallel_size, bool):
            raise ValueError(
                f"tensor_parallel_size={self.tensor_parallel_size!r}: tensor parallelism is not "
                f"supported, only 1; split the model over stages with pipeline_parallel_size"
            )
        if self.num_microbatches_in_flight != "auto":
            try:
                _check_opt_int("num_microbatches_in_flight", self.num_microbatches_in_flight, 1)
            except ValueError:
                raise ValueError(
                    f"num_microbatches_in_flight must be an integer >= 1, 'auto' or null, "
                    f"got {self.num_microbatches_in_flight!r}"
                ) from None
        _check_opt_int(
            "num_decode_microbatches_in_flight", self.num_decode_microbatches_in_flight, 1
        )
        if (self.num_decode_microbatches_in_flight or 0) > self.microbatches_in_flight:
            raise ValueError(
                f"num_decode_microbatches_in_flight={self.num_decode_microbatches_in_flight} "
                f"exceeds num_microbatches_in_flight={self.microbatches_in_flight}: it is the "
                f"limit while only decodes run, at most the limit itself"
            )
        _check_opt_int("num_threads_per_stage", self.num_threads_per_stage, 1)
        _check_int("max_stage_restarts", self.max_stage_restarts, 0)
        if self.inject_fault is not None:
            parse_faults(self.inject_fault)
        if self.executor not in EXECUTORS:
            raise ValueError(f"executor must be one of {EXECUTORS}, got {self.executor!r}")
        if self.data_parallel_size > 1 and self.executor_name not in REPLICA_EXECUTORS:
            raise ValueError(
                f"data_parallel_size={self.data_parallel_size} needs a Ray executor "
                f"({', '.join(REPLICA_EXECUTORS)}), not executor={self.executor!r}: each "
                f"replica is its own set of stage actors"
                + (
                    " (torchrun runs one pipeline per launch)"
                    if self.executor == "torchrun"
                    else ""
                )
            )
        if not (isinstance(self.schedule_ahead, bool) or self.schedule_ahead == "auto"):
            raise ValueError(
                f"schedule_ahead must be true, false or auto, got {self.schedule_ahead!r}"
            )
        if self.schedule_ahead is True and self.executor_name not in RING_EXECUTORS:
            raise ValueError(
                f"schedule_ahead=true needs an executor with a token ring "
                f"({', '.join(RING_EXECUTORS)}), not {self.executor_name!r}"
            )
        if (
            self.schedule_ahead is True
            and self.microbatches_in_flight < self.pipeline_parallel_size
        ):
            raise ValueError(
                f"schedule_ahead=true needs num_microbatches_in_flight >= "
                f"pipeline_parallel_size ({self.pipeline_parallel_size}), got "
                f"{self.microbatches_in_flight}: a decode is scheduled ahead of a token the "
                f"last stage samples as stage 0 reaches it, {self.pipeline_parallel_size} "
                f"micro-batches later"
            )
        if (
            isinstance(self.stage_timeout_s, bool)
            or not isinstance(self.stage_timeout_s, (int, float))
            or self.stage_timeout_s <= 0
        ):
            raise ValueError(f"stage_timeout_s must be a number > 0, got {self.stage_timeout_s!r}")

    @property
    def executor_name(self) -> str:
        if self.executor != "auto":
            return self.executor
        if self.pipeline_parallel_size == 1 and self.data_parallel_size == 1:
            return "uniproc"
        return "ray"

    @property
    def microbatches_in_flight(self) -> int:
        """``num_microbatches_in_flight`` resolved without the placement (``auto``: the
        stages), the micro-batch ahead not counted: the bound the stages' pending sends, the
        compiled graph and the planner size by."""
        m = self.num_microbatches_in_flight
        if m == "auto":
            return self.pipeline_parallel_size
        assert m is None or isinstance(m, int), m
        return m or self.pipeline_parallel_size

    def in_flight_limit(self, schedule_ahead: bool) -> int:
        """The engine's in-flight limit, the micro-batch ahead not counted, once the
        placement has decided ``schedule_ahead``. ``auto``: P for P stages, ahead or not. A
        micro-batch more than P (P + 1, set as a number) hides the loop back through the
        driver behind the next one's compute where nothing is scheduled ahead, but adds a
        group of decodes: each waits behind one micro-batch more, so TBT grows by about a
        micro-batch's compute time while throughput gains only the loop back's share of a
        step. Measured on the benchmarks' workloads, that trade lost (TBT p99 rose far more
        than the bubble fell, and tokens/s stayed within noise: the design page "The control
        plane"), so ``auto`` keeps the stages and leaves the loop back to the
        micro-batch ahead where the placement turns it on."""
        del schedule_ahead  # auto's choice is the same either way (see above)
        return self.microbatches_in_flight

    @property
    def decode_microbatches_in_flight(self) -> int:
        """``num_decode_microbatches_in_flight`` resolved: at most ``microbatches_in_flight``."""
        n = self.num_decode_microbatches_in_flight or self.pipeline_parallel_size
        return min(n, self.microbatches_in_flight)


@dataclass(frozen=True)
class RunConfig:
    run_dir: str | None = None
    """Where to write the run's records (config.yaml, requests.csv, ...); ``None`` = nowhere."""
    overwrite: bool = False
    """Allow writing into an existing non-empty run dir: what an earlier run wrote there is
    removed first (the files the bubble-report guide lists), nothing else."""
    compact_events: bool | str = "auto"
    """``events.jsonl``'s form for completed micro-batches: ``false`` one ``done`` record and
    one ``stage`` record per stage; ``true`` one ``microbatch`` record each (the same
    fields); ``auto`` the first form for the first 2,000 micro-batches, then the compact
    one (``sarathi_pp/records/events.py``)."""

    def __post_init__(self) -> None:
        if self.run_dir is not None and (not isinstance(self.run_dir, str) or not self.run_dir):
            raise ValueError(f"run_dir must be a non-empty path or null, got {self.run_dir!r}")
        if not isinstance(self.overwrite, bool):
            raise ValueError(f"overwrite must be true or false, got {self.overwrite!r}")
        if not (isinstance(self.compact_events, bool) or self.compact_events == "auto"):
            raise ValueError(
                f"compact_events must be true, false or auto, got {self.compact_events!r}"
            )


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def replace(self, **flat_or_dotted: Any) -> EngineConfig:
        """A new config with keyword overrides (flat ``LLM`` names or ``section.key``)."""
        return _apply(self.to_dict(), flat_or_dotted)


# type: ignore: dataclasses.Field.type is typed `type | str | Any`, wider than this map says.
SECTIONS: dict[str, type] = {f.name: f.type for f in fields(EngineConfig)}  # type: ignore[misc]
_SECTION_CLASSES = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "parallel": ParallelConfig,
    "run": RunConfig,
}

# Flat LLM(...) keyword -> (section, field). vLLM's names where vLLM has the concept.
FLAT_KEYS: dict[str, tuple[str, str]] = {
    "model": ("model", "path"),
    "dtype": ("model", "dtype"),
    "max_model_len": ("model", "max_model_len"),
    "tokenizer": ("model", "tokenizer"),
    "device": ("model", "device"),
    "seed": ("model", "seed"),
    "block_size": ("cache", "block_size"),
    "kv_cache_memory": ("cache", "kv_cache_memory"),
    "num_kv_blocks": ("cache", "num_kv_blocks"),
    "cpu_memory_budget": ("cache", "cpu_memory_budget"),
    "gpu_memory_utilization": ("cache", "gpu_memory_utilization"),
    "prefault_kv_cache": ("cache", "prefault"),
    "enable_prefix_caching": ("cache", "enable_prefix_caching"),
    "activation_memory": ("cache", "activation_memory"),
    "enforce_eager": ("model", "enforce_eager"),
    "scheduler": ("scheduler", "policy"),
    "chunk_size": ("scheduler", "chunk_size"),
    "min_chunk_size": ("scheduler", "min_chunk_size"),
    "max_chunk_size": ("scheduler", "max_chunk_size"),
    "auto_chunk_window": ("scheduler", "auto_chunk_window"),
    "tile_align": ("scheduler", "tile_align"),
    "tile_size": ("scheduler", "tile_size"),
    "max_num_seqs": ("scheduler", "max_num_seqs"),
    "max_num_batched_tokens": ("scheduler", "max_num_batched_tokens"),
    "max_waiting": ("scheduler", "max_waiting"),
    "balance_microbatches": ("scheduler", "balance_microbatches"),
    "prefill_pacing": ("scheduler", "prefill_pacing"),
    "pipeline_parallel_size": ("parallel", "pipeline_parallel_size"),
    "data_parallel_size": ("parallel", "data_parallel_size"),
    "tensor_parallel_size": ("parallel", "tensor_parallel_size"),
    "num_microbatches_in_flight": ("parallel", "num_microbatches_in_flight"),
    "num_decode_microbatches_in_flight": ("parallel", "num_decode_microbatches_in_flight"),
    "executor": ("parallel", "executor"),
    "num_threads_per_stage": ("parallel", "num_threads_per_stage"),
    "stage_timeout_s": ("parallel", "stage_timeout_s"),
    "max_stage_restarts": ("parallel", "max_stage_restarts"),
    "run_dir": ("run", "run_dir"),
    "overwrite": ("run", "overwrite"),
    "compact_events": ("run", "compact_events"),
    "schedule_ahead": ("parallel", "schedule_ahead"),
}


def _allowed(section: str) -> list[str]:
    return [f.name for f in fields(_SECTION_CLASSES[section])]


def _build(tree: dict[str, Any]) -> EngineConfig:
    if not isinstance(tree, dict):
        raise ValueError(f"config must be a mapping of sections, got {type(tree).__name__}")
    sections = {}
    for name, body in tree.items():
        if name not in _SECTION_CLASSES:
            raise ValueError(
                f"unknown config section {name!r}; allowed: {', '.join(_SECTION_CLASSES)}"
            )
        body = body or {}
        if not isinstance(body, dict):
            raise ValueError(f"config section {name!r} must be a mapping, got {body!r}")
        for key in body:
            if key not in _allowed(name):
                raise ValueError(
                    f"unknown config key {name}.{key}; allowed in {name!r}: "
                    f"{', '.join(_allowed(name))}"
                )
        sections[name] = _SECTION_CLASSES[name](**body)
    return EngineConfig(**sections)


def _apply(tree: dict[str, dict[str, Any]], overrides: dict[str, Any]) -> EngineConfig:
    tree = {k: dict(v or {}) for k, v in tree.items()}  # an empty YAML section is None
    seen: dict[tuple[str, str], str] = {}  # (section, field) -> the keyword that set it
    for key, value in overrides.items():
        if "." in key:
            section, _, name = key.partition(".")
            if section not in _SECTION_CLASSES or name not in _allowed(section):
                raise ValueError(
                    f"unknown config key {key!r}; allowed: "
                    + ", ".join(f"{s}.{k}" for s in _SECTION_CLASSES for k in _allowed(s))
                )
        elif key in FLAT_KEYS:
            section, name = FLAT_KEYS[key]
        else:
            raise ValueError(
                f"unknown keyword {key!r}; allowed: {', '.join(FLAT_KEYS)} or 'section.key'"
            )
        if (section, name) in seen:
            raise ValueError(
                f"{key!r} and {seen[section, name]!r} set the same key {section}.{name}"
            )
        seen[section, name] = key
        tree.setdefault(section, {})[name] = value
    return _build(tree)


def make_config(**overrides: Any) -> EngineConfig:
    """``EngineConfig`` from flat ``LLM(...)`` keywords (or ``section.key`` names)."""
    return _apply({}, overrides)

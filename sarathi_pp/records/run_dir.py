"""The run dir: every file name of a run's records, in one place.

A run dir (``RunDir``), written by the engine's recorder and read by ``sarathi-pp report``::

    config.yaml     the config in force, resolved (dtype, block size, max_model_len)
    events.jsonl    the event log (``sarathi_pp/records/events.py`` has the schema)
    requests.csv    one row per request (``REQUEST_COLUMNS``)
    summary.json    the report: bubbles per stage and class, request metrics
    trace.json      Chrome trace format (Perfetto)
    timeline.png    the bubble timeline
    profile.csv     ``sarathi-pp profile --run-dir``: the stage's timings

A benchmark dir (``BenchDir``) of ``sarathi-pp bench``::

    <scheduler>/                      a run dir per scheduler
    <scheduler>/capacity.json         capacity mode: the search and its probes
    <scheduler>/probes/rate-<r>/      capacity mode: one run dir per probe
    peer-<name>/                      the peer's requests.csv and summary.json
    comparison.json, tbt_cdf.png, ttft_cdf.png

A folder that is not empty is refused unless ``overwrite``; with it, exactly the files and
folders above are removed before the new run writes (``clear``), and nothing else: a file
of the user's own in the folder stays. Nothing is created or removed before the run's
inputs have been checked (``check`` only looks; ``create`` writes).
"""

from __future__ import annotations

import csv
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from sarathi_pp.config import SCHEDULER_POLICIES, EngineConfig
from sarathi_pp.outputs import RequestOutput, tpot

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11

CONFIG_FILE = "config.yaml"
EVENTS_FILE = "events.jsonl"
REQUESTS_FILE = "requests.csv"
SUMMARY_FILE = "summary.json"
TRACE_FILE = "trace.json"
TIMELINE_FILE = "timeline.png"
PROFILE_FILE = "profile.csv"
COMPARISON_FILE = "comparison.json"
CAPACITY_FILE = "capacity.json"
PROBES_DIR = "probes"
TBT_CDF_FILE = "tbt_cdf.png"
TTFT_CDF_FILE = "ttft_cdf.png"
# a peer run in a subprocess (the vLLM peer): its workload, its protocol lines, its output
PEER_IN_FILE = "peer-in.json"
PEER_LINES_FILE = "peer.jsonl"
PEER_LOG_FILE = "peer.log"

# times in seconds; *_s instants are relative to the run's first arrival; token_times:
# every generated token's time after arrival, space-separated
REQUEST_COLUMNS = (
    "request_id", "num_prompt_tokens", "num_output_tokens", "finish_reason", "error",
    "arrival_s", "first_scheduled_s", "first_token_s", "finished_s",
    "ttft_s", "scheduling_delay_s", "e2e_s", "tbt_mean_s", "tbt_max_s", "tpot_s",
    "num_preemptions", "num_cached_tokens", "token_times",
)  # fmt: skip


RUN_FILES = (
    CONFIG_FILE, EVENTS_FILE, REQUESTS_FILE, SUMMARY_FILE, TRACE_FILE, TIMELINE_FILE,
    PROFILE_FILE, CAPACITY_FILE, PEER_IN_FILE, PEER_LINES_FILE, PEER_LOG_FILE,
)  # fmt: skip
BENCH_FILES = (COMPARISON_FILE, TBT_CDF_FILE, TTFT_CDF_FILE)
PEER_PREFIX = "peer-"


def check_dir(path: str | Path, overwrite: bool) -> Path:
    """``path`` as a folder a run may write: missing, empty, or (``overwrite``) used;
    ``ValueError`` otherwise. Looks only."""
    d = Path(path)
    if d.exists() and not d.is_dir():
        raise ValueError(f"run dir {str(d)!r} exists and is not a directory")
    if d.is_dir() and any(d.iterdir()) and not overwrite:
        raise ValueError(
            f"run dir {str(d)!r} is not empty; pass overwrite=True (--overwrite) to reuse it"
        )
    return d


def _unlink(path: Path) -> None:
    if path.is_file() or path.is_symlink():
        path.unlink()


def _rmdir_if_empty(path: Path) -> None:
    if path.is_dir() and not path.is_symlink() and not any(path.iterdir()):
        path.rmdir()


@dataclass(frozen=True)
class _Dir(ABC):
    path: Path

    @classmethod
    def check(cls, path: str | Path, overwrite: bool = False) -> Self:
        """A dir a run may write (see ``check_dir``); nothing is created yet."""
        return cls(check_dir(path, overwrite))

    @classmethod
    def prepare(cls, path: str | Path, overwrite: bool = False) -> Self:
        """``check``, then ``create``: for callers whose inputs are checked already."""
        d = cls.check(path, overwrite)
        d.create(overwrite)
        return d

    def create(self, overwrite: bool = False) -> None:
        """Create the folder; with ``overwrite`` remove what an earlier run wrote there."""
        check_dir(self.path, overwrite)  # the folder may have changed since ``check``
        self.path.mkdir(parents=True, exist_ok=True)
        if overwrite:
            self.clear()

    @abstractmethod
    def clear(self) -> None:
        """Remove what the project writes in this kind of folder, and nothing else."""


@dataclass(frozen=True)
class RunDir(_Dir):
    config = property(lambda self: self.path / CONFIG_FILE)
    events = property(lambda self: self.path / EVENTS_FILE)
    requests = property(lambda self: self.path / REQUESTS_FILE)
    summary = property(lambda self: self.path / SUMMARY_FILE)
    trace = property(lambda self: self.path / TRACE_FILE)
    timeline = property(lambda self: self.path / TIMELINE_FILE)
    profile = property(lambda self: self.path / PROFILE_FILE)
    capacity = property(lambda self: self.path / CAPACITY_FILE)

    def probe(self, rate: float) -> Path:
        """Capacity mode: the run dir of the probe at ``rate`` requests/s."""
        return self.path / PROBES_DIR / f"rate-{rate:.4g}"

    def clear(self) -> None:
        """Remove the files a run writes here, and the probes' run dirs (``RUN_FILES``,
        ``probes/rate-*``); folders left empty go too. Nothing else."""
        for name in RUN_FILES:
            _unlink(self.path / name)
        probes = self.path / PROBES_DIR
        if probes.is_dir() and not probes.is_symlink():
            for d in probes.glob("rate-*"):
                if d.is_dir() and not d.is_symlink():
                    RunDir(d).clear()
                    _rmdir_if_empty(d)
            _rmdir_if_empty(probes)

    def write_config(self, config: EngineConfig) -> None:
        self.config.write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))

    def write_requests(self, outputs: list[RequestOutput]) -> None:
        t0 = min((o.metrics.arrival_time for o in outputs), default=0.0)
        with open(self.requests, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=REQUEST_COLUMNS)
            w.writeheader()
            for out in outputs:
                w.writerow(request_row(out, t0))


@dataclass(frozen=True)
class BenchDir(_Dir):
    comparison = property(lambda self: self.path / COMPARISON_FILE)
    tbt_cdf = property(lambda self: self.path / TBT_CDF_FILE)
    ttft_cdf = property(lambda self: self.path / TTFT_CDF_FILE)

    def run(self, name: str) -> RunDir:
        """A scheduler's run dir, or a peer's (``peer_name``)."""
        return RunDir(self.path / name)

    @staticmethod
    def peer_name(peer: str) -> str:
        return f"{PEER_PREFIX}{peer}"

    def clear(self) -> None:
        """Remove ``BENCH_FILES`` and the run dirs of every scheduler and peer (each by
        ``RunDir.clear``; folders left empty go too). Nothing else."""
        for name in BENCH_FILES:
            _unlink(self.path / name)
        runs = [self.path / p for p in SCHEDULER_POLICIES]
        runs += sorted(self.path.glob(f"{PEER_PREFIX}*"))
        for d in runs:
            if d.is_dir() and not d.is_symlink():
                RunDir(d).clear()
                _rmdir_if_empty(d)


def request_row(out: RequestOutput, t0: float) -> dict:
    """One ``requests.csv`` row, ready for ``csv.DictWriter`` (unknown values empty);
    instants relative to ``t0`` (the first arrival)."""
    m = out.metrics
    rel = lambda t: None if t is None else t - t0  # noqa: E731
    tbt = m.tbt
    n_out = len(out.outputs[0].token_ids)
    row = {
        "request_id": out.request_id,
        "num_prompt_tokens": len(out.prompt_token_ids),
        "num_output_tokens": n_out,
        "finish_reason": out.outputs[0].finish_reason,
        "error": out.error or "",
        "arrival_s": rel(m.arrival_time),
        "first_scheduled_s": rel(m.first_scheduled_time),
        "first_token_s": rel(m.first_token_time),
        "finished_s": rel(m.finished_time),
        "ttft_s": m.ttft,
        "scheduling_delay_s": m.scheduling_delay,
        "e2e_s": m.e2e_latency,
        "tbt_mean_s": sum(tbt) / len(tbt) if tbt else None,
        "tbt_max_s": max(tbt) if tbt else None,
        "tpot_s": tpot(m.e2e_latency, m.ttft, n_out),
        "num_preemptions": m.num_preemptions,
        "num_cached_tokens": m.num_cached_tokens,
        "token_times": " ".join(f"{t - m.arrival_time:.6f}" for t in m.token_times),
    }
    return {k: ("" if v is None else v) for k, v in row.items()}

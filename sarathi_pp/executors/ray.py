"""Pipeline parallelism on Ray: one actor per stage, placed by a placement group.

Control plane: the driver (the engine, with the scheduler) calls ``run(microbatch)`` on every
stage actor for every micro-batch (as ``run_packed``: Note [packed micro-batches]); Ray runs
an actor's calls in submission order, so all stages see the micro-batches in issue order.
Data plane: the actors pass hidden states between themselves over ``torch.distributed``
send/recv (gloo on CPU, NCCL on CUDA) in a process group this module sets up (master = stage
0's node IP, or 127.0.0.1 when every stage is on one node, at a port stage 0 holds open until
the group is formed). Only the last stage's sampled tokens come back to the driver.

Token ring (``parallel.schedule_ahead``): a micro-batch scheduled ahead names decodes whose
input tokens the last stage is still sampling; stage 0 takes them from the last stage over
a gloo group of their own (``comm/ring.py``) while the driver applies the same tokens. A
micro-batch resubmitted after an isolation gets them from the driver instead.

Note [packed micro-batches]: the driver pickles a micro-batch once and hands the same bytes to
every stage's ``run_packed``, which answers with its result pickled. Ray serializes an argument
per call, and its own path for a dataclass (msgpack, pickle5, a look for object refs inside)
costs more than the bytes: for a hybrid micro-batch of a few KB a ``.remote()`` with the
dataclass took about twice as long as one with the same bytes plus pickling them once, and a
round trip with its result was slower too. With P stages the driver's submission is one pickle
plus P cheap calls, not P serializations. Pickle rather than torchrun's plain-data codec
(``comm/codec.py``): Ray pickles every argument anyway, and the codec's per-field checks cost
more than pickling the same micro-batch.

(Passing the last stage's result refs to stage 0's task as arguments, so that Ray's core
worker forwards them, was tried first: two Ray hops from the last stage to stage 0, only a
little faster than going through the driver's Python. The figures: the lab notebook's
"Figures moved out of the code", Note [packed micro-batches].)
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pickle
import time
from collections import deque
from collections.abc import Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any

from sarathi_pp.checkpoint import Checkpoint
from sarathi_pp.comm.p2p import StageCommError
from sarathi_pp.config import EngineConfig
from sarathi_pp.executors.base import StageError, StageLost
from sarathi_pp.executors.interrupts import deferred_interrupts
from sarathi_pp.fault_injection import after_restart
from sarathi_pp.microbatch import (
    MicroBatch,
    MicroBatchResult,
    fill_ring,
    retry_one_at_a_time,
    without_failed,
)
from sarathi_pp.placement import (
    Placement,
    Resources,
    format_partition,
    partition_layers,
    resolve_placement,
    resolve_schedule_ahead,
)
from sarathi_pp.planner.memory import with_activations
from sarathi_pp.stage_memory import StageMemory
from sarathi_pp.stages.worker.device import probe_resources
from sarathi_pp.stages.worker.memory_probe import PROFILE_NEEDS_UNIPROC
from sarathi_pp.stages.worker.model_runner import StageSpec

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup

    from sarathi_pp.microbatch import StageEvent

logger = logging.getLogger(__name__)

SETUP_TIMEOUT_S = 120.0

# Note [a dead peer seen first]: when a stage's process dies outright (SIGKILL, the OOM
# killer) the stage it sends to or receives from is waiting on their connection and fails
# at once ("connection closed by peer"), a plain task error, while Ray's word that the
# process is gone travels through the GCS and often arrives later. Taken as it came, the
# failure read as a StageError and the engine died where it should have replaced the lost
# stage. So a stage's communication error first looks, for up to LOST_PEER_GRACE_S, for a
# stage that died: the micro-batch's other results, then every actor asked once.
LOST_PEER_GRACE_S = 10.0
ABANDONED_WAIT_S = 2.0


def _ray() -> ModuleType:
    try:
        import ray
    except ImportError as e:  # pragma: no cover - ray is a declared dependency
        raise ImportError(
            "pipeline parallelism on Ray needs ray: pip install 'ray[default]'"
        ) from e
    return ray


# Note [a Ray of its own]: a Ray this process starts for its run (no ``RAY_ADDRESS``) is
# the run's alone and ends with it, so it is started for the stages, each setting only
# where the environment does not already give it (the raylet and the workers it starts
# read them from the environment they inherit):
# - ``RAY_worker_niceness=0``: Ray starts workers at nice 15, so any normal process on the
#   node would take the cores from the stages;
# - Ray's own bookkeeping off: per-task events (the state API's and dashboard's task
#   lists), Ray's metrics export, its event-loop statistics and ``ray timeline``. Nothing
#   reads them here (the dashboard is not started; the run's own records, trace and
#   metrics are sarathi-pp's), and they cost CPU beside the stages (the design page "The
#   control plane", section "Ray's bookkeeping"; the runs are in the lab notebook).
# They are in the environment only while ``ray.init`` starts the cluster, so this process's
# own environment (and what it starts later) is left as it was. A cluster given by
# ``RAY_ADDRESS`` (``ray start``, ``ray job submit``) keeps its own settings.
LOCAL_RAY_ENV = {
    "RAY_worker_niceness": "0",
    "RAY_task_events_report_interval_ms": "0",
    "RAY_enable_metrics_collection": "0",
    "RAY_event_stats": "0",
    "RAY_enable_timeline": "0",
}


def start_ray(ray: ModuleType | None = None) -> bool:
    """Connect to ``RAY_ADDRESS`` if set, else start a local Ray for this run (Note [a Ray
    of its own]); returns whether this process started (and so must stop) it."""
    ray = ray or _ray()
    if ray.is_initialized():
        return False
    # "local" starts a fresh Ray even where a stale `ray start` left its address file
    # behind (a bare ray.init() would try to join that dead cluster).
    address = os.environ.get("RAY_ADDRESS") or "local"
    with _environ_defaults(LOCAL_RAY_ENV if address == "local" else {}):
        ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
    return True


@contextlib.contextmanager
def _environ_defaults(defaults: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``defaults`` where it has no value of its own, for the ``with``
    block only."""
    added = [name for name in defaults if name not in os.environ]
    os.environ.update({name: defaults[name] for name in added})
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def _cluster_resources(
    ray: ModuleType, device: str, num_stages: int, timeout_s: float, num_replicas: int = 1
) -> Resources:
    """The placement rule's view of the cluster: its GPU count (a replica's share of it:
    ``data_parallel_size`` replicas each need their own), and one GPU's memory and
    bfloat16 support, probed on a GPU worker when this driver has none."""
    local = probe_resources()
    gpus = int(ray.cluster_resources().get("GPU", 0)) // num_replicas
    if device != "cpu" and gpus >= num_stages and local.num_cuda_devices == 0:
        probe = ray.remote(num_gpus=1)(probe_resources).remote()
        local = ray.get(probe, timeout=timeout_s)
    where = (
        "the Ray cluster"
        if num_replicas == 1
        else (f"a replica's share of the Ray cluster (its GPUs // {num_replicas} replicas)")
    )
    return dataclasses.replace(local, num_cuda_devices=gpus, description=where)


class RayExecutor:
    def __init__(self, config: EngineConfig, checkpoint: Checkpoint) -> None:
        if config.cache.activation_memory == "profile":  # Note [profiling forward]
            n = config.parallel.pipeline_parallel_size
            raise ValueError(PROFILE_NEEDS_UNIPROC.format(executor="ray", num_stages=n))
        ray = self._ray = _ray()
        p = config.parallel
        self.num_stages = p.pipeline_parallel_size
        partition_layers(checkpoint.spec, self.num_stages)  # ValueError before Ray starts
        self._started_ray = start_ray(ray)
        self.timeout_s = p.stage_timeout_s
        # Starting actors and loading weights may take longer than a micro-batch on a busy
        # node: set-up waits at least SETUP_TIMEOUT_S whatever stage_timeout_s says.
        self.setup_timeout_s = max(self.timeout_s, SETUP_TIMEOUT_S)
        self._inflight: deque[tuple[MicroBatch, list]] = deque()
        self._abandoned: list = []  # results of a failed micro-batch nobody took
        # The sampled tokens of the last few micro-batches collected: a micro-batch
        # resubmitted after an isolation may take its decodes' input from them.
        self._collected: dict[int, dict[int, int]] = {}
        # Ray's actor handles: their methods (``.run_packed.remote``) are made at run time
        self.actors: list[Any] = []
        self.clock_offsets: list[float] = []
        self._pg: PlacementGroup | None = None
        self._config, self._checkpoint = config, checkpoint  # to rebuild lost stages
        self._kv_shape = (0, 0)
        try:
            resources = _cluster_resources(
                ray, config.model.device, self.num_stages, self.timeout_s,
                p.data_parallel_size,
            )  # fmt: skip
            self.placement = resolve_placement(config, checkpoint.spec, resources)
            self.schedule_ahead = resolve_schedule_ahead(config, self.placement, resources)
            ranges = list(self.placement.layer_ranges)
            logger.info("stages:\n%s", format_partition(checkpoint.spec, ranges))
            self._create_actors(config, checkpoint, self.placement)
        except BaseException:
            self.shutdown()
            raise

    def _create_actors(
        self, config: EngineConfig, checkpoint: Checkpoint, placement: Placement
    ) -> None:
        ray = self._ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from sarathi_pp.stages.worker.pipeline_stage import PipelineStage

        n, device = self.num_stages, placement.device
        # Fractional CPUs so that more stages than cores still start (2-core CI, PP=4); the
        # threads a stage uses are set apart from this (``num_threads_per_stage``).
        free_cpus = float(ray.available_resources().get("CPU", 0.0))
        cpus = max(0.01, min(1.0, free_cpus / n))
        bundle = {"CPU": cpus, "GPU": 1} if device == "cuda" else {"CPU": cpus}
        pg = self._pg = placement_group([dict(bundle) for _ in range(n)], strategy="PACK")
        ready, _ = ray.wait([pg.ready()], timeout=self.setup_timeout_s)
        if not ready:
            raise RuntimeError(
                f"Ray could not place {n} stage actors ({bundle} each) within "
                f"{self.setup_timeout_s:g} s; free in the cluster: {ray.available_resources()}"
            )
        actor_cls = ray.remote(PipelineStage)
        ahead, prefault = self.schedule_ahead.on, config.cache.prefault
        stage_specs = [
            StageSpec.of(placement, i, token_ring=ahead, prefault=prefault) for i in range(n)
        ]
        for i in range(n):
            strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)
            self.actors.append(
                actor_cls.options(
                    num_cpus=cpus,
                    num_gpus=1 if device == "cuda" else 0,
                    scheduling_strategy=strategy,
                    name=None,
                ).remote(stage_specs[i], checkpoint, config.parallel)
            )
        self._connect_stages()
        self.clock_offsets = [self._clock_offset(a) for a in self.actors]

    def _connect_stages(self) -> None:
        """The stages' data plane: a ``torch.distributed`` process group (gloo on CPU, NCCL
        on CUDA) for their send/recv of hidden states."""
        # On one node the stages' rendezvous and gloo stay on loopback (nothing listens outside).
        loopback = self._stages_share_a_node()
        addr, port = self._get([self.actors[0].address.remote(loopback)], "rendezvous")[0]
        self._get([a.init_group.remote(addr, port) for a in self.actors], "process group set-up")

    def _stages_share_a_node(self) -> bool:
        """Whether the placement group put every stage on one node (then they can meet on
        127.0.0.1); False when Ray cannot say."""
        from ray.util import placement_group_table

        try:
            nodes = set(placement_group_table(self._pg)["bundles_to_node_id"].values())
        except Exception:  # noqa: BLE001 - an older Ray without the field: assume several
            return False
        return len(nodes) == 1

    def _clock_offset(self, actor: Any) -> float:
        """The actor's monotonic clock minus the driver's, from the tightest of a few
        round trips; 0 when it is within the round-trip noise (the same machine)."""
        trips: list[tuple[float, float]] = []  # (round trip, offset)
        for _ in range(5):
            t0 = time.monotonic()
            remote = self._get([actor.clock.remote()], "clock")[0]
            t1 = time.monotonic()
            trips.append((t1 - t0, remote - (t0 + t1) / 2))
        rtt, offset = min(trips, key=lambda trip: trip[0])
        return 0.0 if abs(offset) <= rtt else offset

    def _get(self, refs: list, what: str) -> list:
        """``ray.get`` of set-up calls, with ``setup_timeout_s`` (micro-batches are waited for
        in ``_wait_stages``); a dead or failed actor names its stage."""
        ray = self._ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        out = []
        for i, ref in enumerate(refs):
            stage_idx = i if len(refs) == self.num_stages else 0
            try:
                out.append(ray.get(ref, timeout=self.setup_timeout_s))
            except GetTimeoutError:
                raise StageError(
                    stage_idx, f"{what}: no answer within {self.setup_timeout_s:g} s"
                ) from None
            except RayActorError as e:
                raise StageLost(
                    stage_idx, f"{what}: the stage actor died ({e.__class__.__name__})"
                ) from e
            except RayTaskError as e:
                raise StageError(stage_idx, f"{what} failed: {e.cause!r}") from e
        return out

    # --- Executor --------------------------------------------------------------------------------
    def load_model(self) -> list[StageMemory]:
        memory = self._get([a.load_model.remote() for a in self.actors], "loading weights")
        c = self._checkpoint
        return with_activations(
            memory, self._config, c.spec, self.placement, c.max_model_len,
            schedule_ahead=self.schedule_ahead.on,
        )  # fmt: skip

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self._get([a.init_kv_cache.remote(num_blocks, block_size) for a in self.actors], "KV cache")
        self._kv_shape = (num_blocks, block_size)

    def submit(self, microbatch: MicroBatch) -> None:
        self._inflight.append((microbatch, self._run(microbatch)))

    def _run(self, microbatch: MicroBatch) -> list:
        """Every stage's ``run`` of ``microbatch`` (none for an empty one); a Ctrl-C waits
        until every stage has it (``_isolate`` resubmits outside the engine's guard).
        Decodes scheduled ahead get their tokens here when the driver has them already
        (a resubmission), else over the token ring on stage 0."""
        if not microbatch.chunks:
            return []
        if microbatch.ring_sources:
            microbatch = fill_ring(microbatch, self._collected)
        packed = pickle.dumps(microbatch, protocol=pickle.HIGHEST_PROTOCOL)
        with deferred_interrupts():
            return [a.run_packed.remote(packed) for a in self.actors]

    def oldest_ready(self, timeout_s: float = 0.0) -> bool:
        """Whether every stage has the oldest micro-batch's result (``wait_oldest`` would
        not wait), waiting at most ``timeout_s`` for it: a router of replicas steps the one
        whose pipeline is done first."""
        if not self._inflight:
            return True
        refs = self._inflight[0][1]
        ready, _ = self._ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        return len(ready) == len(refs)

    def wait_oldest(self) -> tuple[MicroBatch, MicroBatchResult]:
        microbatch, refs = self._inflight.popleft()
        result = self._collect(microbatch, refs)
        if result.failure is not None:
            result = self._isolate(microbatch, result)
        self._keep_tokens(microbatch.microbatch_id, result)
        return microbatch, result

    def _keep_tokens(self, microbatch_id: int, result: MicroBatchResult) -> None:
        """Remember a collected micro-batch's tokens (the last few only)."""
        self._collected[microbatch_id] = result.sampled
        while len(self._collected) > 2 * len(self.actors) + 2:
            del self._collected[next(iter(self._collected))]

    def _forget_ring(self) -> None:
        self._collected.clear()

    def _collect(self, microbatch: MicroBatch, refs: list) -> MicroBatchResult:
        """The last stage's result with every stage's timing; ``failure`` when a stage
        raised on the micro-batch."""
        if not refs:
            return MicroBatchResult()
        outputs = self._wait_stages(microbatch, refs)  # [(MicroBatchResult | None, StageEvent)]
        failures = [r.failure for r, _ in outputs if r is not None and r.failure]
        result = MicroBatchResult(failure="; ".join(failures)) if failures else outputs[-1][0]
        result.events = [e.shifted(off) for (_, e), off in zip(outputs, self.clock_offsets)]
        return result

    def _isolate(self, microbatch: MicroBatch, failed: MicroBatchResult) -> MicroBatchResult:
        """A stage raised on ``microbatch``: retry its sequences one at a time through the
        pipeline, so only a request that fails alone fails (``errors``). The micro-batches
        behind it may have read K/V it left unwritten: they are drained, their results
        dropped, and issued again after the retry without the failed sequences (their
        original micro-batch is what the engine gets back, so its bookkeeping holds)."""
        logger.warning("micro-batch %d failed (%s): retrying its sequences one at a time",
                       microbatch.microbatch_id, failed.failure)  # fmt: skip
        behind = list(self._inflight)
        self._inflight.clear()
        for mb, refs in behind:
            self._collect(mb, refs)  # drained; whatever it computed is recomputed below
        result = retry_one_at_a_time(microbatch, failed, lambda m: self._collect(m, self._run(m)))
        self._keep_tokens(microbatch.microbatch_id, result)  # for the ones behind it
        for mb, _ in behind:
            self._inflight.append((mb, self._run(without_failed(mb, result))))
        return result

    def restart(self) -> None:
        """Replace every stage actor (one was lost): new actors and process group, weights
        reloaded, KV caches of the same shape re-created. What was in flight is gone; the
        engine recomputes its sequences."""
        assert self._config is not None and self._checkpoint is not None
        self.release_stages()
        # an injected step fault was the first stages' event (fault_injection.py: after_restart)
        fault = after_restart(self._config.parallel.inject_fault)
        self._config = self._config.replace(**{"parallel.inject_fault": fault})
        self._create_actors(self._config, self._checkpoint, self.placement)
        self.load_model()
        self.init_kv_cache(*self._kv_shape)

    def _wait_stages(self, microbatch: MicroBatch, refs: list) -> list:
        """All stages' results for ``microbatch``. A stage that fails or dies is reported as soon
        as its result is ready, not after the others time out waiting for it."""
        ray = self._ray
        index = {ref: i for i, ref in enumerate(refs)}
        remaining = list(refs)
        outputs: list = [None] * len(refs)
        deadline = time.monotonic() + self.timeout_s
        while remaining:
            ready, remaining = ray.wait(
                remaining, num_returns=1, timeout=max(0.0, deadline - time.monotonic())
            )
            if not ready:
                late = min(index[r] for r in remaining)
                raise StageError(
                    late,
                    f"micro-batch {microbatch.microbatch_id}: no result within {self.timeout_s:g} s",
                )
            for ref in ready:
                try:
                    outputs[index[ref]] = self._get_one(index[ref], ref, microbatch)
                except StageError as e:
                    self._abandoned.extend(refs)  # the others' results: taken at release
                    if isinstance(e, StageLost) or not _is_comm_failure(e):
                        raise
                    others = [r for r in refs if r is not ref]
                    lost = self._find_lost(others, index, microbatch, deadline)
                    if lost is None:
                        raise
                    raise lost from e
        return outputs

    def _find_lost(
        self, refs: list, index: dict, microbatch: MicroBatch, deadline: float
    ) -> StageLost | None:
        """Note [a dead peer seen first]: the ``StageLost`` of a stage whose actor died, from
        ``refs`` (the micro-batch's other results) or, once they are all in, from asking
        every actor; ``None`` if none is found within the grace."""
        from ray.exceptions import RayActorError

        ray = self._ray
        end = min(deadline, time.monotonic() + LOST_PEER_GRACE_S)
        pending = list(refs)
        while pending and (left := end - time.monotonic()) > 0:
            ready, pending = ray.wait(pending, num_returns=1, timeout=left)
            for ref in ready:
                try:
                    self._get_one(index[ref], ref, microbatch)
                except StageLost as lost:
                    return lost
                except StageError:
                    pass
        if pending:
            return None
        probes = {a.clock.remote(): i for i, a in enumerate(self.actors)}
        waiting = list(probes)
        while waiting and (left := end - time.monotonic()) > 0:
            ready, waiting = ray.wait(waiting, num_returns=1, timeout=left)
            for ref in ready:
                try:
                    ray.get(ref)
                except RayActorError:
                    return StageLost(
                        probes[ref],
                        f"micro-batch {microbatch.microbatch_id}: the stage actor died",
                    )
        return None

    def _get_one(
        self, stage_idx: int, ref: Any, microbatch: MicroBatch
    ) -> tuple[MicroBatchResult | None, StageEvent]:
        """A stage's ``(MicroBatchResult | None, StageEvent)`` for ``microbatch``."""
        from ray.exceptions import RayActorError, RayTaskError

        try:
            return pickle.loads(self._ray.get(ref))
        except RayActorError as e:
            raise StageLost(
                stage_idx, f"micro-batch {microbatch.microbatch_id}: the stage actor died"
            ) from e
        except RayTaskError as e:
            raise StageError(
                stage_idx, f"micro-batch {microbatch.microbatch_id} failed: {e.cause!r}"
            ) from e

    def reset(self) -> None:
        """Forget the micro-batches in flight. The stages still run them, in order and
        before anything submitted later (Ray runs an actor's calls in submission order), so
        whatever K/V they write is overwritten before a later micro-batch reads it; their
        results are dropped with their references."""
        self._inflight.clear()
        self._forget_ring()

    def _kill_actors(self) -> None:
        ray = self._ray
        for a in self.actors:
            with contextlib.suppress(Exception):  # already dead
                ray.kill(a)
        self.actors = []
        if self._pg is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):
                remove_placement_group(self._pg)
            self._pg = None

    def release_stages(self) -> None:
        """The pipeline is lost for good (the engine is dead): free the actors, keep Ray
        until ``shutdown``. Ray's shutdown resets the process's SIGTERM handling (its core
        worker's, below Python's), which a server still answering 503 needs for its own
        graceful stop: a SIGTERM then killed it outright (exit 143, no records)."""
        abandoned = self._abandoned_results()
        self._abandoned = []
        self._kill_actors()
        self._inflight.clear()
        self._forget_ring()
        self._collect_abandoned(abandoned)

    def _abandoned_results(self) -> list:
        """The result references nobody will take: a failed micro-batch's, the ones in
        flight."""
        return self._abandoned + [ref for _, refs in self._inflight for ref in refs]

    def _collect_abandoned(self, refs: list) -> None:
        """Take the results of abandoned micro-batches, whatever they are, so that Ray does
        not log each failed one as an "Unhandled error" when its reference goes (a stage
        beside a dead one fails on their connection: expected then). The actors are killed
        already, so every result is in at once, or within ``ABANDONED_WAIT_S``."""
        if not refs:
            return
        ray = self._ray
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=ABANDONED_WAIT_S)
        for ref in ready:
            with contextlib.suppress(Exception):
                ray.get(ref, timeout=0)

    def shutdown(self) -> None:
        ray = self._ray
        self.release_stages()
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
            self._started_ray = False


def _is_comm_failure(error: StageError) -> bool:
    """Whether ``error`` is a stage's task failing on its connection to another stage
    (Note [a dead peer seen first])."""
    return isinstance(getattr(error.__cause__, "cause", None), StageCommError)

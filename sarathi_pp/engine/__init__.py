"""The engine: the online loop (``llm_engine``), the front door's checks
(``input_processor``), ``n > 1`` as parent requests (``parallel_sampling``), output building
(``output_processor``) and failed steps (``recovery``); data-parallel replicas behind one
router (``replicas``, moving a dead replica's requests: ``handoff``). The run's records are
observers of the loop (``sarathi_pp/records/``)."""

from sarathi_pp.engine.llm_engine import LLMEngine
from sarathi_pp.engine.recovery import EngineDeadError
from sarathi_pp.engine.replicas import ReplicatedEngine, create_engine

__all__ = ["EngineDeadError", "LLMEngine", "ReplicatedEngine", "create_engine"]

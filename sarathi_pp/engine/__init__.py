"""The engine: the online loop (``llm_engine``), output building (``output_processor``), the
run's records (``recorder``) and failed steps (``pipeline_faults``)."""

from sarathi_pp.engine.llm_engine import LLMEngine
from sarathi_pp.engine.pipeline_faults import EngineDeadError

__all__ = ["EngineDeadError", "LLMEngine"]

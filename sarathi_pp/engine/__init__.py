"""The engine: the online loop (``llm_engine``), output building (``output_processor``) and
the run's records (``recorder``)."""

from sarathi_pp.engine.llm_engine import LLMEngine

__all__ = ["LLMEngine"]

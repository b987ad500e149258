"""sarathi-pp: SARATHI (chunked prefills + decode-maximal batching) as a pipeline-parallel
LLM inference runtime. The public surface is vLLM-shaped."""

from sarathi_pp.config import EngineConfig
from sarathi_pp.config_file import load_config
from sarathi_pp.engine import LLMEngine
from sarathi_pp.llm import LLM
from sarathi_pp.outputs import CompletionOutput, RequestMetrics, RequestOutput
from sarathi_pp.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "load_config",
]

"""specserve: an LLM inference engine built around one-model speculative decoding."""

from specserve.core.request import CompletionOutput, RequestOutput
from specserve.engine.llm import LLM
from specserve.engine.llm_engine import EngineArgs, LLMEngine
from specserve.sampling_params import RequestOutputKind, SamplingParams
from specserve.speculative.config import SpeculativeConfig

__all__ = ["LLM", "LLMEngine", "EngineArgs", "SamplingParams", "RequestOutputKind", "RequestOutput", "CompletionOutput",
           "SpeculativeConfig"]
__version__ = "0.1.0"

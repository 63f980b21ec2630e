"""kvguard.engine: the paged-KV inference engine (knows nothing of rules, metrics, HTTP or SQL)."""

from kvguard.engine.config import ConfigError, EngineConfig
from kvguard.engine.llm_engine import LLMEngine
from kvguard.engine.model_config import ModelConfig, ModelLoadError
from kvguard.engine.sampling_params import SamplingParams
from kvguard.engine.sequence import RequestOutput
from kvguard.engine.snapshot import EngineSnapshot

__all__ = [
    "ConfigError",
    "EngineConfig",
    "EngineSnapshot",
    "LLMEngine",
    "ModelConfig",
    "ModelLoadError",
    "RequestOutput",
    "SamplingParams",
]

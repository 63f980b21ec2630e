"""kvguard.engine: the paged-KV inference engine (knows nothing of rules, metrics, HTTP or SQL).

The public names are imported on first use (PEP 562 module `__getattr__`), not here: importing
any submodule runs this file first, and the torch-free ones (`control`, `config`, `admission`,
`priority`) are what `kvguard rules check` and the daemon's config loader need. Importing
`LLMEngine` eagerly would load torch (seconds, hundreds of MB) just to validate a YAML file.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvguard.engine.config import ConfigError, EngineConfig
    from kvguard.engine.llm_engine import LLMEngine
    from kvguard.engine.model_config import ModelConfig, ModelLoadError
    from kvguard.engine.sampling_params import SamplingParams
    from kvguard.engine.sequence import RequestOutput
    from kvguard.engine.snapshot import EngineSnapshot

_EXPORTS = {
    "ConfigError": "kvguard.engine.config",
    "EngineConfig": "kvguard.engine.config",
    "EngineSnapshot": "kvguard.engine.snapshot",
    "LLMEngine": "kvguard.engine.llm_engine",
    "ModelConfig": "kvguard.engine.model_config",
    "ModelLoadError": "kvguard.engine.model_config",
    "RequestOutput": "kvguard.engine.sequence",
    "SamplingParams": "kvguard.engine.sampling_params",
}

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


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})

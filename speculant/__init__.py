"""speculant: exact speculative decoding for large language models."""

from .api import generate, load_backend, load_engine
from .engine import Engine, Result, TokenEvent
from .llama import Llama
from .errors import (ContextOverflowError, ModelError, SettingsError, SpeculantError,
                     VocabMismatchError)
from .stats import SpecStats
from .verify import SamplingParams

__version__ = "0.1.0"

__all__ = ["generate", "load_engine", "Llama", "load_backend", "Engine", "Result", "TokenEvent", "SamplingParams",
           "SpecStats", "SpeculantError", "ModelError", "SettingsError", "VocabMismatchError",
           "ContextOverflowError"]

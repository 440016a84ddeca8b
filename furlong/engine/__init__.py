"""Token-in/token-out inference engines: the Engine protocol and its backends."""

from furlong.engine.base import Engine, EngineError, FinishReason, Generation, SamplingParams

__all__ = ["Engine", "EngineError", "FinishReason", "Generation", "SamplingParams"]

"""The InferenceEngine layer: one class per engine, one instance per endpoint."""

from ._base import Engine, Generation
from ._echo import EchoEngine
from ._inproc import InprocEngine
from ._sglang import SglangEngine
from ._vllm_server import VllmServerEngine

__all__ = ["EchoEngine", "Engine", "Generation", "InprocEngine", "SglangEngine", "VllmServerEngine"]

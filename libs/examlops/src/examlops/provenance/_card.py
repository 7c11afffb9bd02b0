"""What a model folder says about itself: architecture, parameter count, dtype, tokenizer,
quantization. Read from config.json, tokenizer_config.json and the safetensors headers (no torch)."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ModelFacts:
    architecture: str = ""          # LlamaForCausalLM
    family: str = ""                # llama
    parameters: int = 0             # from the safetensors headers
    dtype: str = ""                 # bfloat16
    tokenizer: str = ""             # tokenizer class, or the tokenizer file
    hidden_size: int = 0
    intermediate_size: int = 0
    quantization: dict[str, Any] = field(default_factory=dict)   # config.json's quantization_config


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def safetensors_parameters(path: Path) -> int:
    """Elements of every tensor of a .safetensors file, from its JSON header alone. A quantized
    checkpoint's scale and zero-point tensors count too; packed int4 weights count as stored."""
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        if size > 100 << 20:
            raise ValueError(f"{path.name}: safetensors header of {size} bytes is not plausible")
        header = json.loads(f.read(size))
    return sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")


def model_facts(folder: Path) -> ModelFacts:
    config = _json(folder / "config.json")
    tok = _json(folder / "tokenizer_config.json")
    archs = config.get("architectures") or [""]
    params = sum(safetensors_parameters(p) for p in sorted(folder.glob("*.safetensors")))
    tokenizer = str(tok.get("tokenizer_class") or ("tokenizer.json" if (folder / "tokenizer.json").is_file() else ""))
    quant = config.get("quantization_config") or config.get("compression_config") or {}
    return ModelFacts(
        architecture=str(archs[0]), family=str(config.get("model_type") or ""), parameters=params,
        dtype=str(config.get("dtype") or config.get("torch_dtype") or ""), tokenizer=tokenizer,
        hidden_size=int(config.get("hidden_size") or 0), intermediate_size=int(config.get("intermediate_size") or 0),
        quantization=quant if isinstance(quant, dict) else {})

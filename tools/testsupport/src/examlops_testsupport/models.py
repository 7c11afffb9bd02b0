"""A tiny model folder in the Hugging Face layout, for provenance tests that need files, not weights."""

from __future__ import annotations

import json
import struct
from pathlib import Path


def tiny_model(folder: Path, seed: int = 0) -> Path:
    """config.json, tokenizer_config.json and a model.safetensors with a valid header (two tensors)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "dtype": "bfloat16",
        "hidden_size": 8, "intermediate_size": 16}))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    header = json.dumps({"a": {"dtype": "BF16", "shape": [8, 16], "data_offsets": [0, 256]},
                         "b": {"dtype": "BF16", "shape": [16], "data_offsets": [256, 288]}}).encode()
    payload = bytes((i * 7 + seed) % 256 for i in range(288))
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + payload)
    return folder

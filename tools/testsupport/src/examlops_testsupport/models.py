"""Model-version test helpers: a tiny model folder, a signer, the registration `exa models register` sends."""

from __future__ import annotations

import hashlib
import json
import struct
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import pytest

from examlops.provenance import (
    Tool,
    VersionSpec,
    build_bom,
    digest_folder,
    dump_bom,
    generate_keypair,
    load_signing_key,
    model_facts,
    sign,
)
from examlops.registry.v1 import registry_pb2 as reg
from examlops.svc import error_reason


def tiny_model(folder: Path, seed: str = "") -> Path:
    """config.json, tokenizer_config.json and a model.safetensors with a valid header (two tensors)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "dtype": "bfloat16",
        "hidden_size": 8, "intermediate_size": 16}))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    header = json.dumps({"a": {"dtype": "BF16", "shape": [8, 16], "data_offsets": [0, 256]},
                         "b": {"dtype": "BF16", "shape": [16], "data_offsets": [256, 288]}}).encode()
    payload = (hashlib.sha256(seed.encode()).digest() * 9)[:288]  # another seed, other weights
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + payload)
    return folder


class Signer:
    def __init__(self, where: Path) -> None:
        priv, pub, self.key_id = generate_keypair(where)
        self.key = load_signing_key(priv)
        self.pem = pub.read_text()


def version(name: str, v: str, folder: Path | None, signer: Signer, parent: reg.ModelVersion | None = None,
            quantization: str = "", degraded_reason: str = "", project: str = "") -> reg.ModelVersion:
    """The registration request `exa models register` sends (a degraded version may have no folder)."""
    files = digest_folder(folder) if folder is not None else []
    spec = VersionSpec(name=name, version=v, files=files,
                       facts=model_facts(folder) if folder is not None else model_facts(Path("/nonexistent")),
                       parent=f"{parent.name}@{parent.version}" if parent else "",
                       parent_bom_sha256=parent.bom_sha256 if parent else "",
                       quantization={"method": quantization, "scheme": "W8A8"} if quantization else {},
                       degraded_reason=degraded_reason, tools=[Tool("examlops", "1.0")], project=project)
    text = dump_bom(build_bom(spec, datetime(2025, 1, 2, tzinfo=UTC)))
    return reg.ModelVersion(
        name=name, version=v, path=str(folder or ""), bom_json=text, signature=sign(signer.key, text),
        key_id=signer.key_id, parent=spec.parent, quantization=quantization, degraded=bool(degraded_reason),
        degraded_reason=degraded_reason, project=project,
        files=[reg.FileDigest(path=d.path, sha256=d.sha256, size=d.size) for d in files])


def refusal(call: Callable[[], Any]) -> tuple[grpc.StatusCode, str, str, str]:
    """(code, reason, field, message) of a refused call."""
    with pytest.raises(grpc.RpcError) as info:
        call()
    err: Any = info.value
    reason, field = error_reason(err)
    return err.code(), reason, field, err.details() or ""


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"

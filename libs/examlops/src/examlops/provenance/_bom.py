"""CycloneDX 1.6 ML-BOMs of model versions: build, validate, and read back what they claim.

The BOM's subject (metadata.component, type machine-learning-model) is NAME@V with a modelCard;
each file of the folder is a `file` component with its SHA-256; datasets are `data` components
named with their revision; a derived version carries its parent in pedigree.ancestors with the
parent BOM's SHA-256; quantization and degraded mode are `examlops:*` properties.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from ._card import ModelFacts
from ._digest import FileDigest

SPEC = "1.6"
P = "examlops:"


class BomError(ValueError):
    """A BOM that is not a valid CycloneDX 1.6 document, or that does not describe what it should."""


@dataclass(frozen=True)
class Dataset:
    name: str
    revision: str
    sha256: str = ""        # when the dataset is a local file: its digest
    role: str = "training"  # training | calibration | evaluation


@dataclass(frozen=True)
class Tool:
    name: str
    version: str


@dataclass
class VersionSpec:
    """Everything a BOM records about one version."""

    name: str
    version: str
    files: list[FileDigest]
    facts: ModelFacts
    datasets: list[Dataset] = field(default_factory=list)
    parent: str = ""                 # NAME@V
    parent_bom_sha256: str = ""
    quantization: dict[str, Any] = field(default_factory=dict)   # {"method": "w8a8", ...parameters}
    degraded_reason: str = ""        # set: the transformation was recorded, not run
    tools: list[Tool] = field(default_factory=list)
    project: str = ""


def _props(items: dict[str, Any]) -> list[dict[str, str]]:
    return [{"name": P + k, "value": v if isinstance(v, str) else json.dumps(v, sort_keys=True)}
            for k, v in items.items() if v not in ("", None, {}, [])]


def build_bom(spec: VersionSpec, timestamp: datetime | None = None) -> dict[str, Any]:
    ref = f"model:{spec.name}@{spec.version}"
    facts = spec.facts
    files = [{"type": "file", "bom-ref": f"file:{d.path}", "name": d.path,
              "hashes": [{"alg": "SHA-256", "content": d.sha256}],
              "properties": [{"name": P + "size", "value": str(d.size)}]} for d in spec.files]
    data = []
    for ds in spec.datasets:
        comp: dict[str, Any] = {"type": "data", "bom-ref": f"dataset:{ds.role}:{ds.name}@{ds.revision}",
                                "name": ds.name, "version": ds.revision,
                                "data": [{"type": "dataset", "name": ds.name, "classification": ds.role}],
                                "properties": _props({"dataset.role": ds.role})}
        if ds.sha256:
            comp["hashes"] = [{"alg": "SHA-256", "content": ds.sha256}]
        data.append(comp)
    card_props = _props({"parameters": str(facts.parameters), "dtype": facts.dtype, "tokenizer": facts.tokenizer,
                         "hidden_size": str(facts.hidden_size or ""),
                         "quantization.method": spec.quantization.get("method", ""),
                         "quantization.parameters": {k: v for k, v in spec.quantization.items() if k != "method"},
                         "checkpoint.quantization_config": facts.quantization})
    subject: dict[str, Any] = {
        "type": "machine-learning-model", "bom-ref": ref, "name": spec.name, "version": spec.version,
        "modelCard": {"modelParameters": {
            "task": "text-generation", "architectureFamily": facts.family,
            "modelArchitecture": facts.architecture,
            "datasets": [{"ref": d["bom-ref"]} for d in data]}, "properties": card_props},
        "properties": _props({"parent": spec.parent, "project": spec.project,
                              "quantization": spec.quantization.get("method", ""),
                              "degraded": "true" if spec.degraded_reason else "",
                              "degraded.reason": spec.degraded_reason}),
    }
    if spec.parent:
        pname, _, pver = spec.parent.partition("@")
        ancestor: dict[str, Any] = {"type": "machine-learning-model", "bom-ref": f"parent:{spec.parent}",
                                    "name": pname, "version": pver}
        if spec.parent_bom_sha256:
            ancestor["hashes"] = [{"alg": "SHA-256", "content": spec.parent_bom_sha256}]
        subject["pedigree"] = {"ancestors": [ancestor]}
    ts = (timestamp or datetime.now(UTC)).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "bomFormat": "CycloneDX", "specVersion": SPEC, "serialNumber": f"urn:uuid:{uuid.uuid4()}", "version": 1,
        "metadata": {"timestamp": ts, "component": subject,
                     "tools": {"components": [{"type": "application", "name": t.name, "version": t.version}
                                              for t in spec.tools]}},
        "components": files + data,
        "dependencies": [{"ref": ref, "dependsOn": [c["bom-ref"] for c in files + data]}],
    }


def dump_bom(bom: dict[str, Any]) -> str:
    """The exact text that is signed and stored."""
    return json.dumps(bom, sort_keys=True, separators=(",", ":"))


def validate_bom(text: str) -> None:
    """Raise BomError unless `text` validates against the CycloneDX 1.6 JSON schema (strict)."""
    from cyclonedx.schema import SchemaVersion
    from cyclonedx.validation.json import JsonStrictValidator

    error = JsonStrictValidator(SchemaVersion.V1_6).validate_str(text)
    if error is not None:
        raise BomError(f"not a valid CycloneDX 1.6 BOM: {str(error)[:300]}")


@dataclass(frozen=True)
class BomClaims:
    """What a BOM says, read back for checking."""

    name: str
    version: str
    files: list[FileDigest]
    parent: str
    quantization: str
    degraded_reason: str


def read_claims(text: str) -> BomClaims:
    try:
        bom = json.loads(text)
        subject = bom["metadata"]["component"]
        props = {p["name"]: p["value"] for p in subject.get("properties", [])}
        files = []
        for c in bom.get("components", []):
            if c.get("type") != "file":
                continue
            sha = next(h["content"] for h in c["hashes"] if h["alg"] == "SHA-256")
            size = next((int(p["value"]) for p in c.get("properties", []) if p["name"] == P + "size"), -1)
            files.append(FileDigest(c["name"], sha, size))
    except (ValueError, KeyError, TypeError, StopIteration) as exc:
        raise BomError(f"the BOM does not describe a model version ({type(exc).__name__}: {exc})") from None
    if subject.get("type") != "machine-learning-model":
        raise BomError("the BOM's subject is not a machine-learning-model component")
    return BomClaims(str(subject.get("name", "")), str(subject.get("version", "")),
                     sorted(files, key=lambda d: d.path), props.get(P + "parent", ""),
                     props.get(P + "quantization", ""), props.get(P + "degraded.reason", ""))

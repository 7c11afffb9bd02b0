"""Use-case packs: finding, loading and validating `usecases/<pack>/models/<name>.yaml`.

A model file is a YAML mapping with exactly these top-level keys:

* ``engine`` (required) — the engine block (`EngineBlock`);
* ``name`` (optional) — must equal the file stem, which is the name models are found by;
* ``description`` (optional) — one human sentence;
* ``eval_gate`` (optional) — the floors `exa models eval` holds this model's versions to
  (`EvalGate`): ``max_perplexity_ratio`` and ``min_task_score_ratio`` relative to the parent
  version (defaults 1.10 and 0.95), and absolute ``max_perplexity`` and ``min_task_score``.

Any other key is rejected, and so is a key given twice (YAML would silently keep the last).

`EXAMLOPS_USECASE_DIR` names either ONE pack (a directory with a ``models/`` sub-directory) or a
directory OF packs (whose sub-directories have ``models/``). In the second case a model name
that exists in several packs is ambiguous and must be written ``<pack>/<name>``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ._errors import EngineBlockError, EngineBlockIssue
from ._issues import issues_from_validation_error
from ._render import render_vllm_command
from ._schema import EngineBlock
from ._vllm_check import VllmArgvChecker

USECASE_DIR_ENV = "EXAMLOPS_USECASE_DIR"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_NAME_ACCEPTED = ("letters, digits, '.', '_' and '-', starting with a letter or digit",)


class ModelNotFoundError(LookupError):
    """No model file answers to a name (or several do and the name is ambiguous)."""


class EvalGate(BaseModel):
    """A model's `eval_gate:` floors for `exa models eval`; an unset ratio takes its default.

    A version derived from a parent passes when its perplexity is at most
    ``max_perplexity_ratio`` x the parent's and its task score at least ``min_task_score_ratio``
    x the parent's; the absolute floors, when set, apply to every version, base versions too.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    max_perplexity_ratio: float | None = Field(default=None, gt=0)
    min_task_score_ratio: float | None = Field(default=None, ge=0)
    max_perplexity: float | None = Field(default=None, ge=1)
    min_task_score: float | None = Field(default=None, ge=0, le=1)


class ModelSpec(BaseModel):
    """One model file of a use-case pack."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    name: str
    description: str | None = None
    engine: EngineBlock
    eval_gate: EvalGate | None = None

    @field_validator("name")
    @classmethod
    def _name_is_a_file_stem(cls, value: str) -> str:
        if not _NAME.match(value):
            raise EngineBlockError.single("", value, "is not a model name", _NAME_ACCEPTED)
        return value


def parse_engine_block(data: Any, *, prefix: str = "engine") -> EngineBlock:
    """Validate an engine block given as plain data (a YAML mapping, or JSON from the registry).

    Raises EngineBlockError listing every issue; field paths start with `prefix`.
    """
    try:
        return EngineBlock.model_validate(data)
    except ValidationError as exc:
        raise EngineBlockError(issues_from_validation_error(exc, EngineBlock, prefix=prefix)) from None


def parse_model_spec(data: Any, *, name: str, source: str | None = None) -> ModelSpec:
    """Validate a whole model file's content; `name` is what the file is found by."""
    if not isinstance(data, Mapping):
        raise EngineBlockError.single(
            "", data, "a model file is a mapping", ("a mapping with keys engine, name, description, eval_gate",),
            source=source,
        )
    issues: list[EngineBlockIssue] = []
    given = data.get("name", name)
    if given != name:
        issues.append(EngineBlockIssue(
            "name", given, "differs from the file name models are found by", (repr(name),)
        ))
    try:
        spec = ModelSpec.model_validate({**data, "name": name})
    except ValidationError as exc:
        issues.extend(issues_from_validation_error(exc, ModelSpec))
    if issues:
        raise EngineBlockError(issues, source=source)
    return spec


def load_model_file(path: str | os.PathLike[str], *, name: str | None = None) -> ModelSpec:
    """Load and validate one model file; its name is `name`, else the file stem."""
    file = Path(path)
    source = str(file)
    try:
        data = yaml.load(file.read_text(encoding="utf-8"), Loader=_StrictLoader)
    except yaml.YAMLError as exc:
        raise EngineBlockError.single(
            "", source, f"is not valid YAML: {exc}".replace("\n", " "), ("a YAML mapping",),
            source=source,
        ) from None
    return parse_model_spec(data, name=name or file.stem, source=source)


def find_model_file(name: str, usecase_dir: str | os.PathLike[str] | None = None) -> Path:
    """The file of model `name` (or `<pack>/<name>`) under `usecase_dir` / $EXAMLOPS_USECASE_DIR."""
    root = _usecase_root(usecase_dir)
    pack, _, model = name.rpartition("/")
    if not _NAME.match(model) or (pack and not _NAME.match(pack)):
        raise ModelNotFoundError(f"{name!r} is not a model name ({_NAME_ACCEPTED[0]})")
    if (root / "models").is_dir():
        if pack and pack != root.name:
            raise ModelNotFoundError(f"{root} is the pack {root.name!r}, not {pack!r}")
        candidates = [root / "models" / f"{model}.yaml"]
    elif pack:
        candidates = [root / pack / "models" / f"{model}.yaml"]
    else:
        candidates = sorted(root.glob(f"*/models/{model}.yaml"))
    found = [c for c in candidates if c.is_file()]
    if not found:
        raise ModelNotFoundError(f"no model {name!r} in {root} (looked for models/{model}.yaml)")
    if len(found) > 1:
        packs = ", ".join(f"{f.parent.parent.name}/{model}" for f in found)
        raise ModelNotFoundError(f"model {name!r} is in several packs of {root}; say which: {packs}")
    return found[0]


def find_model(name: str, usecase_dir: str | os.PathLike[str] | None = None) -> ModelSpec:
    """Find and load model `name`; see the module docs for how the use-case dir is searched."""
    return load_model_file(find_model_file(name, usecase_dir))


def validate_pack_dir(
    directory: str | os.PathLike[str], *, vllm: VllmArgvChecker | None = None
) -> list[tuple[Path, EngineBlockError | None]]:
    """Validate every model file of a pack, a directory of packs, or a `models/` directory.

    This is the registry-integrity check: each file comes back with its error, or None when
    it is valid. A `.yml` file is reported rather than skipped, so no model escapes the check.
    Given a running `VllmArgvChecker`, each valid vllm-server block is also rendered and parsed
    by vLLM's own parser, which catches what the schema cannot know (e.g. the arity of a flag
    in `extra_args`).
    """
    root = Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f"no such use-case directory: {root}")
    if (root / "models").is_dir():
        model_dirs = [root / "models"]
    elif root.name == "models":
        model_dirs = [root]
    else:
        model_dirs = sorted(p for p in root.glob("*/models") if p.is_dir())
    results: list[tuple[Path, EngineBlockError | None]] = []
    for models in model_dirs:
        for file in sorted(models.iterdir()):
            if file.suffix == ".yml":
                results.append((file, EngineBlockError.single(
                    "", file.name, "model files end in .yaml", (f"{file.stem}.yaml",),
                    source=str(file),
                )))
            elif file.suffix == ".yaml" and file.is_file():
                try:
                    spec = load_model_file(file)
                except EngineBlockError as exc:
                    results.append((file, exc))
                else:
                    results.append((file, _vllm_refusal(spec, vllm, str(file))))
    return results


def _vllm_refusal(spec: ModelSpec, vllm: VllmArgvChecker | None, source: str) -> EngineBlockError | None:
    """vLLM's objection to the argv `spec` renders to, if a checker is given and it objects."""
    block = spec.engine
    if vllm is None or block.engine != "vllm-server":
        return None
    # The secret's value is not the check's business; only its absence from argv is.
    environ = {block.api_key_env_var: "placeholder"} if block.api_key_env_var else {}
    (parsed,) = vllm.parse([render_vllm_command(block, environ=environ).argv])
    if parsed.ok:
        return None
    return EngineBlockError.single(
        "engine", parsed.argv, f"vLLM refuses the rendered argv: {parsed.error}",
        ("a block whose argv `vllm serve` accepts",), source=source,
    )


def _usecase_root(usecase_dir: str | os.PathLike[str] | None) -> Path:
    if usecase_dir is None:
        value = os.environ.get(USECASE_DIR_ENV)
        if not value:
            raise ModelNotFoundError(
                f"{USECASE_DIR_ENV} is not set: point it at a use-case pack (a directory with "
                "models/) or at a directory of packs"
            )
        usecase_dir = value
    root = Path(usecase_dir)
    if not root.is_dir():
        raise ModelNotFoundError(f"use-case directory {root} does not exist")
    return root


#: SafeLoader that refuses a mapping key given twice instead of keeping the last value.
_StrictLoader: Any = type("_StrictLoader", (yaml.SafeLoader,), {})


def _construct_mapping(loader: Any, node: Any) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} is given twice", key_node.start_mark
            )
        seen.add(key)
    return dict(loader.construct_pairs(node))


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)

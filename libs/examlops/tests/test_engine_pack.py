"""Use-case packs: loading model files, finding models, and the registry-integrity check."""

from __future__ import annotations

from pathlib import Path

import pytest

from examlops.engine import (
    USECASE_DIR_ENV,
    EngineBlockError,
    ModelNotFoundError,
    find_model,
    find_model_file,
    load_model_file,
    parse_model_spec,
    validate_pack_dir,
)

REPO = Path(__file__).resolve().parents[3]
SAMPLE_PACK = REPO / "usecases" / "sample"
GOOD = "engine:\n  engine: vllm\n  hf_model_id: org/model\n"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def test_the_sample_pack_validates() -> None:
    results = validate_pack_dir(SAMPLE_PACK)
    names = sorted(path.stem for path, _ in results)
    assert names == ["echo", "llama-8b", "minilm", "qwen-vl", "smol"]
    assert [str(error) for _, error in results if error is not None] == []


def test_the_sample_models_say_what_the_issue_asks() -> None:
    smol = find_model("smol", SAMPLE_PACK).engine
    assert (smol.engine, smol.dtype, smol.max_model_len) == ("vllm-server", "bfloat16", 2048)
    assert smol.hf_model_id == "HuggingFaceTB/SmolLM2-135M-Instruct"
    llama = find_model("llama-8b", SAMPLE_PACK).engine
    assert llama.tensor_parallel_size > 1 and llama.prefix_cache
    assert llama.speculative_decoding is not None and llama.speculative_decoding.enabled
    vision = find_model("qwen-vl", SAMPLE_PACK).engine.multimodal
    assert vision.modality == "vision" and vision.limit_mm_per_prompt == {"image": 2}
    assert vision.allowed_media_domains and vision.max_image_bytes == 20 * 1024 * 1024


def test_name_comes_from_the_file_stem_unless_given(tmp_path: Path) -> None:
    path = write(tmp_path / "models" / "tiny.yaml", GOOD)
    assert load_model_file(path).name == "tiny"
    assert load_model_file(path, name="other").name == "other"


def test_a_name_key_must_match_the_file(tmp_path: Path) -> None:
    path = write(tmp_path / "tiny.yaml", "name: huge\n" + GOOD)
    with pytest.raises(EngineBlockError) as caught:
        load_model_file(path)
    (line,) = caught.value.lines()
    assert line.startswith(f"{path}: name: differs from the file name")
    assert "got 'huge'; accepted: 'tiny'" in line


def test_only_documented_top_level_keys(tmp_path: Path) -> None:
    path = write(tmp_path / "tiny.yaml", "owner: me\n" + GOOD)
    with pytest.raises(EngineBlockError) as caught:
        load_model_file(path)
    (issue,) = caught.value.issues
    assert issue.field == "owner" and issue.accepted == ("name", "description", "engine", "eval_gate")


def test_the_engine_block_is_required_and_errors_carry_the_file(tmp_path: Path) -> None:
    path = write(tmp_path / "tiny.yaml", "description: nothing\n")
    with pytest.raises(EngineBlockError) as caught:
        load_model_file(path)
    assert caught.value.source == str(path)
    assert caught.value.issues[0].field == "engine" and "is required" in str(caught.value)


def test_engine_errors_are_paths_under_engine(tmp_path: Path) -> None:
    path = write(tmp_path / "tiny.yaml", GOOD + "  dtype: int3\n")
    with pytest.raises(EngineBlockError, match=r"engine\.dtype: 'int3' is not accepted"):
        load_model_file(path)


def test_a_key_given_twice_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path / "tiny.yaml", GOOD + "  dtype: float16\n  dtype: bfloat16\n")
    with pytest.raises(EngineBlockError, match="'dtype' is given twice"):
        load_model_file(path)


def test_yaml_that_is_not_a_mapping_is_refused(tmp_path: Path) -> None:
    with pytest.raises(EngineBlockError, match="a model file is a mapping"):
        load_model_file(write(tmp_path / "tiny.yaml", "- engine\n"))
    with pytest.raises(EngineBlockError, match="is not valid YAML"):
        load_model_file(write(tmp_path / "bad.yaml", "engine: [\n"))


def test_parse_model_spec_takes_registry_data() -> None:
    spec = parse_model_spec({"engine": {"engine": "echo"}}, name="e")
    assert spec.name == "e" and spec.engine.engine == "echo"


def make_packs(root: Path) -> None:
    write(root / "alpha" / "models" / "shared.yaml", GOOD)
    write(root / "beta" / "models" / "shared.yaml", GOOD)
    write(root / "beta" / "models" / "only-beta.yaml", GOOD)


def test_find_model_in_a_directory_of_packs(tmp_path: Path) -> None:
    make_packs(tmp_path)
    assert find_model_file("only-beta", tmp_path) == tmp_path / "beta" / "models" / "only-beta.yaml"
    assert find_model_file("alpha/shared", tmp_path).parent.parent.name == "alpha"
    with pytest.raises(ModelNotFoundError, match="alpha/shared, beta/shared"):
        find_model_file("shared", tmp_path)
    with pytest.raises(ModelNotFoundError, match="no model 'absent'"):
        find_model_file("absent", tmp_path)


def test_find_model_in_one_pack(tmp_path: Path) -> None:
    make_packs(tmp_path)
    pack = tmp_path / "beta"
    assert find_model("shared", pack).name == "shared"
    assert find_model_file("beta/shared", pack) == pack / "models" / "shared.yaml"
    with pytest.raises(ModelNotFoundError, match="not 'alpha'"):
        find_model_file("alpha/shared", pack)


def test_find_model_reads_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_packs(tmp_path)
    monkeypatch.setenv(USECASE_DIR_ENV, str(tmp_path / "alpha"))
    assert find_model("shared").engine.hf_model_id == "org/model"
    monkeypatch.delenv(USECASE_DIR_ENV)
    with pytest.raises(ModelNotFoundError, match=USECASE_DIR_ENV):
        find_model("shared")


@pytest.mark.parametrize("name", ["../etc/passwd", "a/b/c", "", "-x"])
def test_find_model_refuses_names_that_are_not_names(tmp_path: Path, name: str) -> None:
    make_packs(tmp_path)
    with pytest.raises(ModelNotFoundError):
        find_model_file(name, tmp_path)


def test_validate_pack_dir_reports_each_file(tmp_path: Path) -> None:
    make_packs(tmp_path)
    write(tmp_path / "beta" / "models" / "broken.yaml", GOOD + "  tensor_parallel_size: 0\n")
    write(tmp_path / "beta" / "models" / "legacy.yml", GOOD)
    write(tmp_path / "beta" / "models" / "README.md", "not a model")
    results = {p.name: e for p, e in validate_pack_dir(tmp_path)}
    assert sorted(results) == ["broken.yaml", "legacy.yml", "only-beta.yaml", "shared.yaml"]
    broken, legacy = results["broken.yaml"], results["legacy.yml"]
    assert broken is not None and broken.issues[0].field == "engine.tensor_parallel_size"
    assert legacy is not None and "end in .yaml" in str(legacy)
    assert len(validate_pack_dir(tmp_path / "beta")) == 4
    assert len(validate_pack_dir(tmp_path / "beta" / "models")) == 4


def test_validate_pack_dir_needs_a_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        validate_pack_dir(tmp_path / "absent")

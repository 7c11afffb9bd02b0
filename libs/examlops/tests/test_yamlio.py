"""The project's one YAML writer: shared objects are written in full, never as anchors and aliases."""

from __future__ import annotations

from typing import Any

import yaml

from examlops.yamlio import dump_yaml


def references(text: str) -> list[str]:
    """Every anchor (`&id001`) and alias (`*id001`) in a YAML text, found by the YAML scanner itself."""
    return [t.value for t in yaml.scan(text) if isinstance(t, yaml.AnchorToken | yaml.AliasToken)]


def test_an_object_used_twice_is_written_twice_in_full() -> None:
    resources = {"limits": {"nvidia.com/gpu": "2"}}
    env = [{"name": "HOME", "value": "/home"}]
    data = {"head": {"resources": resources, "env": env}, "worker": {"resources": resources, "env": env}}
    assert references(yaml.safe_dump(data))  # the control: PyYAML's own dumper shares them
    text = dump_yaml(data)
    assert references(text) == []
    assert "&" not in text and "*" not in text
    assert yaml.safe_load(text) == data


def test_keys_keep_their_order_in_block_style() -> None:
    data: dict[str, Any] = {"kind": "X", "apiVersion": "v1", "spec": {"b": [1, 2], "a": {}}}
    text = dump_yaml(data)
    assert text == "kind: X\napiVersion: v1\nspec:\n  b:\n  - 1\n  - 2\n  a: {}\n"
    assert list(yaml.safe_load(text)) == ["kind", "apiVersion", "spec"]


def test_strings_that_look_like_references_stay_strings() -> None:
    data = {"jsonPath": ".status.addresses[*].url", "anchor": "&id001", "alias": "*id001"}
    text = dump_yaml(data)
    assert references(text) == []
    assert yaml.safe_load(text) == data

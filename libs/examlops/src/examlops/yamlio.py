"""The one YAML writer of the project: what people read and diff (manifests, compose overrides).

PyYAML writes an anchor (`&id001`) and an alias (`*id001`) whenever one Python object appears
twice in the data, e.g. one resources dict shared by a head and a worker pod. The document means
the same, but a reader has to resolve references and a diff shows them instead of the values.
`dump_yaml` writes every value out in full, keeps the keys in the order the data has them, and
uses block style. (Data that contains itself cannot be written this way: it raises RecursionError.)
"""

from __future__ import annotations

from typing import Any

import yaml

__all__ = ["dump_yaml"]


class _PlainDumper(yaml.SafeDumper):
    """SafeDumper that never writes anchors or aliases: a shared object is written in full each time."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def dump_yaml(data: Any) -> str:
    """`data` as a YAML document: safe types only, insertion order, block style, no anchors or aliases."""
    text: str = yaml.dump(data, Dumper=_PlainDumper, sort_keys=False, default_flow_style=False)
    return text

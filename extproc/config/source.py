"""The config file's YAML: read so that a mistake can be named by key and line.

PyYAML keeps the last of two equal keys without a word (`models:` twice drops every pod of the first
block), so the node tree is walked first and any repeated key, at any depth, refuses the file. The
mappings built remember the line of each key (`line_of`), so the checks after can name it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml


class DuplicateKey(ValueError):
    """Two equal keys in one mapping of the file (the config loader refuses it as a ConfigError)."""


MERGE_TAG = "tag:yaml.org,2002:merge"  # `<<: *defaults`: a YAML merge, not a key of its own


class Located(dict):
    """A mapping read from the file, with the (1-based) line of each of its keys."""

    __slots__ = ("lines",)

    def __init__(self) -> None:
        super().__init__()
        self.lines: dict[Any, int] = {}


def line_of(mapping: Mapping[Any, Any], key: Any) -> str:
    """`" (line N)"` for a key of a mapping read from the file, else nothing."""
    line = mapping.lines.get(key) if isinstance(mapping, Located) else None
    return f" (line {line})" if line is not None else ""


class _Loader(yaml.SafeLoader):
    def construct_located(self, node: yaml.MappingNode):  # type: ignore[no-untyped-def]
        data = Located()
        yield data
        data.update(self.construct_mapping(node))
        for key_node, _ in node.value:
            if key_node.tag != MERGE_TAG and isinstance(key_node, yaml.ScalarNode):
                data.lines.setdefault(self.construct_object(key_node), key_node.start_mark.line + 1)


_Loader.add_constructor("tag:yaml.org,2002:map", _Loader.construct_located)
yaml.SafeDumper.add_representer(Located, yaml.representer.SafeRepresenter.represent_dict)  # dumps as a dict


def read_yaml(text: str) -> Any:
    """The document in `text`, its mappings `Located`. Raises DuplicateKey on a repeated key and
    yaml.YAMLError on broken YAML."""
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _refuse_repeated_keys(node)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _refuse_repeated_keys(root: yaml.Node) -> None:
    stack: list[tuple[yaml.Node, str]] = [(root, "")]
    seen_nodes: set[int] = set()  # an alias points at a node already walked
    while stack:
        node, path = stack.pop()
        if id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        if isinstance(node, yaml.MappingNode):
            first: dict[tuple[str, str], int] = {}
            for key_node, value_node in node.value:
                if key_node.tag == MERGE_TAG:
                    continue
                name = key_node.value if isinstance(key_node, yaml.ScalarNode) else "?"
                where = f"{path}.{name}" if path else str(name)
                line = key_node.start_mark.line + 1
                if isinstance(key_node, yaml.ScalarNode):
                    identity = (key_node.tag, name)
                    if identity in first:
                        raise DuplicateKey(f"duplicate key {where} (line {line}; first at line "
                                          f"{first[identity]}): YAML would keep only the last")
                    first[identity] = line
                stack.append((value_node, where))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((item, f"{path}[{i}]") for i, item in enumerate(node.value))

"""YAML loading that remembers the line of every mapping key and list item, so validation
errors can say `FILE:LINE: field.path: problem` like a compiler does."""

from __future__ import annotations

import re
from typing import Any

import yaml

Loc = tuple[str | int, ...]


class _Loader(yaml.SafeLoader):
    """YAML 1.2 booleans: only true/false. YAML 1.1 would read the key `on:` as True."""


_Loader.yaml_implicit_resolvers = {
    ch: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:bool"]
    for ch, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def load_with_lines(text: str, name: str) -> tuple[Any, dict[Loc, int]]:
    """Parse `text`; return (data, {path: 1-based line}). Raises ValueError with FILE:LINE."""
    try:
        node = yaml.compose(text, Loader=_Loader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = mark.line + 1 if mark else 1
        raise ValueError(f"{name}:{line}: YAML syntax error: {e.problem or e}") from e
    if node is None:
        return None, {}
    lines: dict[Loc, int] = {}
    _index(node, (), lines)
    return yaml.load(text, Loader=_Loader), lines


def _index(node: yaml.Node, loc: Loc, lines: dict[Loc, int]) -> None:
    lines.setdefault(loc, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            k = (*loc, key.value)
            lines[k] = key.start_mark.line + 1
            _index(value, k, lines)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _index(item, (*loc, i), lines)


def line_for(lines: dict[Loc, int], loc: Loc) -> int:
    """The line of `loc`, or of its nearest ancestor present in the file."""
    while loc and loc not in lines:
        loc = loc[:-1]
    return lines.get(loc, 1)

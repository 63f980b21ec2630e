"""The one YAML reader for kvguard's hand-edited files: the daemon config, rules and scenarios.

Why one: the daemon re-reads these files into a running process on SIGHUP or /admin/reload,
and an operator edits them under pressure, so every file must be read by the same grammar and
every problem answered the same way: one `FILE:LINE: problem` line, never a traceback, quickly
and in bounded memory, whatever the file holds.

The grammar is YAML 1.2's core booleans (only true/false: the rules key `on:` stays a string,
`yes` is a string) without YAML 1.1 timestamps or `=` values, every mapping key given once, and
only the plain tags (`!!str`, `!!int`, ...): no `!!python/...`, `!!binary` or `!!set`.

Hostile files are refused before they cost anything:
- nesting deeper than MAX_DEPTH (the composer recurses: 5,000 `[` used to blow the stack);
- more than MAX_ALIASES aliases, or a document of more than MAX_NODES values counting each
  alias as what it expands to (a 300-byte "billion laughs" file used to take 2.5 GB before
  failing), checked as the document is composed, so a refusal comes before the cost;
- more than MAX_BYTES of text, bytes that are not UTF-8 and characters YAML forbids.
The line index walks each node once, so aliased subtrees are never walked again. libyaml
parses when PyYAML has it (a pure-Python scan of a large file takes seconds); composing stays
in Python, where the limits live.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from yaml.composer import Composer
from yaml.constructor import SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode
from yaml.resolver import Resolver

Loc = tuple[Any, ...]  # keys and list indices from the document root

MAX_BYTES = 1 << 20  # a hand-edited file is a few KB
MAX_DEPTH = 64  # nested lists/mappings
MAX_ALIASES = 100
MAX_NODES = 50_000  # values after expanding aliases, i.e. what a validator walks

_CORE = "tag:yaml.org,2002:"
_MERGE = _CORE + "merge"
_ALLOWED_TAGS = {_CORE + t for t in ("str", "int", "float", "bool", "null", "seq", "map")}
_DROPPED_RESOLVERS = {_CORE + t for t in ("bool", "timestamp", "value")}
# What the YAML spec allows in a stream (PyYAML's own reader uses the same set).
_NOT_PRINTABLE = re.compile(
    "[^\x09\x0a\x0d\x20-\x7e\x85\xa0-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]"
)


class YamlFileError(ValueError):
    """The file cannot be read as data; `errors` holds one `FILE:LINE: problem` line each."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("\n".join(errors))
        self.errors = errors


class _Refused(yaml.YAMLError):
    """A limit or a rule of our grammar broken at `mark`."""

    def __init__(self, mark: yaml.Mark, problem: str) -> None:
        super().__init__(problem)
        self.mark, self.problem = mark, problem


try:  # libyaml turns text into events about ten times faster than pure Python
    from yaml.cyaml import CParser

    class _Parsing(Composer, CParser, SafeConstructor, Resolver):  # Composer first: ours wins
        """libyaml's events, composed by PyYAML's Python Composer (which `_Loader` hooks)."""

        def __init__(self, stream: str) -> None:
            CParser.__init__(self, stream)
            Composer.__init__(self)
            SafeConstructor.__init__(self)
            Resolver.__init__(self)

except ImportError:  # a PyYAML built without libyaml: same results, slower
    _Parsing = yaml.SafeLoader  # type: ignore[misc,assignment]


class _Loader(_Parsing):
    """Safe loading with YAML 1.2 booleans, an allow-list of tags and the limits above."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self._depth = 0
        self._aliases = 0
        self._values = 0  # values composed so far, aliases counted as what they expand to
        self._sizes: dict[int, int] = {}  # id(node) -> values it expands to, once composed

    def compose_node(self, parent: Node | None, index: Any) -> Node:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            return self._alias(parent, index, event)
        if event.tag not in (None, "!") and event.tag not in _ALLOWED_TAGS:
            raise _Refused(event.start_mark, f"tag {_short(event.tag)} is not allowed {_PLAIN}")
        self._count(1, event.start_mark)
        node = super().compose_node(parent, index)
        children = node.value if isinstance(node, SequenceNode) else []
        if isinstance(node, MappingNode):
            children = [n for pair in node.value for n in pair]
        self._sizes[id(node)] = 1 + sum(self._sizes[id(child)] for child in children)
        return node

    def _alias(self, parent: Node | None, index: Any, event: yaml.AliasEvent) -> Node:
        self._aliases += 1
        if self._aliases > MAX_ALIASES:
            raise _Refused(
                event.start_mark, f"more than {MAX_ALIASES} aliases (expected at most that many)"
            )
        node = super().compose_node(parent, index)
        size = self._sizes.get(id(node))
        if size is None:
            raise _Refused(
                event.start_mark,
                f"alias *{event.anchor} refers to a node that contains it (expected no cycles)",
            )
        self._count(size, event.start_mark)
        return node

    def _count(self, values: int, mark: yaml.Mark) -> None:
        """Refuse as soon as the document grows past MAX_NODES values, counting each alias as
        the values it stands for: a validator would walk every one of them."""
        self._values += values
        if self._values > MAX_NODES:
            through = " after expanding aliases" if self._aliases else ""
            raise _Refused(mark, f"more than {MAX_NODES} values{through} (expected a smaller file)")

    def compose_sequence_node(self, anchor: str | None) -> Node:
        return self._nested(super().compose_sequence_node, anchor)

    def compose_mapping_node(self, anchor: str | None) -> Node:
        return self._nested(super().compose_mapping_node, anchor)

    def _nested(self, compose: Any, anchor: str | None) -> Node:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _Refused(
                    self.peek_event().start_mark,
                    f"nested more than {MAX_DEPTH} levels deep (expected a flatter file)",
                )
            return compose(anchor)
        finally:
            self._depth -= 1

    def construct_object(self, node: Node, deep: bool = False) -> Any:
        """Any failure while building a value (`!!int` of letters, a 5,000-digit number) is
        reported at its node instead of escaping as a bare ValueError or KeyError."""
        try:
            return super().construct_object(node, deep)
        except yaml.YAMLError:
            raise
        except Exception:  # noqa: BLE001 - turned into a located error
            shown = node.value if isinstance(node, ScalarNode) else node.id
            kind = _short(node.tag)
            raise _Refused(
                node.start_mark, f"{_cut(shown)!r} is not a valid {kind} (expected a {kind} value)"
            ) from None

    def construct_yaml_bool(self, node: ScalarNode) -> bool:
        value = self.construct_scalar(node)
        if value.lower() not in ("true", "false"):
            raise _Refused(
                node.start_mark, f"{_cut(value)!r} is not a boolean (expected true or false)"
            )
        return value.lower() == "true"


_PLAIN = "(expected plain YAML: strings, numbers, true/false, null, lists and mappings)"
_Loader.yaml_implicit_resolvers = {
    ch: [(tag, rx) for tag, rx in resolvers if tag not in _DROPPED_RESOLVERS]
    for ch, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    _CORE + "bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
_Loader.add_constructor(_CORE + "bool", _Loader.construct_yaml_bool)


def read_source(path: Path) -> bytes:
    """The file's bytes, at most MAX_BYTES + 1 of them (so /dev/zero cannot fill memory);
    OSError is the caller's to word."""
    with Path(path).open("rb") as f:
        return f.read(MAX_BYTES + 1)


def load_yaml(source: str | bytes, name: str) -> tuple[Any, dict[Loc, int]]:
    """Parse one document; return (data, {path: 1-based line of that key or item}).

    Raises YamlFileError: syntax errors, hostile content, or keys given twice (each of those
    listed, naming the line of the first)."""
    if len(source) > MAX_BYTES:
        raise YamlFileError([f"{name}:1: larger than {MAX_BYTES} bytes (expected a small file)"])
    text = _decode(source, name) if isinstance(source, bytes) else source
    bad = _NOT_PRINTABLE.search(text)
    if bad is not None:
        line = text.count("\n", 0, bad.start()) + 1
        raise YamlFileError(
            [
                f"{name}:{line}: character #x{ord(bad.group()):04x} is not allowed in YAML "
                "(expected printable text)"
            ]
        )
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, {}
        lines: dict[Loc, int] = {(): node.start_mark.line + 1}
        errors: list[str] = []
        _Index(loader, name, lines, errors).walk(node, ())
        if errors:
            raise YamlFileError(errors)
        return loader.construct_document(node), lines
    except _Refused as e:
        raise YamlFileError([f"{name}:{e.mark.line + 1}: {e.problem}"]) from None
    except yaml.MarkedYAMLError as e:
        raise YamlFileError([_syntax_error(e, name)]) from None
    except yaml.YAMLError as e:
        raise YamlFileError([f"{name}:1: YAML error: {e} (expected valid YAML)"]) from None
    finally:
        loader.dispose()


def line_for(lines: dict[Loc, int], loc: Loc) -> int:
    """The line of `loc`, or of its nearest ancestor present in the file."""
    while loc and loc not in lines:
        loc = loc[:-1]
    return lines.get(loc, 1)


def dotted(loc: Loc) -> str:
    return ".".join(str(p) for p in loc) or "(top level)"


class _Index:
    """Records the line of every key and list item, and refuses keys given twice. Each node
    is visited once: a subtree reached again through an alias keeps its first location."""

    def __init__(self, loader: _Loader, name: str, lines: dict[Loc, int], errors: list[str]):
        self.loader, self.name, self.lines, self.errors = loader, name, lines, errors
        self.seen: set[int] = set()

    def walk(self, node: Node, loc: Loc) -> None:
        if id(node) in self.seen:
            return
        self.seen.add(id(node))
        if isinstance(node, SequenceNode):
            for i, item in enumerate(node.value):
                self.lines[(*loc, i)] = item.start_mark.line + 1
                self.walk(item, (*loc, i))
        elif isinstance(node, MappingNode):
            first: dict[Any, int] = {}
            for key_node, value_node in node.value:
                key = self._key(key_node, loc)
                if key is _MERGED:
                    continue
                line = key_node.start_mark.line + 1
                if key in first:
                    self.errors.append(
                        f"{self.name}:{line}: {dotted((*loc, key))}: duplicate key "
                        f"(expected once; first given on line {first[key]})"
                    )
                    continue
                first[key] = self.lines[(*loc, key)] = line
                self.walk(value_node, (*loc, key))

    def _key(self, key_node: Node, loc: Loc) -> Any:
        if key_node.tag == _MERGE:
            return _MERGED  # `<<: *defaults`: its keys may be overridden, by YAML's rules
        if not isinstance(key_node, ScalarNode):
            raise _Refused(
                key_node.start_mark,
                f"{dotted(loc)}: a key must be a plain value (expected no list or mapping keys)",
            )
        return self.loader.construct_object(key_node)  # `1` and `1.0` are the same key


_MERGED = object()


def _decode(source: bytes, name: str) -> str:
    try:
        return source.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = source.count(b"\n", 0, e.start) + 1
        column = e.start - (source.rfind(b"\n", 0, e.start) + 1) + 1
        raise YamlFileError(
            [
                f"{name}:{line}: byte 0x{source[e.start]:02x} at column {column} is not UTF-8 "
                "(expected a UTF-8 text file)"
            ]
        ) from None


def _syntax_error(e: yaml.MarkedYAMLError, name: str) -> str:
    mark = e.problem_mark or e.context_mark
    line = mark.line + 1 if mark is not None else 1
    if "nesting depth" in str(e.problem):  # libyaml met it first, scanning ahead of us
        return f"{name}:{line}: nested more than {MAX_DEPTH} levels deep (expected a flatter file)"
    context = f" ({e.context})" if e.context else ""
    return f"{name}:{line}: YAML syntax error: {e.problem}{context} (expected valid YAML)"


def _short(tag: str | None) -> str:
    return "!!" + tag.removeprefix(_CORE) if tag and tag.startswith(_CORE) else repr(tag)


def _cut(text: Any) -> Any:
    return text if not isinstance(text, str) or len(text) <= 40 else text[:37] + "..."

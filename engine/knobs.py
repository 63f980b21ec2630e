"""Operator knobs, declared once, on the engine's own config fields.

An engine field that an operator may set from the daemon's config file carries a `Knob` in its
dataclass metadata: the file section it belongs to, a line of documentation, its allowed values
and bounds, and, rarely, another key or unit in the file. The engine validates itself from these
declarations, and the daemon builds its `serving`, `admission_control` and `offloading` sections
from them and maps the file back onto `EngineConfig` with the same table. A new knob is
therefore written once, next to the field it sets, and the engine, the config file and the
conversion between them cannot drift apart.

Plain data only: the engine knows nothing of pydantic, YAML or the daemon (the dependencies
point `kernels <- engine <- rules <- daemon`).
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

KNOB = "kvguard.knob"  # the dataclass metadata key that holds a field's Knob
MiB = 2**20
DEVICE_PATTERN = r"auto|cpu|cuda(:\d+)?"
DEVICE_EXPECTED = "auto, cpu, cuda or cuda:N"

T = TypeVar("T")
KnobPath = tuple[str, ...]  # a field's path from the top config: ("admission", "safety_factor")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and what was expected."""


class _Same:
    """Marks a knob whose config-file default is the engine's own default."""

    def __repr__(self) -> str:
        return "SAME"


SAME: Any = _Same()


@dataclass(frozen=True, slots=True, kw_only=True)
class Knob:
    """How one engine field appears in the daemon's config file, and what values it takes.

    Bounds and choices are in the engine's unit; the file's own bounds follow from `scale`.
    """

    section: str  # the config-file section: serving | admission_control | offloading
    doc: str  # why an operator would set it; becomes the field's description in the file schema
    choices: tuple[Any, ...] = ()
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    min_length: int = 0
    # How the file spells a value: "size" takes '256MiB', "duration" takes '10s' (the daemon
    # parses both), "device" is auto|cpu|cuda|cuda:N. "value" is the field's own type.
    kind: Literal["value", "size", "duration", "device"] = "value"
    key: str = ""  # the key in the file, where it differs from the field name (a unit in it)
    scale: int = 1  # engine value = file value × scale (reserved_headroom_mb → bytes)
    # The file's default, where serving operators want another than library users; None there
    # means "auto", resolved by the daemon (e.g. a headroom that depends on the device).
    file_default: Any = SAME
    # A reload (SIGHUP) applies it to the running engine; the others take effect at a restart.
    live: bool = False

    def expected(self) -> str:
        """What a valid value looks like, for error messages."""
        if self.choices:
            return "|".join(str(c) for c in self.choices)
        if self.kind == "device":
            return DEVICE_EXPECTED
        if self.min_length:
            return "a non-empty string"
        ops = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
        parts = [
            f"{op} {getattr(self, name)}" for name, op in ops if getattr(self, name) is not None
        ]
        return "a value " + " and ".join(parts) if parts else "any value"

    def accepts(self, value: Any) -> bool:
        """Whether an engine-side value is allowed; None (unset) is judged by the field's type."""
        if value is None:
            return True
        if self.choices:
            return value in self.choices
        if self.kind == "device":
            return isinstance(value, str) and re.fullmatch(DEVICE_PATTERN, value) is not None
        if self.min_length and len(value) < self.min_length:
            return False
        bounded = any(b is not None for b in (self.ge, self.gt, self.le, self.lt))
        if bounded and isinstance(value, float) and not math.isfinite(value):
            return False  # NaN passes every comparison; inf would pass a lower bound
        return not (
            (self.ge is not None and value < self.ge)
            or (self.gt is not None and value <= self.gt)
            or (self.le is not None and value > self.le)
            or (self.lt is not None and value >= self.lt)
        )


@dataclass(frozen=True, slots=True)
class KnobField:
    """One knob as found on a config dataclass: where it sits, its type and its default."""

    path: KnobPath  # from the top config class, e.g. ("admission", "reserved_headroom_bytes")
    knob: Knob
    type: Any  # the resolved annotation, e.g. `int | None`
    default: Any  # the engine's default (dataclasses.MISSING where it has none)

    @property
    def name(self) -> str:
        return self.path[-1]

    @property
    def file_key(self) -> str:
        """The key an operator writes in the knob's section of the config file."""
        return self.knob.key or self.name

    @property
    def file_default(self) -> Any:
        if self.knob.file_default is not SAME:
            return self.knob.file_default
        return self.to_file(self.default)

    def to_file(self, value: Any) -> Any:
        """An engine value in the file's unit."""
        if self.knob.scale == 1 or value is None:
            return value
        return value // self.knob.scale if value % self.knob.scale == 0 else value / self.knob.scale

    def to_engine(self, value: Any) -> Any:
        """A file value in the engine's unit."""
        return value if self.knob.scale == 1 or value is None else value * self.knob.scale


def knob(default: Any, **declaration: Any) -> Any:
    """A dataclass field with `default` that operators may set: `Knob(**declaration)`."""
    return dataclasses.field(default=default, metadata={KNOB: Knob(**declaration)})


def knob_fields(cls: type) -> list[KnobField]:
    """Every knob of a config dataclass, nested config dataclasses included, in field order."""
    hints = typing.get_type_hints(cls)
    out: list[KnobField] = []
    for f in dataclasses.fields(cls):
        spec = f.metadata.get(KNOB)
        if spec is not None:
            out.append(KnobField((f.name,), spec, hints[f.name], f.default))
            continue
        nested = nested_config(hints[f.name])
        if nested is not None:
            out += [dataclasses.replace(k, path=(f.name, *k.path)) for k in knob_fields(nested)]
    return out


def nested_config(annotation: Any) -> type | None:
    """The config dataclass in `X` or `X | None`, else None."""
    args = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    found = [a for a in args if isinstance(a, type) and dataclasses.is_dataclass(a)]
    return found[0] if len(found) == 1 else None


def check_knobs(config: Any) -> None:
    """Refuse the first field of `config` (not nested ones) whose value its knob does not accept."""
    for f in dataclasses.fields(config):
        spec: Knob | None = f.metadata.get(KNOB)
        value = getattr(config, f.name)
        if spec is not None and not spec.accepts(value):
            raise ConfigError(f"{f.name}={value!r}: expected {spec.expected()}")


def build(cls: type[T], values: Mapping[KnobPath, Any]) -> T:
    """`cls(...)` from values keyed by knob path; nested config dataclasses are built too.

    Fields without a value keep their defaults, so a caller passes only what it sets."""
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if (f.name,) in values:
            kwargs[f.name] = values[(f.name,)]
            continue
        inner = {p[1:]: v for p, v in values.items() if len(p) > 1 and p[0] == f.name}
        nested = nested_config(hints[f.name])
        if inner and nested is not None:
            kwargs[f.name] = build(nested, inner)
    return cls(**kwargs)

"""The daemon's YAML configuration: every key optional, every mistake reported with its line.

The file mirrors the seed's sections (`serving`, `admission_control`, `offloading`,
`quantization`, `recovery`, `monitoring`) plus the daemon's own (`api`, `rules`, `prometheus`,
`audit`). No file at all, or one that says `{}`, serves the default model on 127.0.0.1:8000;
a file that holds nothing (empty, or only comments) is refused, as an empty rules file is: a
truncated write read at a reload would else turn API-key auth off and swap the operator's rules
for the packaged ones.

An operator edits this file by hand, usually on a server and under pressure, so a bad file is
answered once with *every* problem as `FILE:LINE: section.field: problem (expected ...)` rather
than the first exception pydantic happens to raise. Line numbers come from the YAML node tree
(each mapping key's mark), matched to pydantic's error locations.

The seed's larger baselines ask for tensor and pipeline parallelism and 4-bit weights.
`serving.tensor_parallel` and `serving.pipeline_parallel` are engine knobs and are served (ranks
in worker processes spawned by the daemon), and so is `quantization.model_quantization` (4-bit
weights served packed; whether the checkpoint holds that format is checked when the model is
resolved, naming the file).
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import stat
import types
import typing
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails

from kvguard.daemon.cli_worker import KEY_CREDENTIAL as WORKER_KEY_CREDENTIAL
from kvguard.engine.config import ConfigError, DistributedConfig, EngineConfig, parse_bytes
from kvguard.engine.knobs import DEVICE_EXPECTED, DEVICE_PATTERN, KnobField, MiB, build, knob_fields
from kvguard.rules.durations import parse_duration
from kvguard.rules.yaml_file import YamlFileError, load_yaml, read_source

CUDA_HEADROOM_MB = 2048  # seed §7.1: room for activations beside the KV pool on a GPU
ADMIN_TOKEN_CREDENTIAL = "admin.token"  # name under $CREDENTIALS_DIRECTORY (systemd LoadCredential)
AUDIT_DB = "audit.db"  # the default SQLite audit database's name in the state directory
STATE_DIR_ENV = "KVGUARD_STATE_DIR"  # the state directory where systemd does not set one
SYSTEMD_STATE_DIR = Path("/var/lib/kvguard")  # $STATE_DIRECTORY under the shipped unit

Loc = tuple[str | int, ...]


@dataclass(frozen=True, slots=True)
class Where:
    """Turns an error location into the `FILE:LINE` (or `--flag`) an operator can act on."""

    name: str = ""  # the file; "" for built-in defaults
    lines: Mapping[Loc, int] = field(default_factory=dict)  # each key's line, 1-based
    flags: Mapping[Loc, str] = field(default_factory=dict)  # keys set from the command line
    # serving.model as the file wrote it, where it was made absolute (`_rebased_model`): the
    # name clients keep using unless api.served_model_name says another
    model_as_written: str | None = None

    def __call__(self, loc: Loc) -> str:
        for n in range(len(loc), 0, -1):
            if loc[:n] in self.flags:
                return self.flags[loc[:n]]
        for n in range(len(loc), -1, -1):  # an unset key points at its section
            if loc[:n] in self.lines:
                return f"{self.name}:{self.lines[loc[:n]]}"
        return self.name


class ConfigFileError(ValueError):
    """A config file (or a command-line override) is unusable; `errors` holds one line per problem."""

    def __init__(self, errors: list[str]) -> None:
        self.errors = errors
        super().__init__("\n".join(errors))


# -- value types ---------------------------------------------------------------------------------
# Durations (`parse_duration`, re-exported here) share one grammar with the rules file.


def _parse_size(value: Any) -> int:
    """Bytes from 268435456 or '256MiB', via the engine's own parser so both agree."""
    expected = "expected bytes as an integer or a size like '256MiB', '2GiB', '512MB'"
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"{value!r} is not a size ({expected})")
    try:
        n = parse_bytes(value)
    except ConfigError:
        raise ValueError(f"{value!r} is not a size ({expected})") from None
    if n <= 0:
        raise ValueError(f"{value!r} is not positive ({expected} above zero)")
    return n


def _check_device(value: Any) -> Any:
    if isinstance(value, str) and re.fullmatch(DEVICE_PATTERN, value):
        return value
    raise ValueError(f"{value!r} is not a device (expected {DEVICE_EXPECTED})")


Duration = Annotated[float, BeforeValidator(parse_duration)]
Size = Annotated[int, BeforeValidator(_parse_size)]
Device = Annotated[str, BeforeValidator(_check_device)]
Ratio = Annotated[float, Field(gt=0.0, le=1.0)]
OptPath = Annotated[Path | None, Field(strict=False)]

MIN_RETENTION_S = 3600.0  # audit.retention: shorter is a mistake (`90` meant as days), not a policy


def _parse_retention(value: Any) -> float:
    """`audit.retention`: a duration of at least an hour. A bare number is seconds, so
    `retention: 90` (90 days meant) would have the sweep at start delete all but the last 90
    seconds of the audit log."""
    seconds = parse_duration(value)
    if seconds < MIN_RETENTION_S:
        shown = repr(value) if len(repr(value)) <= 40 else f"{repr(value)[:37]}..."
        raise ValueError(
            f"{shown} keeps {seconds:g} seconds of audit history, below the minimum of 1h "
            "(a bare number is seconds: write e.g. '90d' for 90 days; expected a duration of "
            "at least 1h)"
        )
    return seconds


Retention = Annotated[float, BeforeValidator(_parse_retention)]


class _Section(BaseModel):
    # strict: `port: "8000"` or `enable: "yes"` is a typo worth reporting, not coercing.
    # No .inf/.nan: `safety_factor: .inf` would pass `ge=1.0` and refuse every request.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


# -- sections ------------------------------------------------------------------------------------
# The engine's knobs (kvguard.engine.knobs) as they appear in the file. `Size`, `Duration` and
# `Device` report a bad value in the operator's terms ("'256 megs' is not a size (expected ...)").
ENGINE_KNOBS = knob_fields(EngineConfig)
_FILE_KINDS: dict[str, Any] = {"size": Size, "duration": Duration, "device": Device}


def _knob_field(k: KnobField) -> tuple[Any, Any]:
    """The pydantic (type, FieldInfo) an engine knob gets in its config-file section."""
    spec = k.knob
    base = _FILE_KINDS.get(spec.kind) or _non_optional(k.type)
    if spec.choices:
        base = Literal[spec.choices]  # type: ignore[valid-type]
    optional = k.file_default is None or type(None) in typing.get_args(k.type)
    bounds = {
        name: k.to_file(getattr(spec, name))
        for name in ("ge", "gt", "le", "lt")
        if getattr(spec, name) is not None
    }
    if spec.min_length:
        bounds["min_length"] = spec.min_length
    info = Field(k.file_default, description=spec.doc, **bounds)
    return (base | None if optional else base), info


def _non_optional(annotation: Any) -> Any:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if isinstance(annotation, types.UnionType) and len(args) == 1 else annotation


def _knob_section(section: str) -> type[_Section]:
    """A section model holding every engine knob declared for `section`, in declaration order.

    The section classes below subclass it to add what only the daemon knows (keys it accepts but
    refuses to serve, checks across keys), so each engine knob is defined once, on EngineConfig.
    """
    fields = {k.file_key: _knob_field(k) for k in ENGINE_KNOBS if k.knob.section == section}
    return create_model(f"_{section}_knobs", __base__=_Section, **fields)  # type: ignore[call-overload]


class DistributedSection(_Section):
    """`serving.distributed`: ranks on other hosts (`kvguard worker`) and where they meet the
    daemon (see kvguard.engine.config.DistributedConfig)."""

    remote_ranks: list[int] = []
    master_addr: str = "127.0.0.1"
    master_port: int = Field(0, ge=0, le=65535)
    interface: str = "lo"
    allow_network: bool = False
    join_timeout: Duration = Field(600.0, gt=0.0)
    # null: the systemd credential $CREDENTIALS_DIRECTORY/worker.key if present, where
    # `kvguard worker` looks too. The unit's DynamicUser cannot read a root-only key under
    # /etc; systemd's LoadCredential= hands it a copy only the service can read.
    authkey_file: OptPath = None

    def authkey_path(self) -> Path | None:
        """The worker key the daemon reads when remote ranks join, or None when there is none."""
        if self.authkey_file is not None:
            return self.authkey_file
        return _credential(WORKER_KEY_CREDENTIAL)

    def to_engine(self) -> DistributedConfig:
        d = self.model_dump()
        d["remote_ranks"] = tuple(d["remote_ranks"])
        d["join_timeout_s"] = d.pop("join_timeout")
        d["authkey_file"] = self.authkey_path()
        return DistributedConfig(**d)


class ServingConfig(_knob_section("serving")):  # type: ignore[misc]
    """The model and the engine's knobs (seed §7 `serving`), declared on EngineConfig."""

    distributed: DistributedSection = DistributedSection()

    @model_validator(mode="after")
    def _whole_prompt_fits(self) -> ServingConfig:
        """Without chunking a prompt is prefilled in one step, so a step must hold the longest.
        Checked after the section, so that defaults count too (`enable_chunked_prefill: false`
        alone leaves the default step budget below the default max_model_len): the error
        points at max_num_batched_tokens when the file sets it, else at the line that turned
        chunking off."""
        budget, limit = self.max_num_batched_tokens, self.max_model_len
        if self.enable_chunked_prefill or budget >= limit:
            return self
        if "max_num_batched_tokens" in self.model_fields_set:
            key, value = "max_num_batched_tokens", budget
            why = (
                f"{budget} < max_model_len {limit} with chunked prefill off "
                f"(expected >= {limit}, or enable_chunked_prefill: true)"
            )
        else:
            key, value = "enable_chunked_prefill", False
            why = (
                f"false leaves max_num_batched_tokens at its default {budget}, below "
                f"max_model_len {limit}: without chunked prefill a whole prompt must fit one "
                f"step (expected max_num_batched_tokens: {limit} or more, or "
                "enable_chunked_prefill: true)"
            )
        error = {"type": "value_error", "loc": (key,), "input": value, "ctx": {"error": why}}
        raise ValidationError.from_exception_data(type(self).__name__, [error])  # type: ignore[list-item]


class AdmissionControlConfig(_knob_section("admission_control")):  # type: ignore[misc]
    """Seed §5: project each request's KV peak before admitting it (AdmissionConfig's knobs)."""


class OffloadingConfig(_knob_section("offloading")):  # type: ignore[misc]
    """Seed §7.2: swap preempted sequences' KV to host memory instead of recomputing."""


class QuantizationConfig(_knob_section("quantization")):  # type: ignore[misc]
    """Seed §7.3 weight quantisation (`model_quantization`, declared on EngineConfig): 4-bit
    checkpoints and GGUF Q4/Q8 weights are served packed."""


# Keys of the brief's config format that kvguard accepts, so its baselines load as written, but
# does not act on: what they meant is set in the rules file (rules.path). A file that sets one
# is told so at start (`inert_keys`).
INERT = {
    "recovery.target_vram_usage": "recovery is each rule's recover_below in the rules file",
    "recovery.throttle_threshold": "load is limited by each rule's `above` in the rules file",
    "monitoring.oom_alert_threshold": "the GPU memory rule's `above` in the rules file decides",
    "monitoring.snapshot_interval": "gauges are read from the engine's latest step at each scrape",
}


def inert_keys(cfg: DaemonConfig) -> list[str]:
    """One line for each key of `INERT` the file sets: it changes nothing, and why."""
    return [
        f"{name} has no effect in kvguard ({why}); it is accepted so the brief's configs load "
        "as written"
        for name, why in INERT.items()
        if name.split(".")[1] in getattr(cfg, name.split(".")[0]).model_fields_set
    ]


class RecoveryConfig(_Section):
    """Seed §7.1 thresholds, accepted and inert (`INERT`): the rules file sets when load is
    limited and when it recovers."""

    target_vram_usage: Ratio = 0.80
    throttle_threshold: Ratio = 0.90

    @field_validator("throttle_threshold")
    @classmethod
    def _above_target(cls, v: float, info: ValidationInfo) -> float:
        target = info.data.get("target_vram_usage")
        if target is not None and v <= target:
            raise ValueError(f"{v} <= target_vram_usage {target} (expected a ratio above it)")
        return v


MIN_NVML_POLL_INTERVAL = 0.05  # seconds, the rules file's shortest `interval` (MIN_INTERVAL)


class MonitoringConfig(_Section):
    """How often NVML is sampled. `oom_alert_threshold` and `snapshot_interval` are the brief's,
    accepted and inert (`INERT`)."""

    oom_alert_threshold: Ratio = 0.90
    nvml_poll_interval: Duration = 5.0
    snapshot_interval: Annotated[Duration, Field(gt=0)] = 1.0

    @field_validator("nvml_poll_interval")
    @classmethod
    def _poll_bound(cls, v: float) -> float:
        """At least MIN_NVML_POLL_INTERVAL: below it a typo ('5ms' for '5s'), and a busy loop
        of NVML reads on the control plane's thread, as a rules file's interval would be."""
        if v < MIN_NVML_POLL_INTERVAL:
            raise ValueError(
                f"{v:g}s is too short (expected at least {MIN_NVML_POLL_INTERVAL * 1e3:g}ms)"
            )
        return v


MIN_REQUEST_READ_TIMEOUT = 1.0  # seconds: below it a typo ('20ms' for '20s') cuts slow links
MIN_REQUEST_BYTES = 4 * 2**10  # below it a unit typo (16 meant as MiB) refuses every request
# A host name: dot-separated labels of letters, digits, '-' and '_' (not at a label's ends).
_HOST_NAME = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9_-]{1,63}(?<!-))*\.?")


def _host_problem(host: str) -> str | None:
    """Why `host` is not an address or host name the API can bind (None: it is one). A
    scheme, a port or a comment written inside quotes would only fail at the bind, after the
    start said nothing of the file, and under systemd as a failure worth restarting."""
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        pass
    if len(host) <= 253 and _HOST_NAME.fullmatch(host):
        return None
    shown = repr(host) if len(repr(host)) <= 60 else f"{repr(host)[:57]}..."
    return (
        f"{shown} is not an address or host name (expected e.g. 127.0.0.1, 0.0.0.0, ::, "
        "localhost; the port is api.port)"
    )


class ApiConfig(_Section):
    """The HTTP listener. Loopback by default: exposing a model server is a deliberate act."""

    host: str = Field("127.0.0.1", min_length=1)
    port: int = Field(8000, ge=0, le=65535)  # 0: any free port (tests)
    # null: the systemd credential $CREDENTIALS_DIRECTORY/admin.token if present (an empty one
    # turns /admin/* off with a warning, as an empty file does), else /admin/* is disabled. A
    # default path under /etc would not be readable by the DynamicUser the unit runs as;
    # systemd's LoadCredential= hands it over safely.
    admin_token_file: OptPath = None
    # null: the OpenAI endpoints are open and a client may ask for any priority. Set it (a
    # YAML file of key digests, daemon/api_keys.py; `kvguard keys add`) on any network where
    # not every client may claim `high`. Re-read on SIGHUP.
    api_keys_file: OptPath = None
    drain_timeout: Duration = 30.0
    # The largest body /v1/*, /tokenize and /detokenize take (413 above it, read no further):
    # 256 prompts of 4096 tokens as id lists are about 8 MiB. Read at start only.
    max_request_bytes: Size = 16 * 2**20
    # How long a client may take to send a request: its request line and headers whole (from
    # its first byte; a new connection's first request from the connect), and each pause in
    # its body. Past it the connection is closed: one that never finishes its request would
    # hold a file descriptor for ever, and a thousand of them leave the daemon none to accept
    # with. Idle keep-alive connections close after 5 s, as before. Read at start only.
    request_read_timeout: Duration = 20.0
    # How long the daemon may be unable to send any of an answer because its client reads
    # none (the socket's buffers full). Past it the connection is closed and a request still
    # running for it aborted, as a hang-up is: a client that stopped reading held its answer's
    # memory, a file descriptor and its API key's slots for ever. Read at start only.
    response_write_timeout: Duration = 60.0
    # The most HTTP connections served at once. Past it an API request on a new connection is
    # answered 503 with Retry-After (naming this key) and closed, the operator's served a few at
    # once (service.OPERATOR_SPARE); those open are served as before. Each holds a
    # file descriptor, and past the open files limit the daemon could accept no one and its
    # audit database, model files and workers could open nothing. null: sized at start from
    # that limit, less the descriptors held then and a reserve (service.connection_cap).
    # Read at start only.
    max_connections: int | None = Field(None, ge=1)
    served_model_name: str | None = Field(None, min_length=1)
    # A special token's text written in a chat message (`<|im_end|>`, `<|im_start|>system`)
    # becomes that control token, as Hugging Face's templates and other servers make it: a
    # client can close its turn and open another. refuse: a request whose messages or tools
    # write one into the prompt (checked as the template is given them) answers 400 naming the
    # field and the token. A reload applies it.
    special_tokens_in_messages: Literal["allow", "refuse"] = "allow"
    # auto: a request that leaves temperature, top_p, top_k or max_tokens out gets the model's
    # own default from its generation_config.json, as transformers' generate() and vLLM take
    # them (the model's makers tuned them); none: OpenAI's defaults, whatever the model's files
    # say. Read at start only.
    generation_config: Literal["auto", "none"] = "auto"
    # /admin/debug/* (stall the engine, inject OOMs) for tests and benchmarks; off, they are 404.
    # Read at start only: a reload does not mount or unmount them.
    debug_hooks: bool = False

    @field_validator("host")
    @classmethod
    def _bindable_host(cls, v: str) -> str:
        """An IP literal or a host name: anything else fails the bind, not the file's check."""
        if (problem := _host_problem(v)) is not None:
            raise ValueError(problem)
        return v

    @field_validator("max_request_bytes")
    @classmethod
    def _request_bytes_floor(cls, v: int) -> int:
        """At least MIN_REQUEST_BYTES: a bare number is bytes, so `16` meant as MiB would
        answer every request 413."""
        if v < MIN_REQUEST_BYTES:
            raise ValueError(
                f"{v} bytes is too small: no request fits (a bare number is bytes: write e.g. "
                f"'16MiB'; expected at least {MIN_REQUEST_BYTES // 2**10}KiB)"
            )
        return v

    @field_validator("request_read_timeout", "response_write_timeout")
    @classmethod
    def _read_timeout_bound(cls, v: float) -> float:
        """At least MIN_REQUEST_READ_TIMEOUT: a client on a slow or busy link needs time to
        send its headers, or to read its answer, and a unit typo would close every connection
        that does."""
        if v < MIN_REQUEST_READ_TIMEOUT:
            raise ValueError(
                f"{v:g}s is too short (expected at least {MIN_REQUEST_READ_TIMEOUT:g}s)"
            )
        return v

    def admin_token_path(self) -> Path | None:
        """The token file to read, or None when the admin API is off."""
        if self.admin_token_file is not None:
            return self.admin_token_file
        return _credential(ADMIN_TOKEN_CREDENTIAL)


class RulesConfig(_Section):
    path: OptPath = None  # null: the packaged default rules
    dry_run: bool = False  # record what would have been done, change nothing


class PrometheusConfig(_Section):
    # null: PromQL signals are unknown. A path and query parameters (a proxy's ?token=) are
    # kept: /api/v1/query goes after the path, the parameters with every query.
    url: str | None = None
    timeout: Annotated[Duration, Field(gt=0)] = 2.0
    instance: str | None = Field(None, min_length=1)  # null: "<hostname>:<api.port>"

    @field_validator("url")
    @classmethod
    def _queryable_url(cls, v: str | None) -> str | None:
        """A URL no query could reach (not http(s), a #fragment that cuts a token, a parameter
        that would override kvguard's own) is refused with the file's line now, not found out
        rule tick by rule tick; the message masks the URL's secrets, as the log does."""
        if v is not None:
            from kvguard.rules.signals import url_problem

            if (problem := url_problem(v)) is not None:
                raise ValueError(problem)
        return v


class AuditConfig(_Section):
    url: str | None = Field(None, min_length=1)  # any SQLAlchemy URL; null: SQLite, see audit_url
    retention: Retention = 90 * 86400.0
    # Tags this daemon's rows; daemons sharing one database (and perhaps a host) need distinct
    # names. null: the hostname.
    instance: str | None = Field(None, min_length=1, max_length=255)

    @field_validator("instance")
    @classmethod
    def _printable_instance(cls, v: str | None) -> str | None:
        """A control character (a NUL, which PostgreSQL's text columns refuse; a newline, which
        would split log lines and tables) is refused: every row and filter carries this name."""
        if v is not None and (bad := [c for c in v if unicodedata.category(c) == "Cc"]):
            raise ValueError(
                f"{v!r} contains the control character {bad[0]!r} (expected a name of "
                "printable characters)"
            )
        return v

    @field_validator("url")
    @classmethod
    def _usable_url(cls, v: str | None) -> str | None:
        """A URL SQLAlchemy cannot parse, or whose backend or driver is not installed, is
        refused with the file's line now, not after the port is bound and the model loaded."""
        if v is not None:
            from kvguard.daemon.audit_migrate import check_url  # SQLAlchemy: only when set

            check_url(v)
        return v


class DaemonConfig(_Section):
    """The whole file; immutable, so a reload swaps it whole instead of mutating it in place."""

    serving: ServingConfig = ServingConfig()
    admission_control: AdmissionControlConfig = AdmissionControlConfig()
    offloading: OffloadingConfig = OffloadingConfig()
    quantization: QuantizationConfig = QuantizationConfig()
    recovery: RecoveryConfig = RecoveryConfig()
    monitoring: MonitoringConfig = MonitoringConfig()
    api: ApiConfig = ApiConfig()
    rules: RulesConfig = RulesConfig()
    prometheus: PrometheusConfig = PrometheusConfig()
    audit: AuditConfig = AuditConfig()

    _where: Where = PrivateAttr(default_factory=Where)

    @model_validator(mode="before")
    @classmethod
    def _empty_sections(cls, data: Any) -> Any:
        """`serving:` with nothing under it (YAML null) means that section's defaults."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data

    def check_start(self, running: str | None = None) -> EngineConfig:
        """Everything a start refuses beyond the file's own checks, as `FILE:LINE: key:
        problem` lines (ConfigFileError): what the engine cannot serve (`to_engine_config`)
        and the files the daemon reads (`READ_FILES`) that it cannot read. A start runs it
        before it binds the port, and a reload before it changes anything, so that a reload
        never takes a file the next start would refuse. `running`: on a reload, the device in
        force (serving.device changes only at a restart), which the live knobs must suit too."""
        problems = self._unservable(running) + self._unloadable() + self._unreadable()
        if problems:
            raise ConfigFileError([self._line(loc, msg) for loc, msg in problems])
        try:
            return self.to_engine_config()
        except ConfigError as e:  # the engine's own cross-checks: no line to point at
            raise ConfigFileError([f"{self._where.name or '(built-in defaults)'}: {e}"]) from None

    def _unreadable(self) -> list[tuple[Loc, str]]:
        out: list[tuple[Loc, str]] = []
        for loc in READ_FILES:
            path = _value_at(self, loc)
            why = None if path is None else _cannot_read(path)
            if why is not None:
                out.append((loc, why))
        return out + self._unusable_authkey()

    def _unusable_authkey(self) -> list[tuple[Loc, str]]:
        """The worker key, where remote ranks must prove they hold it: one the daemon cannot
        read would fail the start only after the bind and the model's load, and an empty one
        is no secret (anyone passes the rendezvous's HMAC challenge with an empty key), so it
        is refused as `kvguard worker` refuses one. No key at all is `_network_problem`'s."""
        d = self.serving.distributed
        path = d.authkey_path()
        if not d.remote_ranks or path is None:
            return []
        why = _cannot_read(path) or _empty_key(path)
        if why is None:
            return []
        if d.authkey_file is not None and os.path.exists(path) and not os.access(path, os.R_OK):
            why += (
                " (under systemd the service's dynamic user cannot read a root-only file: leave "
                f"authkey_file unset and load it with LoadCredential={WORKER_KEY_CREDENTIAL}:{path})"
            )
        return [(AUTHKEY, why)]

    def _unloadable(self) -> list[tuple[Loc, str]]:
        """What the engine would refuse as it loads, found without loading anything: a model
        that is no known name, model directory or .gguf file, and a CUDA device on a host
        where torch finds none, or fewer GPUs than the ranks it runs here. (Whether the files
        of a model directory serve is the load's to say.)"""
        from kvguard.engine.model_registry import KNOWN_MODELS  # torch: serve has it already

        out: list[tuple[Loc, str]] = []
        model = self.serving.model
        path = Path(model).expanduser()
        if model not in KNOWN_MODELS and not _model_path(path):
            what = "is not a model directory or a .gguf file" if path.exists() else "does not exist"
            out.append(
                (
                    ("serving", "model"),
                    f"{model!r} is not a known model ({', '.join(KNOWN_MODELS)}) and as a path "
                    f"{what} (expected a known name, a model directory or a .gguf file)",
                )
            )
        return out + self._gpu_problem()

    def _gpu_problem(self) -> list[tuple[Loc, str]]:
        """A `cuda:N` torch does not see, and on CUDA fewer GPUs than the ranks this host runs:
        each takes one of its own (`rank_device`), so fewer would fail the start after the
        bind, or stack ranks on one card, each sizing its KV pool as if the card were its own."""
        device = self.serving.device
        if not _uses_cuda(device):
            return []
        count = _cuda_devices()
        out: list[tuple[Loc, str]] = []
        index = int(device.partition(":")[2] or 0)
        if index >= count:
            found = _gpus(count, "CUDA device") if count else "no CUDA"
            out.append(
                (
                    ("serving", "device"),
                    f"{device!r}: torch finds {found} on this host, where {self._gpus_needed()} "
                    "(expected cpu or auto" + (f", or cuda:0..{count - 1})" if count else ")"),
                )
            )
        if 0 < count < self._local_ranks():
            key = "tensor_parallel" if self.serving.tensor_parallel > 1 else "pipeline_parallel"
            out.append(
                (
                    ("serving", key),
                    f"{self._gpus_needed()}, and torch sees {count} (expected at most "
                    f"{_gpus(count, 'rank')} on this host: lower tensor_parallel or "
                    "pipeline_parallel, list the ranks other hosts run in "
                    "serving.distributed.remote_ranks, or make more GPUs visible)",
                )
            )
        return out

    def _local_ranks(self) -> int:
        """The ranks this host runs: the tensor x pipeline world less the remote ranks."""
        s = self.serving
        return s.tensor_parallel * s.pipeline_parallel - len(s.distributed.remote_ranks)

    def _gpus_needed(self) -> str:
        """How many GPUs the config needs on this host, and why, in the file's keys."""
        local = self._local_ranks()
        if local == 1:
            return "this config needs 1 GPU"
        s = self.serving
        said = f"tensor_parallel {s.tensor_parallel} x pipeline_parallel {s.pipeline_parallel}"
        remote = len(s.distributed.remote_ranks)
        if remote:
            said += f" less {remote} in serving.distributed.remote_ranks"
        return f"this config needs {_gpus(local)}, one per rank it runs here ({said})"

    def to_engine_config(self) -> EngineConfig:
        """The engine's config; refuses what the engine cannot serve, naming the key and line."""
        problems = self._unservable()
        if problems:
            raise ConfigFileError([self._line(loc, msg) for loc, msg in problems])
        engine = build(
            EngineConfig, {k.path: k.to_engine(self.knob_value(k)) for k in ENGINE_KNOBS}
        )
        return replace(engine, distributed=self.serving.distributed.to_engine())

    def knob_value(self, k: KnobField, device: str | None = None) -> Any:
        """An engine knob's value as the file gives it; a null meaning "auto" is resolved here,
        for `device` (on a reload, the one in force: serving.device waits for a restart) or
        else the file's own."""
        if k.path == ("admission", "reserved_headroom_bytes"):
            return self.reserved_headroom_mb(device)
        return getattr(getattr(self, k.knob.section), k.file_key)

    def reserved_headroom_mb(self, device: str | None = None) -> int:
        """The configured headroom, or the auto value for `device` (default: the file's)."""
        mb = self.admission_control.reserved_headroom_mb
        if mb is not None:
            return mb
        return CUDA_HEADROOM_MB if _uses_cuda(device or self.serving.device) else 0

    def _unservable(self, running: str | None = None) -> list[tuple[Loc, str]]:
        s = self.serving
        out: list[tuple[Loc, str]] = []
        layers = s.pipeline_layers
        if layers is not None and (len(layers) != s.pipeline_parallel or min(layers) < 1):
            out.append(
                (
                    ("serving", "pipeline_layers"),
                    f"{layers} does not split the layers into pipeline_parallel="
                    f"{s.pipeline_parallel} stages (expected {s.pipeline_parallel} layer counts, "
                    "each at least 1)",
                )
            )
        return out + self._network_problem() + self._headroom_problem(running)

    def _network_problem(self) -> list[tuple[Loc, str]]:
        """Remote ranks need a key, and a network address needs the operator's yes."""
        d, world = self.serving.distributed, self.serving.tensor_parallel
        world *= self.serving.pipeline_parallel
        try:
            d.to_engine().validate(world, self.serving.tensor_parallel)
        except ConfigError as e:
            key = "master_addr" if "master_addr" in str(e) else "remote_ranks"
            key = "authkey_file" if "authkey_file" in str(e) else key
            why = str(e).removeprefix(f"distributed.{key}").lstrip("= ")
            if key == "authkey_file":  # `kvguard worker`'s default place serves here too
                why += (
                    f" (or, under systemd, the credential {WORKER_KEY_CREDENTIAL}: "
                    f"LoadCredential={WORKER_KEY_CREDENTIAL}:/etc/kvguard/{WORKER_KEY_CREDENTIAL})"
                )
            return [(("serving", "distributed", key), why)]
        return []

    def _headroom_problem(self, running: str | None = None) -> list[tuple[Loc, str]]:
        """On CPU the pool is kv_cache_bytes; a headroom as large would refuse every request.
        `running`: on a reload, the device in force, which the headroom applies to at once."""
        mb = self.admission_control.reserved_headroom_mb
        budget = self.serving.kv_cache_bytes
        if mb is None or mb * MiB < budget:
            return []
        if not _uses_cuda(self.serving.device):
            why = ""
        elif running is not None and not _uses_cuda(running):
            why = f" of the engine in force ({running}: serving.device changes at a restart)"
        else:
            return []
        return [
            (
                ("admission_control", "reserved_headroom_mb"),
                f"{mb} MiB leaves nothing of the {budget / MiB:g} MiB CPU KV budget{why} "
                "(serving.kv_cache_bytes), so every request would be refused "
                "(expected well below it, e.g. 0..16 on CPU)",
            )
        ]

    def _line(self, loc: Loc, msg: str) -> str:
        where = self._where(loc)
        return f"{where + ': ' if where else ''}{_dotted(loc)}: {msg}"

    def audit_url(self, cli: bool = False) -> str:
        """The audit database: as configured, else SQLite in the state directory (`state_dir`;
        `cli`: as `kvguard audit`/`kvguard db` look for it from an operator's shell)."""
        if self.audit.url:
            return self.audit.url
        return f"sqlite:///{state_dir(cli) / AUDIT_DB}"

    def served_model_name(self) -> str:
        """The name clients put in `model` and see in /v1/models."""
        return self.api.served_model_name or self._where.model_as_written or self.serving.model

    def prometheus_instance(self, port: int | None = None) -> str:
        """The value substituted for `$instance` in PromQL signals (and an alert's `instance`
        label that is this daemon's): `prometheus.instance`, else host:port, the port being the
        one the API is bound to (`port`: the kernel's pick where `api.port` is 0)."""
        return self.prometheus.instance or f"{socket.gethostname()}:{port or self.api.port}"


AUTHKEY: Loc = ("serving", "distributed", "authkey_file")
# Paths the file names: a relative one is relative to the config file's directory, not to the
# daemon's working directory (the unit runs it in its state directory, /var/lib/kvguard).
PATH_KEYS: tuple[Loc, ...] = (
    ("api", "admin_token_file"),
    ("api", "api_keys_file"),
    ("rules", "path"),
    AUTHKEY,
)
# Files a start (and a reload) refuses to go without: the rules and the API keys, and the
# worker key where remote ranks are listed (`_unusable_authkey`: it may be a credential). An
# unusable admin token turns the admin API off with a warning instead (Service.warn_admin_token).
READ_FILES: tuple[Loc, ...] = (("rules", "path"), ("api", "api_keys_file"))


def _credential(name: str) -> Path | None:
    """systemd's credential `name` (LoadCredential=) where the unit loaded one, else None. An
    empty one counts: it is then reported as empty, not taken for no credential at all."""
    creds = os.environ.get("CREDENTIALS_DIRECTORY")
    if not creds:
        return None
    path = Path(creds) / name
    return path if os.path.exists(path) else None


def _cannot_read(path: Path) -> str | None:
    """Why the daemon cannot read the file at `path`, or None; found without reading it."""
    try:
        folder = stat.S_ISDIR(path.stat().st_mode)
    except OSError as e:
        return f"cannot read {path}: {e.strerror or e}"
    if folder:  # a pipe or a device may hold a file's text; a folder never does
        return f"cannot read {path}: a directory, not a file"
    if not os.access(path, os.R_OK):
        return f"cannot read {path}: permission denied"
    return None


def _empty_key(path: Path) -> str | None:
    """Why the worker key at `path` is no secret (nothing but whitespace), or None."""
    try:
        empty = not path.read_bytes().strip()  # as the rendezvous reads it
    except OSError as e:
        return f"cannot read {path}: {e.strerror or e}"
    if not empty:
        return None
    return (
        f"{path} is empty: any client would pass the rendezvous's challenge with an empty key "
        "(expected the secret shared with every kvguard worker, e.g. written with "
        "`head -c 32 /dev/urandom | base64`)"
    )


def _value_at(model: BaseModel, loc: Loc) -> Any:
    for part in loc:
        model = getattr(model, str(part))
    return model


def _rebased(model: Any, loc: Loc, base: Path) -> Any:
    """`model` with the relative path at `loc` made absolute under `base`; unchanged if none."""
    head, rest = str(loc[0]), loc[1:]
    value = getattr(model, head)
    if rest:
        new = _rebased(value, rest, base)
    elif isinstance(value, Path) and not value.is_absolute():
        new = Path(os.path.normpath(base / value))  # `../x` shown as the file it names
    else:
        return model
    return model if new is value else model.model_copy(update={head: new})


def _model_path(path: Path) -> bool:
    """Whether `path` names what `serving.model` may name besides a known model: a model
    directory or a .gguf file."""
    return path.is_dir() or (path.suffix.lower() == ".gguf" and path.is_file())


def _rebased_model(cfg: DaemonConfig, base: Path) -> DaemonConfig:
    """`serving.model` as a relative path made absolute under `base` (the config file's
    folder), as the paths in PATH_KEYS are, when it names a model directory or .gguf file
    there; a known model's name, and a path found nowhere under `base`, are left as written."""
    model = cfg.serving.model
    path = Path(model)
    if path.is_absolute() or model.startswith("~"):
        return cfg
    there = Path(os.path.normpath(base / path))
    if not _model_path(there):
        return cfg
    from kvguard.engine.model_registry import KNOWN_MODELS  # torch: only for such a path

    if model in KNOWN_MODELS:  # a known name wins, as it does on the command line
        return cfg
    serving = cfg.serving.model_copy(update={"model": str(there)})
    out = cfg.model_copy(update={"serving": serving})
    out._where = replace(cfg._where, model_as_written=model)  # still served under that name
    return out


def _cuda_devices() -> int:
    """How many CUDA devices torch can use on this host (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _gpus(n: int, what: str = "GPU") -> str:
    return f"{n} {what}{'s' if n != 1 else ''}"


def _uses_cuda(device: str) -> bool:
    """Whether the engine will run on CUDA; `auto` asks torch, as the engine itself will."""
    if device != "auto":
        return device.startswith("cuda")
    import torch

    return torch.cuda.is_available()


def state_dir(cli: bool = False) -> Path:
    """Where the default audit database (and its spill file) lives: systemd's StateDirectory=
    (first entry of $STATE_DIRECTORY), else $KVGUARD_STATE_DIR, else ./var/ (absolute).

    `cli`: for `kvguard audit` and `kvguard db`, run from an operator's shell, where systemd's
    variable is unset: before ./var/ they look in the shipped unit's state directory,
    /var/lib/kvguard, when a database is there, so that they read the daemon's."""
    env = os.environ.get("STATE_DIRECTORY", "").split(":")[0]
    if env:
        return Path(env)
    own = os.environ.get(STATE_DIR_ENV, "")
    if own:
        return Path(own).resolve()
    if cli and (SYSTEMD_STATE_DIR / AUDIT_DB).is_file():
        return SYSTEMD_STATE_DIR
    return Path("var").resolve()


# -- loading -------------------------------------------------------------------------------------
EMPTY_FILE = "the config file holds nothing, or only comments (for the built-in defaults, write {})"


def load_config(path: Path | None) -> DaemonConfig:
    """Read and validate a config file; None (no --config) gives the defaults."""
    if path is None:
        return DaemonConfig()
    path = Path(path)
    try:
        source = read_source(path)
    except OSError as e:
        raise ConfigFileError([f"{path}: cannot read the config file: {e}"]) from None
    try:
        data, lines = load_yaml(source, str(path))  # the rules file's loader and grammar
    except YamlFileError as e:
        raise ConfigFileError(e.errors) from None
    if data is None:  # a file emptied by mistake would read as every default: auth off
        raise ConfigFileError([f"{path}:1: {EMPTY_FILE}"])
    cfg = _validate(data, Where(str(path), lines))
    base = Path(os.path.abspath(path)).parent  # relative paths in it are relative to it
    moved = _left_in_the_cwd(cfg, base)
    if moved:
        raise ConfigFileError(moved)
    for loc in PATH_KEYS:
        cfg = _rebased(cfg, loc, base)
    if "model" in cfg.serving.model_fields_set:
        cfg = _rebased_model(cfg, base)
    return _rebased_audit_url(cfg, base)


def _left_in_the_cwd(cfg: DaemonConfig, base: Path) -> list[str]:
    """An error for each relative file path (PATH_KEYS, a SQLite `audit.url`) that names
    nothing under `base` while a file of that name is in the working directory. Older kvguard
    read such paths from the working directory: a config kept across the upgrade would else
    quietly name other files, a new, empty audit database and a token file that is not there
    (the admin API off). `serving.model` has no such trap: one not found under `base` is still
    read from the working directory (`_rebased_model`)."""
    found: list[tuple[Loc, str, Path]] = []
    for loc in PATH_KEYS:
        value = _value_at(cfg, loc)
        if isinstance(value, Path) and not value.is_absolute():
            found.append((loc, str(value), value))
    url = cfg.audit.url
    if url is not None:
        from kvguard.daemon.audit_migrate import parse_url, sqlite_path

        path = sqlite_path(url)
        if path is not None and not path.is_absolute():
            found.append((("audit", "url"), url, path))
    errors = []
    for loc, written, path in found:
        there, here = Path(os.path.normpath(base / path)), Path(os.path.abspath(path))
        if there == here or there.exists() or not here.is_file():
            continue
        if loc == ("audit", "url"):
            fix = parse_url(written).set(database=str(here)).render_as_string(hide_password=False)
        else:
            fix = str(here)
        errors.append(
            cfg._line(
                loc,
                f"{written} names {there}, which does not exist, but {here} does: relative "
                "paths in the config are read from the config file's folder (older kvguard "
                "read them from the working directory); to keep that file, write its path "
                f"absolute ({fix}), or move it to {there}",
            )
        )
    return errors


def _rebased_audit_url(cfg: DaemonConfig, base: Path) -> DaemonConfig:
    """`audit.url` naming a SQLite file by a relative path (`sqlite:///audit.db`) made absolute
    under `base`, as the paths in PATH_KEYS are: else the daemon (run in its state directory)
    and `kvguard audit --config` (in an operator's shell) would open different files. An
    in-memory database, an absolute path and other backends are left as they are."""
    url = cfg.audit.url
    if url is None:
        return cfg
    from kvguard.daemon.audit_migrate import parse_url, sqlite_path  # SQLAlchemy: only when set

    path = sqlite_path(url)
    if path is None or path.is_absolute():
        return cfg
    whole = parse_url(url).set(database=os.path.normpath(base / path))
    audit = cfg.audit.model_copy(update={"url": whole.render_as_string(hide_password=False)})
    return cfg.model_copy(update={"audit": audit})


def apply_overrides(
    cfg: DaemonConfig,
    model: str | None = None,
    host: str | None = None,
    port: int | None = None,
    dry_run: bool | None = None,
    tensor_parallel: int | None = None,
) -> DaemonConfig:
    """A copy with command-line flags applied on top of the file; flags win, as users expect."""
    flags = {
        ("serving", "model"): ("--model", model),
        ("serving", "tensor_parallel"): ("--tensor-parallel", tensor_parallel),
        ("api", "host"): ("--host", host),
        ("api", "port"): ("--port", port),
        ("rules", "dry_run"): ("--dry-run", dry_run),
    }
    data = cfg.model_dump(exclude_unset=True)
    for (section, key), (_, value) in flags.items():
        if value is not None:
            data.setdefault(section, {})[key] = value
    given = {loc: flag for loc, (flag, value) in flags.items() if value is not None}
    where = replace(cfg._where, flags={**cfg._where.flags, **given})
    if model is not None:  # --model names another model: served under its own name
        where = replace(where, model_as_written=None)
    return _validate(data, where)


def _validate(data: Any, where: Where) -> DaemonConfig:
    if not isinstance(data, dict):
        raise ConfigFileError([_top_level_error(data, where)])
    try:
        cfg = DaemonConfig.model_validate(data)
    except ValidationError as e:
        errors = sorted(e.errors(), key=lambda err: _line_of(where(tuple(err["loc"]))))
        raise ConfigFileError([_format_error(err, where) for err in errors]) from None
    cfg._where = where
    return cfg


def _line_of(prefix: str) -> int:
    """The line in a `FILE:LINE` prefix, so errors are listed in the order they appear."""
    head, _, tail = prefix.rpartition(":")
    return int(tail) if head and tail.isdigit() else 0


def _top_level_error(data: Any, where: Where) -> str:
    sections = ", ".join(DaemonConfig.model_fields)
    prefix = where(())
    return (
        f"{prefix + ': ' if prefix else ''}(top level): {_shown(data)} "
        f"(expected a mapping of sections: {sections})"
    )


# -- pydantic errors as operator messages --------------------------------------------------------
_EXPECTED_TYPE = {
    "int_type": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "bool_type": "true or false",
    "string_type": "a string",
    "path_type": "a file path",
    "model_type": "a mapping of keys",
    "dict_type": "a mapping of keys",
}
_BOUNDS = {
    "greater_than": ">",
    "greater_than_equal": ">=",
    "less_than": "<",
    "less_than_equal": "<=",
}


def _format_error(err: ErrorDetails, where: Where) -> str:
    loc = tuple(err["loc"])
    prefix = where(loc)
    return f"{prefix + ': ' if prefix else ''}{_dotted(loc)}: {_describe(err)}"


def _describe(err: ErrorDetails) -> str:
    """pydantic's error as `problem (expected ...)`, in the file's own terms."""
    kind, value, ctx = err["type"], err.get("input"), err.get("ctx") or {}
    if kind == "value_error":
        return str(ctx.get("error", err["msg"]))
    if kind == "extra_forbidden":
        known = ", ".join(_known_keys(tuple(err["loc"][:-1])))
        return f"unknown key (expected one of: {known})"
    if kind == "literal_error":
        return f"{value!r} is not allowed (expected {ctx.get('expected')})"
    if kind in _EXPECTED_TYPE:
        return f"{_shown(value)} (expected {_EXPECTED_TYPE[kind]})"
    if kind in _BOUNDS:
        bound = next(iter(ctx.values()))
        return f"{value!r} is out of range (expected a value {_BOUNDS[kind]} {bound})"
    if kind in ("string_too_short", "string_pattern_mismatch"):
        return f"{value!r} is not allowed (expected {_string_rule(ctx)})"
    return f"{err['msg'].lower()} (got {value!r})"


def _string_rule(ctx: dict[str, Any]) -> str:
    if "pattern" in ctx:
        return f"a value matching {ctx['pattern']}"
    return "a non-empty string"


def _known_keys(loc: Loc) -> list[str]:
    model: type[BaseModel] = DaemonConfig
    for part in loc:
        annotation = model.model_fields[str(part)].annotation
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)


def _kind(value: Any) -> str:
    """How a YAML user would name the value they wrote."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, int | float):
        return "a number"
    return "a string"


def _shown(value: Any) -> str:
    """`a string 'x'`, `a number 5`; containers by kind alone, as they can be long."""
    if value is None or isinstance(value, list | dict):
        return _kind(value)
    return f"{_kind(value)} {value!r}"


def _dotted(loc: Loc) -> str:
    return ".".join(f"[{p}]" if isinstance(p, int) else str(p) for p in loc).replace(".[", "[")

"""API keys for the OpenAI endpoints, and the priority each key may ask for.

kvguard's admission gives `high` requests a reserved share of the KV budget, lets them
interrupt a step and take blocks from lower-priority work. On an open API any client can ask
for that. With `api.api_keys_file` set, every `/v1/*`, `/tokenize` and `/detokenize` request
must carry `Authorization: Bearer <key>` for a key in the file, and a request may ask for no
higher priority than its key's `max_priority`; a request that names none runs at the key's
`default_priority`. A key's `max_requests` bounds what it has queued or running at once (each
choice of `n` counts), so one client's flood cannot fill the queue every other client waits
in: past it, 429 with a Retry-After. `/health`, `/ready` and `/metrics` stay open; `/admin/*` keeps its own
token.

The file holds SHA-256 digests, never keys, so it is not a secret (mode 0644 under
/etc/kvguard is fine) and a leaked copy lets nobody in. `kvguard keys add NAME` makes a key,
prints it once and appends its digest; SIGHUP (`systemctl reload kvguard`) applies the file,
and a file with a problem is refused at start and on reload (the running keys stay) with one
`FILE:LINE: problem` line each.

```yaml
keys:
  - name: web-frontend
    sha256: 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08
    max_priority: high          # the highest priority it may ask for (default: normal)
    default_priority: normal    # when a request names none (default: normal, capped)
    max_requests: 64            # queued or running at once; more answer 429 (default: no limit)
  - name: nightly-batch
    sha256: ...
    max_priority: low
```
"""

from __future__ import annotations

import difflib
import errno
import fcntl
import hashlib
import json
import os
import re
import secrets
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from kvguard.alerts.export import make_folders
from kvguard.daemon.config import _EXPECTED_TYPE, ConfigFileError, Where, _shown
from kvguard.rules.yaml_file import YamlFileError, load_yaml, read_source

Priority = Literal["high", "normal", "low"]
RANK = {"high": 0, "normal": 1, "low": 2}
KEY_PREFIX = "kvg-"
MAX_KEYS = 10_000
# what a file error adds where the value looks like a key: the one mistake that would copy a
# live key to every place the error goes
RAW_KEY_HINT = (
    "a raw API key? The file holds SHA-256 digests, never keys: `kvguard keys add NAME` makes "
    "a key and writes its entry (`kvguard keys hash` prints the digest of a key made elsewhere)"
)
# a name is published (the `key` label on the open /metrics, `kvguard keys list`, 403 answers):
# one that is a key, in full, would hand it to anyone
NAME_IS_A_KEY = (
    "looks like an API key, and a key's name is shown to anyone (the `key` label on /metrics, "
    "`kvguard keys list`): name the key for its client instead (web-frontend)"
)
# what `kvguard keys add` calls each field it takes from its command line: a value refused
# there is the argument's fault, never the file's (which the key was about to go to)
ARGUMENTS = {
    "name": "the NAME argument",
    "max_priority": "--max-priority",
    "default_priority": "--default-priority",
    "max_requests": "--max-requests",
}
NAME_FORM = "a name is 1 to 64 letters, digits, '.', '_' or '-', the first a letter or digit"
# a random key made elsewhere (`sk-...`, base64) is a long word of letters of both cases and
# digits; a name a person writes this long and this mixed is rare
KEY_SHAPED_NAME_LEN = 32
_HEX = re.compile(r"[0-9a-fA-F]+")
HEADER = "# kvguard API keys (daemon/api_keys.py): digests only, never the keys\n"


def digest(key: str) -> str:
    """The SHA-256 of a key as 64 hex digits: what the file stores."""
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    """A fresh key: 256 random bits, URL-safe, recognisable by its prefix."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


class _Entry(BaseModel):
    # strict, as the config file's sections: `max_requests: true` or "5" is a typo to report,
    # not a 1 or a 5 to enforce
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    max_priority: Priority = "normal"
    default_priority: Priority | None = None  # None: normal, or max_priority if lower
    # sequences (each of a request's `n` choices is one) it may have queued or running at once
    max_requests: int | None = Field(None, ge=1, le=1_000_000)

    @field_validator("name", mode="after")
    @classmethod
    def _not_a_key(cls, name: str) -> str:
        if _name_looks_like_key(name):
            raise ValueError(NAME_IS_A_KEY)
        return name

    @property
    def default(self) -> str:
        """The priority of a request that names none: default_priority, else normal, or low
        where max_priority is low."""
        if self.default_priority:
            return self.default_priority
        return "normal" if RANK[self.max_priority] <= RANK["normal"] else self.max_priority

    @model_validator(mode="after")
    def _default_within_max(self) -> _Entry:
        if self.default_priority and RANK[self.default_priority] < RANK[self.max_priority]:
            raise ValueError(
                f"default_priority {self.default_priority} is above max_priority "
                f"{self.max_priority}"
            )
        return self


class _File(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    keys: list[_Entry] = Field(default_factory=list, max_length=MAX_KEYS)


@dataclass(frozen=True, slots=True)
class ApiKey:
    name: str
    max_priority: str
    default_priority: str
    max_requests: int | None = None

    def allows(self, priority: str) -> bool:
        return RANK[priority] >= RANK[self.max_priority]


@dataclass(frozen=True, slots=True)
class ApiKeys:
    path: Path
    by_digest: dict[str, ApiKey]

    def find(self, key: str) -> ApiKey | None:
        return self.by_digest.get(digest(key))

    def __len__(self) -> int:
        return len(self.by_digest)


class KeysFileError(ConfigFileError):
    """The keys file cannot be used; `errors` holds one `FILE:LINE: problem` line each."""


def read_entries(path: Path) -> tuple[list[_Entry], dict[tuple[Any, ...], int]]:
    """The file's entries (an absent or empty file has none) and each key's line."""
    try:
        source = read_source(path)
    except FileNotFoundError:
        return [], {}
    except OSError as e:
        raise KeysFileError([f"{path}: cannot read the API keys file: {e}"]) from None
    try:
        data, lines = load_yaml(source, str(path))
    except YamlFileError as e:
        raise KeysFileError(e.errors) from None
    if data is None:
        return [], lines
    if not isinstance(data, dict):
        raise KeysFileError([f"{path}:1: expected a mapping with a `keys` list"])
    try:
        parsed = _File.model_validate(data)
    except ValidationError as e:
        raise KeysFileError([_error(path, lines, err) for err in e.errors()]) from None
    problems = []
    for field in ("name", "sha256"):
        seen: dict[str, int] = {}
        for i, entry in enumerate(parsed.keys):
            value = getattr(entry, field)
            if value in seen:
                where = Where(str(path), lines)(("keys", i, field))
                problems.append(f"{where}: {field} given twice (first in keys[{seen[value]}])")
            seen.setdefault(value, i)
    if problems:
        raise KeysFileError(problems)
    return parsed.keys, lines


def load_keys(path: Path) -> ApiKeys:
    """The keys in force from `path`. The file must exist: a daemon told to check keys and
    given none would refuse every request, which is never what was meant."""
    if not Path(path).is_file():
        raise KeysFileError([f"{path}: API keys file not found (api.api_keys_file)"])
    entries, _ = read_entries(Path(path))
    keys = {e.sha256: ApiKey(e.name, e.max_priority, e.default, e.max_requests) for e in entries}
    return ApiKeys(Path(path), keys)


def _error(path: Path, lines: dict[tuple[Any, ...], int], err: Any) -> str:
    """One `FILE:LINE: field: problem` line. It quotes no string from the file, a mapping's
    key included: a key pasted in by mistake (a list of keys, as other servers take them, or
    one in a field) would go wherever the error goes (the journal, the audit database's
    `config_error` rows, a reload's answer, `kvguard keys list`); the line and the field say
    where to look. A value that looks like a key gets a hint about what the file holds."""
    loc = tuple(x for x in err["loc"] if x not in ("function-after[_default_within_max()]",))
    kind, value = err["type"], err.get("input")
    at = Where(str(path), lines)(loc)
    if kind == "extra_forbidden":  # its name is the file's text too (`- {kvg-...: web}`)
        value = value if _looks_like_key(value) else loc[-1]  # `key: kvg-...`, or the name
        loc = loc[:-1]
        known = list(_Entry.model_fields if len(loc) > 1 else _File.model_fields)
        what = f"unknown key{_did_you_mean(value, known)} (expected one of: {', '.join(known)})"
    else:
        what = _problem(err, loc)
    if _may_be_a_key(loc, value):
        what += f"; {RAW_KEY_HINT}"
    dotted = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in loc).lstrip(".")
    return f"{at}: {dotted or '(top level)'}: {what}"


def _argument_error(err: Any) -> str:
    """One line for a value `kvguard keys add` was given on its command line and refused:
    named by its argument, with what a name must look like where it is the name. Not by the
    file, nor with RAW_KEY_HINT about what the file holds: nothing in the file is wrong."""
    field = err["loc"][0] if err["loc"] else ""
    what = _problem(err, err["loc"])
    if field == "name":  # NAME_FORM says which characters
        what = "not allowed" if err["type"] == "string_pattern_mismatch" else what
        what += f"; {NAME_FORM}"
    return f"{ARGUMENTS.get(field, field)}: {what}"


def _problem(err: Any, loc: tuple[Any, ...]) -> str:
    """What is wrong with a field's value, quoting no string of it (see `_error`)."""
    kind, value = err["type"], err.get("input")
    if kind == "literal_error" and isinstance(value, str):
        what = f"not allowed{_did_you_mean(value, list(RANK))} (expected high, normal or low)"
    elif kind == "literal_error":
        what = f"{_shown(value)} (expected high, normal or low)"
    elif kind == "string_pattern_mismatch" and loc[-1:] == ("sha256",):
        what = "expected the key's SHA-256 as 64 lowercase hex digits (kvguard keys hash)"
    elif kind == "string_pattern_mismatch":
        what = "not allowed (expected letters, digits, '.', '_' or '-')"
    elif kind == "missing":
        what = "missing (every key needs a name and a sha256)"
    elif kind == "value_error":
        what = str((err.get("ctx") or {}).get("error", err["msg"]))
    elif kind in _EXPECTED_TYPE or kind == "list_type":  # as the config file words them
        said = "a string" if isinstance(value, str) else _shown(value)
        what = f"{said} (expected {_EXPECTED_TYPE.get(kind, 'a list')})"
    elif isinstance(value, str) or value is None or isinstance(value, list | dict):
        what = err["msg"].lower()  # pydantic's words for a string's length: no value in them
    else:
        what = f"{err['msg'].lower()} (got {value!r})"  # a number out of range
    return what


def _may_be_a_key(loc: tuple[Any, ...], value: Any) -> bool:
    """Whether an error gets RAW_KEY_HINT. A `name` is held to `_name_looks_like_key`: a name
    refused only for its length or a `/` (`team-a/nightly-batch`) is a name, and asking it
    "a raw API key?" would send its writer to the command that refused it."""
    if loc[-1:] == ("name",):
        return isinstance(value, str) and _name_looks_like_key(value)
    return _looks_like_key(value)


def _looks_like_key(value: Any) -> bool:
    """A string with a key's prefix, or one word as long as a key that is not hex (a digest
    with a typo)."""
    if not isinstance(value, str):
        return False
    word = len(value) >= 20 and not any(c.isspace() for c in value)
    return value.startswith(KEY_PREFIX) or (word and not _HEX.fullmatch(value))


def _name_looks_like_key(name: str) -> bool:
    """The prefix every key `keys add` makes carries, or a long word mixing both cases and
    digits, as random keys made elsewhere do. Stricter than `_looks_like_key`, which only adds a
    hint to an error already there: this refuses a name, and a long name a person wrote
    (`nightly-batch-eu-west-1`) must keep loading."""
    if name.startswith(KEY_PREFIX):
        return True
    mixed = all(any(test(c) for c in name) for test in (str.isupper, str.islower, str.isdigit))
    return len(name) >= KEY_SHAPED_NAME_LEN and mixed and _looks_like_key(name)


def _did_you_mean(value: Any, known: list[str]) -> str:
    """` (did you mean X?)` where `value` is close to one of `known`: it names the known
    word, never the file's."""
    close = difflib.get_close_matches(str(value), known, n=1) if isinstance(value, str) else []
    return f" (did you mean {close[0]}?)" if close else ""


def add_key(
    path: Path,
    name: str,
    max_priority: str,
    default_priority: str | None,
    max_requests: int | None = None,
) -> tuple[str, str]:
    """Make a key, append its digest to the file (created 0644 if absent); returns the key
    and what `_write` says."""
    if default_priority and RANK[default_priority] < RANK[max_priority]:
        raise KeysFileError(
            [f"--default-priority {default_priority} is above --max-priority {max_priority}"]
        )
    key = new_key()
    try:  # the same checks a daemon applies when it reads the file
        entry = _Entry(
            name=name,
            sha256=digest(key),
            max_priority=max_priority,
            default_priority=default_priority,
            max_requests=max_requests,
        )
    except ValidationError as e:
        raise KeysFileError([_argument_error(err) for err in e.errors()]) from None
    _make_directory(path)
    with _editing(path):
        note = _append(path, entry)
    return key, note


def _append(path: Path, entry: _Entry) -> str:
    """Append `entry` to the file (made if absent or empty); the caller holds `_editing`."""
    entries, _ = read_entries(path)
    if any(e.name == entry.name for e in entries):
        raise KeysFileError([f"{path}: a key named {entry.name!r} is already there"])
    text = path.read_text() if path.exists() else ""
    if not text.strip():
        text = f"{HEADER}keys:\n"
    elif "keys: []" in text:
        text = text.replace("keys: []", "keys:")
    if not text.endswith("\n"):
        text += "\n"
    return _write(path, text + _block(entry), [*entries, entry])


@contextmanager
def _editing(path: Path) -> Iterator[None]:
    """Hold the keys file's edit lock: `keys add` and `keys remove` each read the whole file,
    edit it and replace it, so two at once (two operators, config management adding tenants
    in parallel) would each write the file without the other's edit: a printed key missing
    from it, a revoked key back in it. An exclusive `flock` on a sibling `.NAME.lock` (not on
    the file, which `_write` replaces) makes them take turns; the daemon only reads, and the
    atomic replace keeps it safe. The lock file stays: removing it would let a waiter hold a
    lock on a file a newcomer no longer sees."""
    lock = path.with_name(f".{path.name}.lock")
    try:
        fd = _open_lock(lock)
    except OSError as e:
        raise KeysFileError([f"cannot lock {path} (in {path.parent}): {e.strerror or e}"]) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released when fd closes, or the process dies
        yield
    finally:
        os.close(fd)


def _open_lock(lock: Path) -> int:
    """The lock file, opened for reading (`flock` needs no more, and another operator who may
    replace the keys file may lack write access to a lock someone else made); made 0644
    whatever the umask where absent, as every file `keys add` makes."""
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return os.open(lock, os.O_RDONLY)
    os.fchmod(fd, 0o644)
    return fd


def _block(entry: _Entry) -> str:
    """One entry in the layout `keys add` writes, every string quoted (a name such as `123`,
    `null` or `true` must stay a string when read back)."""
    block = f"  - name: {json.dumps(entry.name)}\n    sha256: {json.dumps(entry.sha256)}\n"
    block += f"    max_priority: {entry.max_priority}\n"
    if entry.default_priority:
        block += f"    default_priority: {entry.default_priority}\n"
    if entry.max_requests is not None:
        block += f"    max_requests: {entry.max_requests}\n"
    return block


def _make_directory(path: Path) -> None:
    """README's first `keys add` runs before /etc/kvguard exists on a fresh host: make the
    file's missing directories, as `db upgrade` makes its database's, 0755 as the file is 0644
    whatever the umask (`sudo` keeps an operator's 077)."""
    parent = path.parent
    if parent.is_dir():
        return
    try:
        if parent.exists():
            raise NotADirectoryError(errno.ENOTDIR, "not a directory")
        make_folders(parent)  # 0755: the service's user reads the file in it
    except OSError as e:
        raise KeysFileError(
            [f"cannot create {path}: cannot make its directory {parent}: {e.strerror or e}"]
        ) from None


def remove_key(path: Path, name: str) -> str:
    """Drop the entry named `name` (and its lines) from the file; returns what `_write` says."""
    with _editing(path):
        return _drop(path, name)


def _drop(path: Path, name: str) -> str:
    """Drop the entry named `name` and its lines; the caller holds `_editing`."""
    entries, lines = read_entries(path)
    idx = next((i for i, e in enumerate(entries) if e.name == name), None)
    if idx is None:
        raise KeysFileError([f"{path}: no key named {name!r}"])
    text = path.read_text().splitlines(keepends=True)
    start = lines[("keys", idx)] - 1
    end = lines[("keys", idx + 1)] - 1 if idx + 1 < len(entries) else _block_end(text, start)
    kept = text[:start] + text[end:]
    if len(entries) == 1:
        kept = [
            line.replace("keys:", "keys: []") if line.strip() == "keys:" else line for line in kept
        ]
    return _write(path, "".join(kept), entries[:idx] + entries[idx + 1 :])


def _write(path: Path, text: str, want: list[_Entry]) -> str:
    """Replace the file at once (a daemon reloading meanwhile reads the old or the new one,
    never half of one), readable by the service's user. `text` is the file edited line by line
    (its comments kept), and it is written only if it reads back as exactly the entries
    `want`; a layout the line edit does not know (flow style, other indents) is written whole
    instead, comments dropped: returns a note saying so, else "". The file is never replaced
    by one that would not load."""
    try:  # a name of its own: a writer's file is never another's (or renamed by another)
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise _cannot_write(path, e) from None
    os.close(fd)
    tmp = Path(name)
    try:
        return _fill_and_replace(path, tmp, text, want)
    except OSError as e:
        raise _cannot_write(path, e) from None
    finally:
        tmp.unlink(missing_ok=True)


def _cannot_write(path: Path, e: OSError) -> KeysFileError:
    """The hidden temporary file is ours, not the operator's: name the file and its directory."""
    return KeysFileError([f"cannot write {path} (in {path.parent}): {e.strerror or e}"])


def _fill_and_replace(path: Path, tmp: Path, text: str, want: list[_Entry]) -> str:
    """Write `text` (or, where it does not read back as `want`, the canonical layout) to
    `tmp`, then put it in `path`'s place; returns `_write`'s note."""
    note = ""
    tmp.write_text(text)
    if _entries_of(tmp) != want:
        tmp.write_text(HEADER + "keys:\n" + "".join(_block(e) for e in want))
        note = f"{path}: its layout is not the one `keys add` writes: rewritten whole"
        if any("#" in line for line in text.splitlines(keepends=True) if line != HEADER):
            note += " (its comments are gone)"
        if _entries_of(tmp) != want:  # never: the canonical layout reads back
            raise KeysFileError([f"{path}: the edited keys did not read back; left as it was"])
    os.chmod(tmp, 0o644)
    tmp.replace(path)
    return note


def _entries_of(path: Path) -> list[_Entry] | None:
    try:
        return read_entries(path)[0]
    except KeysFileError:
        return None


def _block_end(text: list[str], start: int) -> int:
    """The line after the last entry's block: its indented lines (comments included)."""
    end = start + 1
    while end < len(text) and (text[end].startswith("    ") or not text[end].strip()):
        end += 1
    return end

"""Spill files: audit rows the daemon could not write to its database before it stopped.

The writer keeps rows in memory while the database refuses them (read-only, full, locked,
unreachable). Memory does not survive the process, so at exit whatever is still queued is
appended to a JSON-lines file instead of being lost, and `kvguard audit import FILE` (or the
next start, once the database takes writes) loads it. Rows the database refused outright for a
schema this kvguard does not know (a newer one's NOT NULL column, say) are appended as they are
refused, for the import of an upgraded daemon, to a file of their own (`audit.db.refused.jsonl`):
its import may keep failing until then, and must not hold back the rows of the spill file.

Where: next to a SQLite database (`audit.db` -> `audit.db.spill.jsonl`), else in the state
directory (`$STATE_DIRECTORY` or `./var/`), which is also where a server database's rows go, in
a file named after that database (`audit-kvguard-1f2e3d4c5b.spill.jsonl`: its name and a hash
of what identifies it, `identity`), so that daemons of different databases sharing a state
directory never write one file. Older kvguard named it `audit.spill.jsonl` for every server
database: that name is still read (`legacy_paths`), never written.
The first place that takes the whole write wins; a failed append is cut back to the file's
old length, so a half-written tail never corrupts the lines before it. A line cut short anyway
(the process killed while writing it) is skipped on import and reported by line number: it
can only be the row being written at that moment.

Format, one JSON object per line, appended per spill so earlier unimported spills are kept:
a header `{"kvguard_audit_spill_format": 2, "db": ..., "host": ..., "written_at": ..., "rows": N,
"reason": ...}` that says what happened, then `{"op": KIND, "row": {...}}` per queued operation
in queue order (KIND is a table name, `incident_update` or `purge`), times as ISO 8601 strings.
Actions and events carry the `uid` they got when queued; that is what makes a second import
of the same rows add nothing.

Format 1 (`{"kvguard_audit_spill": 1, ...}`, written before actions carried `data`) is still
read. Its readers took any line with that key for a header, whatever its number, and loaded
what they knew of each row: the release before format 2 imported a newer spill at start and
silently dropped the actions' `data`. So format 2 has a key of its own, which those readers
refuse (`not a kvguard audit spill line`, the file left where it is, for a newer kvguard's
import), and a format newer than `FORMAT` under it is refused here the same way.

This module only reads and writes files; loading rows into a database is
`AuditStore.import_file`, next to the writer whose SQL it reuses.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kvguard.daemon.audit_migrate import parse_url, shown, sqlite_path

SUFFIX = ".spill.jsonl"
REFUSED_SUFFIX = ".refused.jsonl"  # rows the database refused: imported apart from the spill
FORMAT = 2  # written; read: 1 and 2
HEADER_KEY = "kvguard_audit_spill_format"  # format 2 on: a key format 1's readers refuse
V1_HEADER_KEY = "kvguard_audit_spill"  # format 1's (its value always 1)
# a header line starts so, whichever format (both keys begin with format 1's)
HEADER_PREFIX = b'{"' + V1_HEADER_KEY.encode()
KINDS = ("actions", "events", "incidents", "incident_update", "purge")
TIME_KEYS = ("time", "opened_at", "closed_at", "before")  # the row fields that are datetimes
DEFAULT_PORTS = {"postgresql": 5432, "mysql": 3306, "mariadb": 3306, "mssql": 1433}
LEGACY_NAME = "audit"  # every server database's spill file, before names per database


def spill_paths(url: str, state_dir: Path | None, suffix: str = SUFFIX) -> list[Path]:
    """Where this database's spill file (`suffix`: or its refused rows' file) may be, in order
    of preference."""
    db = sqlite_path(url)
    paths: list[Path] = []
    if db is not None:
        paths.append(db.with_name(db.name + suffix))
    if state_dir is not None:
        paths.append(state_dir / ((db.name if db is not None else _server_name(url)) + suffix))
    unique: list[Path] = []
    for p in paths:
        if all(os.path.abspath(p) != os.path.abspath(q) for q in unique):
            unique.append(p)
    return unique


def legacy_paths(url: str, state_dir: Path | None, suffix: str = SUFFIX) -> list[Path]:
    """Where an older kvguard put a server database's spill file (one name for all): read at
    start like this database's own, and left where it is if its header names another."""
    if state_dir is None or identity(url) is None:
        return []
    return [state_dir / (LEGACY_NAME + suffix)]


# query parameters that say how to connect, not to which database: left out of `identity`
CONNECTION_OPTIONS = frozenset(
    {
        "password", "connect_timeout", "application_name", "fallback_application_name",
        "client_encoding", "options", "keepalives", "keepalives_idle", "keepalives_interval",
        "keepalives_count", "tcp_user_timeout", "target_session_attrs", "load_balance_hosts",
        "sslmode", "sslcert", "sslkey", "sslrootcert", "sslcrl", "sslpassword", "sslcompression",
        "gssencmode", "channel_binding", "charset", "read_timeout", "write_timeout",
    }
)  # fmt: skip


def identity(url: str) -> tuple[Any, ...] | None:
    """What names a server database in a URL: its backend, host as written, port (the
    backend's default if none), database and user, from the URL or its libpq-style query
    (`?host=/run/postgresql`), and every other query parameter but those that only say how to
    connect (`CONNECTION_OPTIONS`): a libpq `service=` or MySQL's `unix_socket=` name the
    database too. Not its password (moved to ~/.pgpass between runs) or its driver (psycopg or
    psycopg2 reach the same database). None for SQLite, or for text that is not a URL."""
    try:
        u = parse_url(url)
    except ValueError:
        return None
    backend = u.get_backend_name()
    if backend == "sqlite":
        return None

    def query(key: str) -> str | None:
        value = u.query.get(key)
        return value[-1] if isinstance(value, tuple) else value

    host = u.host or query("host")
    if host and "@" in host:  # a password with an `@` not written %40: its rest is here
        host = host.rpartition("@")[2]
    port_text = query("port")
    port = u.port or (int(port_text) if port_text and port_text.isdigit() else None)
    database = u.database or query("dbname") or query("database")
    user = u.username or query("user")
    used = {"host", "port", "dbname", "database", "user"}
    rest = sorted(
        (key, str(query(key)))
        for key in u.query
        if key not in used and key.lower() not in CONNECTION_OPTIONS
    )
    return (
        backend,
        host.lower() if host else None,
        port or DEFAULT_PORTS.get(backend),
        database,
        user,
        *([rest] if rest else []),
    )


def _server_name(url: str) -> str:
    """A server database's spill file name, without suffix: readable, and one per database
    (`identity`), whatever its URL's password or options."""
    ident = identity(url)
    if ident is None:  # an in-memory SQLite database: one per process, none to share a file
        return LEGACY_NAME
    digest = hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:10]
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", ident[3] or "db").strip("._")[:40] or "db"
    return f"{LEGACY_NAME}-{name}-{digest}"


def _default(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.astimezone(UTC).isoformat()
    return str(value)  # the writer already made params/data JSON-safe; this is a fallback


def encode(kind: str, row: dict[str, Any]) -> str:
    """One operation as one line (without the newline)."""
    return json.dumps({"op": kind, "row": row}, default=_default, ensure_ascii=False)


def encode_header(db: str, host: str, rows: int, reason: str | None) -> str:
    return json.dumps(
        {
            HEADER_KEY: FORMAT,
            "db": db,
            "host": host,
            "written_at": datetime.now(UTC).isoformat(),
            "rows": rows,
            "reason": reason,
        },
        ensure_ascii=False,
    )


def append(paths: Iterable[Path], lines: list[str]) -> tuple[Path | None, list[str]]:
    """Append `lines` to the first path that takes them all, fsynced; that path (None if none
    did) and why each earlier one failed. Each append opens, locks and closes the file: see
    `claimed` for why an import then never misses its rows."""
    data = ("\n".join(lines) + "\n").encode()
    errors: list[str] = []
    for path in paths:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, created = _open_locked(path)
        except OSError as e:
            errors.append(f"{path}: {e.strerror or e}")
            continue
        start = os.lseek(fd, 0, os.SEEK_END)
        try:
            # After a line cut short by an earlier crash, start on a line of our own.
            gap = b"\n" if start and os.pread(fd, 1, start - 1) != b"\n" else b""
            view = memoryview(gap + data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
            return path, errors
        except OSError as e:
            errors.append(f"{path}: {e.strerror or e}")
            with contextlib.suppress(OSError):
                if created and _names(path, fd):  # an empty file would be "imported" at every start
                    os.unlink(path)
                else:
                    os.ftruncate(fd, start)  # leave the lines before this spill intact
        finally:
            os.close(fd)
    return None, errors


def _open_locked(path: Path) -> tuple[int, bool]:
    """An fd appending to `path` under an exclusive lock, and whether this call created the
    file. An import may claim (rename) the file between the open and the lock: then the fd is
    the claimed file's, and it is opened again, so no row lands in a file already read."""
    while True:
        fd, created = _open_append(path)
        try:
            _lock(fd)
            if _names(path, fd):
                return fd, created
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def _open_append(path: Path) -> tuple[int, bool]:
    """An fd appending to `path`, and whether this call created the file."""
    flags = os.O_RDWR | os.O_APPEND
    try:
        return os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600), True
    except FileExistsError:
        return os.open(path, flags), False


def _lock(fd: int, wait: bool = True) -> bool:
    """Take `fd`'s file's exclusive lock (held until the fd is closed): False if `wait` is
    False and another process holds it. A file system without locks (ENOLCK) is taken as
    locked: spilling rows matters more than the race that the lock closes."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno != errno.ENOLCK:
            raise
    return True


def _names(path: Path, fd: int) -> bool:
    """Whether `path` still names the file open as `fd` (not renamed by an import since)."""
    try:
        st, mine = os.stat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


@dataclass(slots=True, frozen=True)
class SpillRead:
    ops: list[tuple[str, dict[str, Any]]]
    headers: list[dict[str, Any]]
    unreadable: list[int]  # numbers of lines cut short by an interrupted write, skipped


def read(path: Path) -> SpillRead:
    """Parse a spill file. A line that is not JSON is skipped and reported (an interrupted
    write); one that is JSON but not ours, or a file with lines but no header, is a ValueError.
    An empty file (an older kvguard's spill that failed on a full disk) holds nothing."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from None
    ops: list[tuple[str, dict[str, Any]]] = []
    headers: list[dict[str, Any]] = []
    unreadable: list[int] = []
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            unreadable.append(n)
            continue
        if _is_header(obj):
            headers.append(_readable_header(path, n, obj))
            continue
        ops.append(_op(path, n, obj))
    if not headers and text.strip():  # an empty file holds nothing (see `append`)
        raise ValueError(f"{path} is not a kvguard audit spill file (no header line)")
    return SpillRead(ops, headers, unreadable)


def _is_header(obj: Any) -> bool:
    return isinstance(obj, dict) and (HEADER_KEY in obj or V1_HEADER_KEY in obj)


def _readable_header(path: Path, n: int, header: dict[str, Any]) -> dict[str, Any]:
    """`header`, if this kvguard reads its format: one of a newer format may carry fields this
    one would drop, as format 1's readers dropped the actions' `data` of format 2."""
    format_ = header.get(HEADER_KEY, 1)
    if not isinstance(format_, int) or isinstance(format_, bool) or format_ > FORMAT:
        raise ValueError(
            f"{path}:{n}: spill format {format_!r}, written by a newer kvguard (this one reads "
            f"formats 1 to {FORMAT}): import it with that kvguard's `kvguard audit import` (not "
            "imported, the file left as it is)"
        )
    return header


_REQUIRED = {"incident_update": ("id",), "purge": ("before",), "incidents": ("id",)}


def _op(path: Path, n: int, obj: Any) -> tuple[str, dict[str, Any]]:
    kind = obj.get("op") if isinstance(obj, dict) else None
    row = obj.get("row") if isinstance(obj, dict) else None
    if kind not in KINDS or not isinstance(row, dict):
        raise ValueError(f"{path}:{n}: not a kvguard audit spill line")
    missing = [k for k in _REQUIRED.get(kind, ()) if row.get(k) is None]
    if missing:
        raise ValueError(f"{path}:{n}: {kind} without {', '.join(missing)}")
    row = dict(row)
    for key in TIME_KEYS:
        if isinstance(row.get(key), str):
            try:
                row[key] = datetime.fromisoformat(row[key]).astimezone(UTC)
            except ValueError:
                raise ValueError(f"{path}:{n}: {key} {row[key]!r} is not an ISO time") from None
    return kind, row


def same_db(spilled: str, url: str) -> bool:
    """Whether a header's `db` (the URL as shown, without a password) names `url`'s database:
    the same URL, the same SQLite file however its path is spelt, or the same server
    database however its URL is written (`identity`: a password moved to ~/.pgpass, a
    `?connect_timeout=` added). Both are shown again: a header written before `shown` masked a
    query password holds it in the clear."""
    if spilled == shown(url) or shown(spilled) == shown(url):
        return True
    try:
        a, b = sqlite_path(spilled), sqlite_path(url)
    except ValueError:  # not a URL at all
        return False
    if a is not None or b is not None:
        return a is not None and b is not None and a.resolve() == b.resolve()
    mine = identity(url)
    return mine is not None and identity(spilled) == mine


def spilled_elsewhere(headers: Iterable[dict[str, Any]], url: str) -> list[str]:
    """The databases other than `url`'s that a spill file's headers name, sorted: its rows are
    theirs (two daemons sharing a state directory), not to be loaded into `url` unasked."""
    named = sorted({str(h.get("db")) for h in headers})
    return [db for db in named if not same_db(db, url)]


def headers(path: Path) -> list[dict[str, Any]]:
    """A spill file's header lines only (cheap: its rows are not parsed); [] if unreadable."""
    found: list[dict[str, Any]] = []
    try:
        with path.open("rb") as f:
            for line in f:
                if line.startswith(HEADER_PREFIX):
                    with contextlib.suppress(ValueError):  # cut short by a crash
                        found.append(json.loads(line))
    except OSError:
        return []
    return found


def count_lines(path: Path) -> int:
    """Operations in a spill file, for the start-up notice; -1 if it cannot be read."""
    try:
        with path.open("rb") as f:
            return sum(1 for line in f if line.strip() and not line.startswith(HEADER_PREFIX))
    except OSError:
        return -1


CLAIM_TAG = ".importing-"  # `audit.db.spill.jsonl.importing-PID-STAMP`: an import's claim


@contextlib.contextmanager
def claimed(path: Path) -> Iterator[Path | None]:
    """`path` claimed for an import: renamed to a name of its own (`CLAIM_TAG`) and locked
    until the block ends; None if another import took it first.

    Spill writers append by path, a lock taken and the file closed per spill (`append`), so
    once the file is renamed a writer opens a new one at `path`, which the next import loads.
    A writer that opened the old file just before the rename either holds its lock, which the
    claim waits for, or finds on taking it that `path` names another file and reopens: the
    claimed file grows no more once the claim holds its lock. A claim left by an import that
    died (its lock gone with its process) is claimed as it is, by its own name: `leftovers`.
    """
    target = path
    if CLAIM_TAG not in path.name:
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ")
        target = path.with_name(f"{path.name}{CLAIM_TAG}{os.getpid()}-{stamp}")
        try:
            path.rename(target)
        except FileNotFoundError:  # another import renamed it first
            yield None
            return
    try:
        fd = os.open(target, os.O_RDONLY)
    except FileNotFoundError:  # a leftover another import has finished with
        yield None
        return
    try:
        # a fresh claim waits out a writer's append; a leftover another import holds is its
        ours = _lock(fd, wait=target is not path) and _names(target, fd)
        yield target if ours else None
    finally:
        os.close(fd)


def leftovers(path: Path) -> list[Path]:
    """Claims of `path` left by imports that did not finish (a crash), oldest first: their
    rows may not be in the database yet."""
    prefix = path.name + CLAIM_TAG
    try:
        return sorted(p for p in path.parent.iterdir() if p.name.startswith(prefix))
    except OSError:
        return []


def unclaim(claim: Path) -> Path:
    """Give a claimed file its name back after a failed import, unless a writer has started a
    new file there since: then it keeps its claim's name (a later start imports it)."""
    original = claim.with_name(claim.name.partition(CLAIM_TAG)[0])
    try:
        os.link(claim, original)  # never replaces a file at `original`, unlike a rename
    except OSError:
        return claim
    claim.unlink()
    return original


def mark_imported(path: Path) -> Path:
    """Rename an imported spill file (or its claim) out of the way (never delete audit data
    unasked)."""
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    path_name = path.name.partition(CLAIM_TAG)[0]
    target = path.with_name(f"{path_name}.imported-{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path_name}.imported-{stamp}-{n}")
    path.rename(target)
    return target

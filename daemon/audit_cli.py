"""`kvguard audit ...` and `kvguard db ...`: what the daemon did, read after an incident.

An operator runs these on a server, often while things are on fire, so they read the daemon's
own database by default (the same URL `kvguard serve` would use, or a config's `audit.url`),
never create a database by reading, print rich tables on a terminal and plain columns in a
pipe, offer `--json` everywhere, and answer mistakes with one line (a ValueError, which the
`kvguard` entry point prints as `kvguard: error: ...`).

Handlers import SQLAlchemy and rich lazily so `kvguard --help` stays instant.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import os
import re
import signal
import stat
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvguard.daemon.audit import AuditStore, ImportResult

OUTCOMES = ("applied", "failed", "dry_run", "refused", "held")  # as kvguard.daemon.audit_models
EXPORT_TABLES = ("actions", "events", "incidents")
WHOLE_COLUMNS = {"ID", "TIME", "OPENED", "CLOSED", "INCIDENT"}
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_PART = r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w)"
# The time part of an ISO time as `datetime.fromisoformat` reads it, after the date and its
# one-character separator: HH, HH:MM or HH:MM:SS (colons optional), a fraction, an offset.
_ISO_TIME = re.compile(
    r"\D(\d\d)(?::?(\d\d)(?::?(\d\d)([.,]\d+)?)?)?"
    r"(?:Z|[+-]\d\d(?::?\d\d(?::?\d\d(?:[.,]\d+)?)?)?)?$"
)
DEFAULT_DB_HELP = (
    "no --db or audit.url: audit.db in $STATE_DIRECTORY, else $KVGUARD_STATE_DIR, else "
    "/var/lib/kvguard where the daemon's is, else ./var/"
)


# -- kvguard audit -----------------------------------------------------------------------------
def add_audit_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    audit = sub.add_parser(
        "audit",
        help="query the audit database: actions, events, incidents",
        description="Read the actions the rules took, the daemon's events and the incidents, "
        "from the daemon's audit database (default: the one `kvguard serve` uses). "
        "Times are UTC; an ISO time without an offset is taken as UTC. "
        "The daemon serves even when this database cannot be written (GET /ready says "
        "'audit degraded', kvguard_audit_up is 0): rows queue in memory and land once it can; "
        "rows still queued at exit are saved to a spill file next to a SQLite database "
        "(audit.db.spill.jsonl; in the state directory if that one refuses it; "
        "audit-NAME-HASH.spill.jsonl in the state directory for a server database, named "
        "after it), which "
        "`kvguard audit import` loads and the next start imports by itself.",
    )
    cmds = audit.add_subparsers(
        dest="audit_command",
        metavar="{list,show,incidents,timeline,export,import}",
        required=True,
    )
    _add_list(cmds)
    _add_show(cmds)
    _add_incidents(cmds)
    _add_timeline(cmds)
    _add_export(cmds)
    _add_import(cmds)


def _db_options() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument(
        "--db",
        metavar="URL",
        help="SQLAlchemy URL of the audit database (default: the daemon's: the config's "
        "audit.url, else audit.db in $STATE_DIRECTORY, $KVGUARD_STATE_DIR, /var/lib/kvguard "
        "if it holds one, or ./var/)",
    )
    p.add_argument(
        "--config", metavar="FILE", type=Path, help="take the database from this config's audit.url"
    )
    return p


def _json_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _window_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--since", metavar="WHEN", help="from this time: a duration ago (2h, 30m, 1d) or ISO"
    )
    p.add_argument(
        "--until",
        metavar="WHEN",
        help="up to this time: a duration ago or ISO (one without fractional seconds, as "
        "printed, takes in the whole of its second; one to the minute or hour, "
        "2026-12-07T22:38 or 2026-12-07T22, the whole minute or hour; a date alone, the whole "
        "day; a week alone, 2026-W50, the whole week)",
    )


def _instance_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--instance",
        metavar="NAME",
        help="only rows written by this daemon (its audit.instance; default there: its hostname), "
        "for a database shared by several daemons",
    )


def _limit_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--limit",
        metavar="N",
        type=int,
        default=100,
        help="newest N rows, saying on stderr when older ones were left out; 0: all "
        "(default: %(default)s)",
    )


def _add_list(cmds: Any) -> None:
    p = cmds.add_parser(
        "list",
        parents=[_db_options()],
        help="list actions, oldest first",
        description="List actions, oldest first. With --request, what happened to one request: "
        "the actions and events that name it (an eviction that preempted it, an OOM that "
        "requeued it), each with its TYPE; --rule, --action and --outcome leave the events out.",
    )
    _window_options(p)
    p.add_argument("--rule", help="only this rule")
    p.add_argument(
        "--action", metavar="NAME", type=_action_name, help="only this action (e.g. reduce_batch)"
    )
    p.add_argument("--outcome", choices=OUTCOMES, help="only this outcome")
    p.add_argument("--incident", metavar="ID", help="only actions of this incident")
    p.add_argument(
        "--request",
        metavar="ID",
        type=_request_id,
        help="only the actions and events naming this request: a request id as the audit "
        "names it (cmpl-3fa2...-0: the response's id, -, the choice's index) or a response "
        "id, for all its choices",
    )
    _instance_option(p)
    _limit_option(p)
    _json_option(p)
    p.set_defaults(func=cmd_audit_list)


def _add_show(cmds: Any) -> None:
    p = cmds.add_parser("show", parents=[_db_options()], help="show one action in full")
    p.add_argument("id", metavar="ID", type=_row_id, help="action id (from `kvguard audit list`)")
    _json_option(p)
    p.set_defaults(func=cmd_audit_show)


def _add_incidents(cmds: Any) -> None:
    p = cmds.add_parser(
        "incidents",
        parents=[_db_options()],
        help="list incidents",
        description="List incidents, oldest first; with --since/--until, those open at some "
        "time in that window (opened before its end, closed after its start or still open).",
    )
    _window_options(p)
    p.add_argument("--open", action="store_true", help="only incidents not closed yet")
    _instance_option(p)
    _limit_option(p)
    _json_option(p)
    p.set_defaults(func=cmd_audit_incidents)


def _add_timeline(cmds: Any) -> None:
    p = cmds.add_parser(
        "timeline",
        parents=[_db_options()],
        help="an incident's actions and events in time order",
    )
    p.add_argument(
        "incident", metavar="INCIDENT", help="incident id (from `kvguard audit incidents`)"
    )
    _json_option(p)
    p.set_defaults(func=cmd_audit_timeline)


def _add_export(cmds: Any) -> None:
    p = cmds.add_parser(
        "export",
        parents=[_db_options()],
        help="dump a whole table as JSON or CSV",
        description="Dump every row of a table (actions by default), oldest first.",
    )
    fmt = p.add_mutually_exclusive_group(required=True)
    fmt.add_argument("--json", action="store_true", help="a JSON list of rows")
    fmt.add_argument("--csv", action="store_true", help="CSV with a header; JSON cells as text")
    p.add_argument("--table", choices=EXPORT_TABLES, default="actions", help="default: actions")
    _window_options(p)
    _instance_option(p)
    p.add_argument("--output", "-o", metavar="FILE", type=Path, help="write here, not stdout")
    p.set_defaults(func=cmd_audit_export)


def _add_import(cmds: Any) -> None:
    p = cmds.add_parser(
        "import",
        parents=[_db_options()],
        help="load a spill file of rows the daemon could not write",
        description="Load FILE, a spill file the daemon wrote at exit because its audit "
        "database would not take the rows (e.g. /var/lib/kvguard/audit.db.spill.jsonl), into "
        "the database, migrating it first if needed. The database must exist (`kvguard db "
        "upgrade` creates one), and be the one the file was spilled from, as its header "
        "says (else --force). Rows already there are skipped (actions "
        "and events by the uid they got when queued, incidents by id), so importing a file "
        "twice adds nothing. Afterwards FILE is renamed to FILE.imported-TIME, which can be "
        "deleted. The daemon does the same by itself at start once the database takes writes.",
    )
    p.add_argument("file", metavar="FILE", type=Path, help="the spill file (*.spill.jsonl)")
    p.add_argument("--keep", action="store_true", help="leave FILE where it is, not renamed")
    p.add_argument(
        "--force",
        action="store_true",
        help="load it even into a database other than the one its header names",
    )
    _json_option(p)
    p.set_defaults(func=cmd_audit_import)


def cmd_audit_list(args: argparse.Namespace) -> int:
    since, until = _window(args)
    limit = _limit(args.limit)
    store = _open_store(args)
    if args.incident is not None:
        _require_incident(store, args.incident)
    rows = store.list_actions(
        since=since,
        until=until,
        rule=args.rule,
        action=args.action,
        outcome=args.outcome,
        incident=args.incident,
        limit=_one_more(limit),
        instance=args.instance,
        request=args.request,
    )
    if args.request is not None:
        events = _request_events(args, store, since, until, limit)
        return _print_request_rows(args, rows, events, limit)
    rows = _newest(rows, limit, "actions")
    if args.json:
        return _print_json(rows)
    # INSTANCE last, whether or not --instance is given, as `incidents` has it: on a fleet's
    # database, two daemons' rows told apart; the columns before it where they were
    headers = ("ID", "TIME", "RULE", "ACTION", "SIGNAL", "OUTCOME", "INCIDENT", "INSTANCE")
    _print_table(headers, [_action_cells(r) for r in rows], empty="no actions")
    return 0


def _request_events(
    args: argparse.Namespace,
    store: AuditStore,
    since: datetime | None,
    until: datetime | None,
    limit: int | None,
) -> list[dict[str, Any]]:
    """The events `list --request` shows beside the actions (an OOM that requeued the
    request): none where --rule, --action or --outcome is given, since no event has those."""
    if args.rule is not None or args.action is not None or args.outcome is not None:
        return []
    return store.list_events(
        since=since,
        until=until,
        incident=args.incident,
        limit=_one_more(limit),
        instance=args.instance,
        request=args.request,
    )


def _print_request_rows(
    args: argparse.Namespace,
    actions: list[dict[str, Any]],
    events: list[dict[str, Any]],
    limit: int | None,
) -> int:
    """`list --request`: the request's story, the actions and events naming it in time order,
    as a timeline shows them, with each row's id (`show ID` takes an action's), incident and
    daemon."""
    from kvguard.daemon.audit import in_time_order

    rows = _newest(in_time_order(actions, events), limit, "actions and events")
    if args.json:
        return _print_json(rows)
    headers = ("ID", "TIME", "TYPE", "WHAT", "SIGNAL", "RESULT", "INCIDENT", "INSTANCE")
    cells = [
        (str(r["id"]), *_timeline_cells(r), r["incident"] or "-", r["instance"] or "-")
        for r in rows
    ]
    _print_table(headers, cells, empty=f"no actions or events name {args.request}")
    return 0


def cmd_audit_show(args: argparse.Namespace) -> int:
    row = _open_store(args).get_action(args.id)
    if row is None:
        raise ValueError(f"no action with id {args.id}")
    if args.json:
        return _print_json(row)
    for key, value in row.items():
        print(f"{key:<13} {_text(value, pretty=True)}")
    return 0


def cmd_audit_incidents(args: argparse.Namespace) -> int:
    since, until = _window(args)
    store = _open_store(args)
    limit = _limit(args.limit)
    rows = store.list_incidents(
        since=since,
        until=until,
        open_only=args.open,
        limit=_one_more(limit),
        instance=args.instance,
    )
    rows = _newest(rows, limit, "incidents")
    if args.json:
        return _print_json(rows)
    headers = ("ID", "OPENED", "CLOSED", "PEAK", "ACTIONS", "INSTANCE", "SUMMARY")
    _print_table(headers, [_incident_cells(r) for r in rows], empty="no incidents")
    return 0


def cmd_audit_timeline(args: argparse.Namespace) -> int:
    store = _open_store(args)
    incident = store.get_incident(args.incident)
    rows = store.timeline(args.incident)
    if incident is None and not rows:
        raise _no_incident(args.incident)
    if args.json:
        return _print_json({"incident": incident, "timeline": rows})
    if incident is not None:
        _print_incident_header(incident)
    headers = ("TIME", "TYPE", "WHAT", "SIGNAL", "RESULT")
    _print_table(headers, [_timeline_cells(r) for r in rows], empty="no actions or events")
    return 0


def _require_incident(store: AuditStore, incident: str) -> None:
    """An incident id (`list --incident`) that names nothing in the database is an error, as
    `timeline`'s is: a typo, or an id from another database, must not read as an incident in
    which nothing was done. One whose row is gone but whose actions or events remain is known."""
    if store.get_incident(incident) is not None:
        return
    if store.list_actions(incident=incident, limit=1) or store.list_events(
        incident=incident, limit=1
    ):
        return
    raise _no_incident(incident)


def _no_incident(incident: str) -> ValueError:
    return ValueError(f"no incident {incident!r} (see `kvguard audit incidents`)")


def cmd_audit_export(args: argparse.Namespace) -> int:
    since, until = _window(args)
    store = _open_store(args)
    # streamed, a row at a time: a 90-day table does not fit in memory
    rows = store.export(args.table, since, until, args.instance)

    def write(out: IO[str]) -> None:
        if args.csv:
            _write_csv(out, _columns(args.table), rows)
        else:
            _write_json(out, rows)

    if args.output is None:
        write(sys.stdout)
    else:
        _write_output(args.output, write)
    return 0


def _write_output(path: Path, write: Callable[[IO[str]], None]) -> None:
    """Call `write` with a file that becomes `path` once it returns. A regular file is written
    beside it under a temporary name and renamed over it at the end: an export that fails
    midway (the database gone, a full disk, Ctrl-C, SIGTERM, SIGHUP) leaves the previous export
    whole rather than emptied, and a half-written one never under its name. The file replaced
    keeps its mode and, as far as this user may, its owner and group (`sudo kvguard audit
    export -o ~/x.json` leaves a user's file theirs). Where no temporary file can be made (a
    folder this user may not write in) an existing file this user may write is written in
    place, as a plain open() would. A FIFO or a device (/dev/stdout) is written to as it is.
    An error names --output and the path."""
    if path.is_dir():
        raise ValueError(f"--output {path}: is a directory: name a file in it")
    if path.exists() and not path.is_file():  # a FIFO, /dev/stdout: no rename there
        with _opened_output(path) as out:
            write(out)
        return
    shown = path
    try:  # the file a symlink names
        path = path.resolve() if path.is_symlink() else path
    except (RuntimeError, OSError):  # RuntimeError: a loop, before Python 3.13
        raise ValueError(f"--output {shown}: a symlink loop: name a file") from None
    folder = path.parent
    try:
        fd, name = tempfile.mkstemp(dir=folder, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        if path.is_file() and os.access(path, os.W_OK):
            with _opened_output(shown) as out:
                write(out)
            return
        why = "no such directory" if not folder.is_dir() else e.strerror
        raise ValueError(f"--output {shown}: cannot write in {folder}: {why}") from None
    tmp = Path(name)
    try:
        with _signals_raise():
            _keep_owner(fd, path)
            os.chmod(fd, _new_file_mode(path))
            with open(fd, "w", newline="") as out:
                write(out)
            os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise ValueError(f"--output {shown}: {e.strerror or e}") from None
        if isinstance(e, _Signalled):
            signame = signal.Signals(e.signum).name
            print(f"kvguard: export to {shown} stopped by {signame}", file=sys.stderr)
            raise SystemExit(128 + e.signum) from None
        raise


class _Signalled(BaseException):
    """SIGTERM or SIGHUP during an export's write (`_signals_raise`)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    """SIGTERM and SIGHUP raise `_Signalled` inside, so that the temporary file is removed
    (their default action ended the process and left it); the handlers are put back after. A
    signal ignored (nohup) stays ignored; off the main thread none can be set."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raised(signum: int, _frame: Any) -> None:
        raise _Signalled(signum)

    before = {}
    try:
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) is signal.SIG_DFL:
                before[sig] = signal.signal(sig, raised)
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _keep_owner(fd: int, path: Path) -> None:
    """Give the new file (`fd`) the owner and group of the file it replaces, where this user
    may (root may; another user only a group of theirs); else it stays this user's."""
    try:
        st = path.stat()
    except OSError:  # a new file: this user's
        return
    try:
        os.fchown(fd, st.st_uid, st.st_gid)
    except OSError:  # another owner refused (not root): the group alone, if one of this user's
        with contextlib.suppress(OSError):
            os.fchown(fd, -1, st.st_gid)


@contextlib.contextmanager
def _opened_output(path: Path) -> Iterator[IO[str]]:
    try:
        out = open(path, "w", newline="")  # noqa: SIM115 - closed below
    except OSError as e:
        raise ValueError(f"--output {path}: {e.strerror or e}") from None
    with out:
        yield out


def _new_file_mode(path: Path) -> int:
    """The mode the export gets: the file's it replaces, else a new file's (0666 less the
    umask), as a plain open() would leave it; never mkstemp's 0600."""
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def cmd_audit_import(args: argparse.Namespace) -> int:
    from kvguard.daemon.audit import AuditStore
    from kvguard.daemon.audit_migrate import current, head, require_database, shown, upgrade
    from kvguard.daemon.audit_spill import read, spilled_elsewhere

    url, default = _db_source(args)
    if args.file.is_dir():
        raise ValueError(f"{args.file} is a directory: name the spill file in it")
    if not args.file.is_file():
        raise ValueError(f"no spill file at {args.file}")
    try:  # never create a database: rows loaded into a stray one are rows lost from sight
        require_database(url)
    except ValueError:
        if _names_directory(url):  # said as it is: a directory, not a database missing
            raise
        how = f" ({DEFAULT_DB_HELP})" if default else ""
        raise ValueError(
            f"no audit database at {shown(url)}{how}: not importing {args.file}; pass --db URL "
            "or --config FILE to name the daemon's database (or set KVGUARD_STATE_DIR), or "
            "create this one with `kvguard db upgrade`"
        ) from None
    at = current(url)
    if _newer(at):  # this kvguard's migration would fail on it: nothing loaded
        raise ValueError(
            f"{shown(url)} is at schema revision {at}, newer than this kvguard knows "
            f"({head()}): a newer kvguard migrated it; load {args.file} with that kvguard's "
            "`kvguard audit import` (not imported, the file left as it is)"
        )
    headers = read(args.file).headers  # a file with lines but no header is refused there
    if not headers:  # empty (an older kvguard left such spills): nothing to load, nor to rename
        print(f"{args.file} is empty: nothing to import; the file left as it is")
        return 0
    spilled_from = spilled_elsewhere(headers, url)
    if spilled_from and not args.force:
        raise ValueError(
            f"{args.file} holds rows spilled from {', '.join(spilled_from)}, not {shown(url)}: "
            "pass --db URL or --config FILE to load it into its own database, or --force to "
            "load it into this one"
        )
    upgrade(url)  # the daemon may never have managed to migrate it
    store = AuditStore(url, host="-")
    try:
        res, renamed = _import_spill(store, args.file, args.keep)
    finally:
        store.stop()
    if args.json:
        return _print_json(
            {
                "file": str(args.file),
                "db": shown(url),
                "added": res.added,
                "skipped": res.skipped,
                "reapplied": res.reapplied,
                "unreadable_lines": res.unreadable,
                "renamed_to": str(renamed) if renamed else None,
            }
        )
    kinds = ", ".join(f"{k} {n}" for k, n in res.added.items()) or "nothing new"
    print(
        f"{args.file}: added {res.total} rows to {shown(url)} ({kinds}); "
        f"{res.skipped} already there; {res.reapplied} incident updates or purges applied"
    )
    if res.unreadable:
        lines = ", ".join(map(str, res.unreadable))
        print(f"skipped line(s) {lines}: cut short by an interrupted write, not JSON")
    if renamed is not None:
        print(f"renamed to {renamed}; delete it when you no longer need it")
    return 0


def _import_spill(store: AuditStore, path: Path, keep: bool) -> tuple[ImportResult, Path | None]:
    """Import `path`, and rename it out of the way unless `keep`. Claimed first
    (`audit_spill.claimed`): rows a daemon spills into it meanwhile go to a new file at its
    name, not into the one renamed `.imported-…` as done. `--keep` renames nothing, so rows
    appended meanwhile stay in the file, for its next import."""
    from kvguard.daemon import audit_spill

    if keep:
        return store.import_file(path), None
    with audit_spill.claimed(path) as claim:
        if claim is None:
            raise ValueError(
                f"{path} is being imported by another process (a daemon's start?): not "
                "imported; run this again once it is done, if the file is still there"
            )
        try:
            res = store.import_file(claim)
        except BaseException:
            left = audit_spill.unclaim(claim)
            if left != path:
                print(
                    f"kvguard: {path}'s rows are now in {left} ({path} holds rows spilled "
                    "since): import both once the error below is fixed",
                    file=sys.stderr,
                )
            raise
        return res, audit_spill.mark_imported(claim)


# -- kvguard db --------------------------------------------------------------------------------
def add_db_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    db = sub.add_parser(
        "db",
        help="migrate the audit database",
        description="The daemon migrates its audit database when it starts; these do it by hand "
        "(e.g. for a PostgreSQL database shared by a fleet).",
    )
    cmds = db.add_subparsers(
        dest="db_command", metavar="{upgrade,downgrade,current}", required=True
    )
    up = cmds.add_parser(
        "upgrade", parents=[_db_options()], help="create or migrate the database to a revision"
    )
    up.add_argument(
        "--revision",
        default="head",
        help="target revision, not older than the database's (default: %(default)s)",
    )
    up.set_defaults(func=cmd_db_upgrade)
    down = cmds.add_parser(
        "downgrade",
        parents=[_db_options()],
        help="take the database back to an older revision",
        description="Take the audit database back to an older revision, once every daemon using "
        "it runs a kvguard that reads that revision. `--revision base` drops every audit table "
        "and its rows.",
    )
    down.add_argument(
        "--revision",
        required=True,
        help="an older revision than the database's: e.g. 0003, -1 (one back), or base",
    )
    down.set_defaults(func=cmd_db_downgrade)
    cur = cmds.add_parser("current", parents=[_db_options()], help="print the database's revision")
    _json_option(cur)
    cur.set_defaults(func=cmd_db_current)


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    from kvguard.daemon.audit_migrate import current, head, shown, sqlite_path, upgrade

    url, default = _db_source(args)
    path = sqlite_path(url)
    created = path is not None and not path.exists()
    at = None if created else current(url)
    if _newer(at):
        raise ValueError(
            f"{shown(url)} is at revision {at}, newer than this kvguard knows (its newest: "
            f"{head()}): a newer kvguard migrated it, and there is nothing to upgrade it to; "
            "use that kvguard (or upgrade this one)"
        )
    order = _revisions()
    target = _revision_index(args.revision, at, order)
    if target < _index(at, order):
        raise ValueError(
            f"{shown(url)} is at revision {at}, newer than {args.revision}: an upgrade "
            f"does not take it back (`kvguard db downgrade --revision {args.revision}` does)"
        )
    made = _missing_dirs(path.parent) if created and path is not None else []
    try:
        upgrade(url, args.revision)
    except BaseException:
        if created and path is not None:  # leave no empty database behind
            _remove_sqlite(path, made)
        raise
    if created:  # never silently: a stray database is one the daemon does not read
        how = f" ({DEFAULT_DB_HELP})" if default else ""
        print(f"created a new audit database at {path}{how}", file=sys.stderr)
    print(f"{shown(url)}: at revision {current(url)}")
    return 0


def cmd_db_downgrade(args: argparse.Namespace) -> int:
    from kvguard.daemon.audit_migrate import current, downgrade, shown

    url = _db_url(args)
    at = current(url)  # the database must exist: a downgrade never creates one
    order = _revisions()
    if at is not None and at not in order:
        raise ValueError(
            f"{shown(url)} is at revision {at}, which this kvguard does not know (a newer "
            "kvguard's): take it back with that version's `kvguard db downgrade`"
        )
    target = _revision_index(args.revision, at, order)
    if target >= _index(at, order):
        raise ValueError(
            f"{shown(url)} is at revision {at or 'base (no audit tables)'}; {args.revision} is "
            "not older: a downgrade only goes back (`kvguard db upgrade` goes forward)"
        )
    downgrade(url, order[target] if target >= 0 else "base")
    print(f"{shown(url)}: at revision {current(url) or 'base (no audit tables)'}")
    return 0


def cmd_db_current(args: argparse.Namespace) -> int:
    from kvguard.daemon.audit_migrate import current, head, shown

    url = _db_url(args)
    rev, newest = current(url), head()
    if args.json:
        return _print_json({"url": shown(url), "revision": rev, "head": newest})
    if rev == newest:
        state = "up to date"
    elif _newer(rev):  # an upgrade cannot take it anywhere: say what it is
        state = f"newer than this kvguard's {newest}: a newer kvguard migrated it"
    else:
        state = f"behind {newest}: run `kvguard db upgrade`"
    print(f"{rev or 'none (empty database)'} ({state})")
    return 0


# -- helpers -----------------------------------------------------------------------------------
def _revisions() -> list[str]:
    """The schema revisions this kvguard ships, oldest first (they form one line)."""
    from alembic.script import ScriptDirectory

    from kvguard.daemon.audit_migrate import alembic_config

    script = ScriptDirectory.from_config(alembic_config())
    return [r.revision for r in reversed(list(script.walk_revisions()))]


def _newer(rev: str | None) -> bool:
    """Whether a database's revision is one this kvguard does not ship: a newer kvguard's
    (during a fleet's rolling upgrade). No upgrade of this kvguard's can go anywhere from it."""
    return rev is not None and rev not in _revisions()


def _index(rev: str | None, order: list[str]) -> int:
    """A revision's place in `order`; -1 for none (base: no audit tables)."""
    return -1 if rev is None else order.index(rev)


def _revision_index(text: str, at: str | None, order: list[str]) -> int:
    """Where a --revision lands in `order` (-1: base), from the database's revision `at`:
    `base`, `head`, a revision (or a unique prefix of one), or +N / -N steps from `at`."""
    value = text.strip()
    if value == "base":
        return -1
    if value in ("head", "heads"):
        return len(order) - 1
    if re.fullmatch(r"[+-]\d+", value):
        index = _index(at, order) + int(value)
        if not -1 <= index < len(order):
            raise ValueError(
                f"--revision {text}: {abs(int(value))} steps from revision {at or 'base'} is "
                f"past the ends (base .. {order[-1]})"
            )
        return index
    matches = [i for i, rev in enumerate(order) if rev.startswith(value)] if value else []
    if len(matches) != 1:
        raise ValueError(
            f"--revision {text}: {'ambiguous' if matches else 'unknown'} revision (this kvguard "
            f"knows base, {', '.join(order)} (head); or +N / -N steps)"
        )
    return matches[0]


def _missing_dirs(folder: Path) -> list[Path]:
    """`folder` and its parents that do not exist yet, deepest first."""
    missing = []
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return missing


def _remove_sqlite(path: Path, dirs: list[Path]) -> None:
    """Undo a failed first migration's SQLite file (and its journal files, and the folders
    made for it): the next `kvguard db upgrade` must find nothing, as before."""
    for suffix in ("", "-journal", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    for folder in dirs:
        try:
            folder.rmdir()
        except OSError:  # something else is in it now
            break


def _db_url(args: argparse.Namespace) -> str:
    return _db_source(args)[0]


def _db_source(args: argparse.Namespace) -> tuple[str, bool]:
    """(--db, else the config's audit.url, else the default database: the daemon's state
    directory as seen from this shell, see `state_dir(cli=True)`; whether it is the default)."""
    if args.db:
        return args.db, False
    from kvguard.daemon.config import load_config  # imports the engine: only when needed

    cfg = load_config(args.config)
    return cfg.audit_url(cli=True), cfg.audit.url is None


def _require_configs_database(args: argparse.Namespace, url: str, default: bool) -> None:
    """`--config` names the daemon's database only through its audit.url: a config without one
    leaves the default, in the state directory of the daemon's environment (./var/ of its
    working directory at worst), which this shell may not share. Where that database is not
    here, say so, rather than the usual hint to pass the --config just given."""
    from kvguard.daemon.audit_migrate import require_database, sqlite_path

    if args.db or args.config is None or not default:
        return
    try:
        require_database(url)
    except ValueError:
        if _names_directory(url):
            raise
        raise ValueError(
            f"no audit database at {sqlite_path(url)}: {args.config} sets no audit.url, so --config "
            "cannot say where the daemon keeps it (audit.db in the daemon's $STATE_DIRECTORY, "
            "else $KVGUARD_STATE_DIR, else ./var/ of the daemon's working directory); pass --db "
            "sqlite:///PATH/audit.db or set KVGUARD_STATE_DIR to that directory, or set "
            "audit.url in the config"
        ) from None


def _names_directory(url: str) -> bool:
    """Whether a SQLite URL names a directory (`require_database` says so)."""
    from kvguard.daemon.audit_migrate import sqlite_path

    path = sqlite_path(url)
    return path is not None and path.is_dir()


def _open_store(args: argparse.Namespace) -> AuditStore:
    """A store for reading only: the database must exist and be migrated."""
    from kvguard.daemon.audit import AuditStore
    from kvguard.daemon.audit_migrate import current, head, shown

    url, default = _db_source(args)
    _require_configs_database(args, url, default)
    at = current(url)
    if at is None:
        raise ValueError(f"{shown(url)} is not a kvguard audit database (run `kvguard db upgrade`)")
    if _newer(at):
        raise ValueError(
            f"{shown(url)} is at schema revision {at}, newer than this kvguard reads ({head()}): "
            "a newer kvguard migrated it; read it with that one (or upgrade this kvguard)"
        )
    if at != head():
        raise ValueError(
            f"{shown(url)} is at schema revision {at} and this kvguard reads {head()}: run "
            "`kvguard db upgrade` (a running daemon upgrades it when it starts)"
        )
    return AuditStore(url, host="-")


def _action_name(text: str) -> str:
    """An --action value: an action kvguard records (a rule's, its undo or an admin's), so that
    a typo (a rule's name, `reduce-batch`) is an error rather than an empty list."""
    from kvguard.rules.actions import ACTIONS  # only when given: --help stays fast

    if text not in ACTIONS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is no action: expected one of {', '.join(sorted(ACTIONS))}"
        )
    return text


def _request_id(text: str) -> str:
    """A --request value: an id as `kvguard audit` names requests, so that an empty one (a
    shell variable unset) is an error rather than every request."""
    value = text.strip()
    if not value:
        raise argparse.ArgumentTypeError(
            "expected a request id (cmpl-3fa2...-0) or a response id (cmpl-3fa2...), not ''"
        )
    return value


def _row_id(text: str) -> int:
    """An action id: a positive integer SQLite can hold (larger ones name no row)."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if not 0 < n < 2**63:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an action id, a whole number >= 1")
    return n


def parse_when(text: str, now: datetime | None = None, option: str = "--since") -> datetime:
    """A --since/--until value: a duration ago ('2h', '1h30m', '90s') or an ISO time (UTC if
    it has no offset, matching how times are stored and printed); `option` names it in an
    error."""
    value = text.strip()
    if re.fullmatch(rf"(?:{_PART})+", value):
        seconds = sum(float(n) * _UNITS[u] for n, u in re.findall(_PART, value))
        try:
            return (now or datetime.now(UTC)) - timedelta(seconds=seconds)
        except OverflowError:  # before the year 1: every row is newer
            return datetime.min.replace(tzinfo=UTC)
    try:
        t = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(
            f"{text!r} is not a time: expected a duration ago like 2h, 30m, 1d "
            "or an ISO time like 2025-01-31T12:00:00"
        ) from None
    try:
        return t.replace(tzinfo=UTC) if t.tzinfo is None else t.astimezone(UTC)
    except OverflowError:  # 0001-01-01T00:00+05:00 is before the year 1 in UTC
        raise ValueError(
            f"{option} {text}: out of range: in UTC it falls before 0001-01-01 or after 9999-12-31"
        ) from None


def parse_until(text: str, now: datetime | None = None) -> datetime:
    """An --until value: as `parse_when`, but an ISO time means the whole of the stretch it
    names (`_named_span`): one without fractional seconds (as the tables print times) the whole
    of that second, since rows keep microseconds and the row printed at 12:00:00 may have been
    written at 12:00:00.73; a minute or an hour alone the whole minute or hour, a date alone the
    whole day, a week alone the whole week; one with a fraction that instant."""
    t = parse_when(text, now, "--until")
    value = text.strip()
    if re.fullmatch(rf"(?:{_PART})+", value):
        return t
    span = _named_span(value)
    if not span:
        return t
    try:
        return t + span - timedelta(microseconds=1)  # rows end in microseconds
    except OverflowError:  # the last second (or minute, hour, day, week) there is
        return datetime.max.replace(tzinfo=UTC)


def _named_span(value: str) -> timedelta:
    """The stretch of time an ISO time names, by the precision it is written to: a week
    (2026-W50), a day (any date alone `fromisoformat` takes: 2026-12-07, 20261207, the week
    date 2026-W50-1), an hour (2026-12-07T22), a minute (22:38, 2238), a second (22:38:36), or
    none for a fraction (22:38:36.5, 223836,5: that instant). Matching only YYYY-MM-DD took a
    week date for its midnight, leaving out the rest of the day; and a minute was taken for
    its first second, so `--since 22:38 --until 22:38` listed nothing of that minute."""
    try:
        date.fromisoformat(value)
    except ValueError:
        m = _ISO_TIME.search(value)
        if m is None:  # fromisoformat took it, so this is not expected: its second, as before
            return timedelta(seconds=1)
        if m.group(4):
            return timedelta(0)
        if m.group(3):
            return timedelta(seconds=1)
        return timedelta(minutes=1) if m.group(2) else timedelta(hours=1)
    return timedelta(weeks=1) if re.fullmatch(r"\d{4}-?W\d\d", value) else timedelta(days=1)


def _window(args: argparse.Namespace) -> tuple[datetime | None, datetime | None]:
    since = parse_when(args.since) if args.since else None
    until = parse_until(args.until) if args.until else None
    if since and until and since > until:
        raise ValueError(f"--since {args.since} is after --until {args.until}")
    return since, until


def _limit(n: int) -> int | None:
    if n < 0:
        raise ValueError(f"--limit {n}: expected 0 (no limit) or more")
    return n or None


def _one_more(limit: int | None) -> int | None:
    """The rows to ask for: one past --limit tells whether it left any out, without counting
    the whole table."""
    return None if limit is None else limit + 1


def _newest(rows: list[dict[str, Any]], limit: int | None, what: str) -> list[dict[str, Any]]:
    """The newest `limit` of `rows` (oldest first, one more than `limit` asked for); when that
    leaves rows out, a note on stderr says so: a cut list must not read as the whole story."""
    if limit is None or len(rows) <= limit:
        return rows
    print(
        f"(the newest {limit} matching {what} shown, older ones left out: --limit 0 shows "
        "them all, --since/--until narrow the window)",
        file=sys.stderr,
    )
    return rows[len(rows) - limit :]


def _time(t: datetime | None) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ") if t else "-"


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.4g}"


def _signal(r: dict[str, Any]) -> str:
    if not r.get("signal"):
        return "-"
    threshold = f" (threshold {_num(r['threshold'])})" if r.get("threshold") is not None else ""
    return f"{r['signal']}={_num(r['value'])}{threshold}"


def _action_cells(r: dict[str, Any]) -> tuple[str, ...]:
    action = r["action"] + (" (undo)" if r["is_undo"] else "")
    rule, incident, instance = r["rule"] or "-", r["incident"] or "-", r["instance"] or "-"
    cells = (str(r["id"]), _time(r["time"]), rule, action, _signal(r), r["outcome"], incident)
    return (*cells, instance)


def _closed(r: dict[str, Any]) -> str:
    return _time(r["closed_at"]) if r["closed_at"] else "open"


def _incident_cells(r: dict[str, Any]) -> tuple[str, ...]:
    peak, count = str(r["peak_level"]), str(r["actions_count"])
    return (r["id"], _time(r["opened_at"]), _closed(r), peak, count, r["instance"], r["summary"])


def _print_incident_header(r: dict[str, Any]) -> None:
    print(f"incident {r['id']}  {r['summary']}")
    closed = f"closed {_time(r['closed_at'])}" if r["closed_at"] else "still open"
    print(
        f"opened {_time(r['opened_at'])}  {closed}  peak level {r['peak_level']}  "
        f"actions {r['actions_count']}  instance {r['instance']}  host {r['host']}"
    )


def _timeline_cells(r: dict[str, Any]) -> tuple[str, ...]:
    if r["type"] == "event":
        return (_time(r["time"]), "event", r["kind"], "-", r["detail"] or "-")
    what = f"{r['rule'] or 'manual'}: {r['action']}" + (" (undo)" if r["is_undo"] else "")
    result = r["outcome"] + (f": {r['error']}" if r["error"] else "")
    return (_time(r["time"]), "action", what, _signal(r), result)


def _text(value: Any, pretty: bool = False) -> str:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, dict | list):
        return json.dumps(value, indent=2 if pretty else None, sort_keys=True)
    return "" if value is None else str(value)


def _json_default(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def _finite(value: Any) -> Any:
    """`value` with every non-finite float (a signal read as +Inf, a NaN) as None: JSON has
    no Infinity or NaN, and a parser given Python's spelling of them refuses the whole text."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _dumps(value: Any) -> str:
    return json.dumps(
        _finite(value), indent=2, default=_json_default, ensure_ascii=False, allow_nan=False
    )


def _print_json(value: Any) -> int:
    print(_dumps(value))
    return 0


def _print_table(headers: Sequence[str], rows: Iterable[Sequence[str]], empty: str) -> None:
    """A rich table on a terminal; plain aligned columns in a pipe, for grep and awk."""
    rows = list(rows)
    if not rows:
        print(f"({empty})", file=sys.stderr)
        return
    if sys.stdout.isatty():
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text

        table = Table(header_style="bold")
        for i, h in enumerate(headers):
            # Ids and times are copied into the next command: keep them whole; fold the rest
            # over lines on a narrow terminal rather than hide any of it behind an ellipsis.
            keep = max(len(h), *(len(r[i]) for r in rows)) if h in WHOLE_COLUMNS else None
            table.add_column(h, min_width=keep, no_wrap=keep is not None, overflow="fold")
        for row in rows:  # the database's text, never rich markup: "[/var/x]" is a path
            table.add_row(*(Text(cell) for cell in row))
        Console().print(table)
        return
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    for row in [tuple(headers), *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


def _columns(table: str) -> list[str]:
    from kvguard.daemon.audit import TABLES

    return list(TABLES[table].c.keys())


def _write_json(out: IO[str], rows: Iterable[dict[str, Any]]) -> None:
    """`_dumps(list(rows))` and a newline, byte for byte, written a row at a time."""
    sep = "[\n"
    for r in rows:
        out.write(sep + "\n".join("  " + line for line in _dumps(r).split("\n")))
        sep = ",\n"
    out.write("[]\n" if sep == "[\n" else "\n]\n")


def _write_csv(out: IO[str], columns: list[str], rows: Iterable[dict[str, Any]]) -> None:
    writer = csv.DictWriter(out, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for r in rows:
        writer.writerow({k: _csv_cell(r[k]) for k in columns})


def _csv_cell(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return _text(value)

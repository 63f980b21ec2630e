"""`kvguard keys`: make, list, revoke and hash API keys (daemon/api_keys.py)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEFAULT_FILE = Path("/etc/kvguard/api_keys.yaml")
PRIORITIES = ("high", "normal", "low")


def add_keys_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    keys = sub.add_parser(
        "keys",
        help="make, list and revoke API keys for the OpenAI endpoints",
        description="The keys file (api.api_keys_file) holds SHA-256 digests, never keys: "
        "`add` prints a new key once. The daemon reads the file at start and on SIGHUP "
        "(systemctl reload kvguard).",
    )
    keys.add_argument(
        "--file",
        type=Path,
        default=DEFAULT_FILE,
        help="the API keys file, as api.api_keys_file names it (default: %(default)s)",
    )
    # --file after the action too (`kvguard keys list --file F`), where it is as often written;
    # not given there, the group's value (or default) stands
    after = argparse.ArgumentParser(add_help=False)
    after.add_argument("--file", type=Path, default=argparse.SUPPRESS, help="the API keys file")
    actions = keys.add_subparsers(
        dest="keys_command", metavar="{add,list,remove,hash}", required=True
    )
    add = actions.add_parser(
        "add",
        parents=[after],
        help="make a key, append its digest to the file and print the key (once)",
        description="Make a random key, append its SHA-256 to the file (created if absent) "
        "and print the key on standard output: it is not stored anywhere, so keep it now.",
    )
    add.add_argument("name", metavar="NAME", help="the key's name (metrics and errors show it)")
    add.add_argument(
        "--max-priority",
        choices=PRIORITIES,
        default="normal",
        help="the highest priority a request with this key may ask for (default: %(default)s)",
    )
    add.add_argument(
        "--default-priority",
        choices=PRIORITIES,
        default=None,
        help="the priority of a request that names none (default: normal, or low where "
        "--max-priority is low)",
    )
    add.add_argument(
        "--max-requests",
        type=_at_least_one,
        default=None,
        metavar="N",
        help="sequences the key may have queued or running at once (a request with n choices "
        "is n); more answer 429 (default: no limit)",
    )
    add.set_defaults(func=cmd_keys_add)
    lst = actions.add_parser("list", parents=[after], help="show each key's name and priorities")
    lst.add_argument("--json", action="store_true", help="print a JSON list")
    lst.set_defaults(func=cmd_keys_list)
    rm = actions.add_parser(
        "remove", parents=[after], help="revoke a key: drop its entry from the file"
    )
    rm.add_argument("name", metavar="NAME")
    rm.set_defaults(func=cmd_keys_remove)
    hsh = actions.add_parser(
        "hash",
        help="print the SHA-256 digest of a key read from standard input",
        description="For a key made elsewhere: put the printed digest in the file by hand.",
    )
    hsh.set_defaults(func=cmd_keys_hash)


def _at_least_one(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number, at least 1")
    return n


def cmd_keys_add(args: argparse.Namespace) -> int:
    from kvguard.daemon.api_keys import add_key

    key, note = add_key(
        args.file, args.name, args.max_priority, args.default_priority, args.max_requests
    )
    print(key)
    if note:
        print(note, file=sys.stderr)
    print(
        f"added {args.name!r} to {args.file}; reload the daemon to apply it "
        "(systemctl reload kvguard)",
        file=sys.stderr,
    )
    return 0


def _existing(path: Path) -> Path:
    """`list` and `remove` read a file that must be there: a typo in --file is an error, as the
    daemon's refusal to start on that path is (only `add` creates the file)."""
    if not path.is_file():
        what = "is not a regular file" if path.exists() else "not found"
        raise ValueError(
            f"API keys file {path} {what} (--file names another; `kvguard keys add` creates it)"
        )
    return path


def cmd_keys_list(args: argparse.Namespace) -> int:
    from kvguard.daemon.api_keys import read_entries

    entries, _ = read_entries(_existing(args.file))
    rows = [
        {
            "name": e.name,
            "max_priority": e.max_priority,
            "default_priority": e.default,
            "max_requests": e.max_requests,
            "sha256": e.sha256[:12],
        }
        for e in entries
    ]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print(f"no keys in {args.file}")
        return 0
    width = max(4, *(len(r["name"]) for r in rows))
    print(f"{'NAME':<{width}}  MAX     DEFAULT  REQUESTS  SHA256")
    for r in rows:
        limit = "-" if r["max_requests"] is None else str(r["max_requests"])
        print(
            f"{r['name']:<{width}}  {r['max_priority']:<6}  {r['default_priority']:<7}  "
            f"{limit:<8}  {r['sha256']}..."
        )
    return 0


def cmd_keys_remove(args: argparse.Namespace) -> int:
    from kvguard.daemon.api_keys import remove_key

    note = remove_key(_existing(args.file), args.name)
    if note:
        print(note, file=sys.stderr)
    print(f"removed {args.name!r} from {args.file}; reload the daemon to apply it", file=sys.stderr)
    return 0


def cmd_keys_hash(args: argparse.Namespace) -> int:
    from kvguard.daemon.api_keys import digest

    key = sys.stdin.readline().strip()
    if not key:
        raise ValueError("no key on standard input (expected one line holding the key)")
    print(digest(key))
    return 0

"""`kvguard serve` and `kvguard status`."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvguard.daemon.config import ApiConfig

# What --model takes (`serve`, `generate`): everything serving.model does, said alike in both.
MODEL_FORMS = (
    "a known model name (see `kvguard model list`), a Hugging Face-format model directory "
    "or a .gguf file"
)
# `kvguard status`'s token file where nothing names one: the one the systemd unit's
# LoadCredential= hands the daemon as its credential
DEFAULT_TOKEN_FILE = "/etc/kvguard/admin.token"


def add_serve_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "serve",
        help="run the daemon: OpenAI-compatible API, metrics, remedies",
        description="Serve a model over an OpenAI-compatible HTTP API. Without --config the built-in "
        "defaults serve smollm2-135m on 127.0.0.1:8000. Flags override the file.",
    )
    examples = str(Path(__file__).parent / "examples").replace("%", "%%")  # argparse's format
    p.add_argument(
        "--config",
        type=Path,
        help=f"YAML config (examples in {examples}); validated at start",
    )
    p.add_argument("--model", metavar="NAME|PATH", help=f"{MODEL_FORMS} (overrides serving.model)")
    p.add_argument("--host", help="bind address (overrides api.host; default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (overrides api.port; default 8000)")
    p.add_argument(
        "--tensor-parallel",
        type=int,
        metavar="N",
        help="split the model over N ranks: rank 0 in this process, N-1 worker processes it "
        "starts, one GPU each on CUDA (overrides serving.tensor_parallel; default 1)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        default=None,
        help="rules record what they would do and change nothing",
    )
    p.set_defaults(func=cmd_serve)


def _stacks_on_fatal_signals() -> None:
    """systemd's watchdog ends a daemon whose engine loop stopped beating with SIGABRT (the
    unit's WatchdogSignal=, unset: the default), which killed it without a word: every
    thread's stack now goes to stderr (the journal) first, so that the step that hung is named
    even where the stall WARNING, which names it too, did not get out (a crash in a native
    library, SIGSEGV, is named alike). Not where stderr has no file descriptor to write to."""
    import faulthandler

    with contextlib.suppress(RuntimeError, OSError, ValueError):
        faulthandler.enable(all_threads=True)


def cmd_serve(args: argparse.Namespace) -> int:
    import signal

    _stacks_on_fatal_signals()
    # A reload (SIGHUP) before the daemon can take one is ignored, from the first moment: its
    # default action would kill the process during the imports below (seconds: torch), before
    # the service installs its own handler (which logs that it is not ready yet).
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    from kvguard.daemon.config import apply_overrides, load_config
    from kvguard.daemon.service import run

    overrides = {
        "model": args.model,
        "host": args.host,
        "port": args.port,
        "dry_run": args.dry_run,
        "tensor_parallel": args.tensor_parallel,
    }
    cfg = apply_overrides(load_config(args.config), **overrides)
    cfg.check_start()  # what the engine cannot serve, files it cannot read: before the bind
    return run(cfg, args.config, overrides)  # a reload applies the flags again


def add_status_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "status",
        help="show a running daemon's state (knobs, queues, KV, admission)",
        description="Query GET /admin/state of a running daemon.",
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        type=Path,
        help="the daemon's config: its address (api.host, api.port) and admin token file "
        "(api.admin_token_file), where --url and --token-file are not given",
    )
    p.add_argument(
        "--url",
        default=None,
        help="daemon base URL (default: from --config, else $KVGUARD_URL or http://127.0.0.1:8000)",
    )
    p.add_argument(
        "--token-file",
        type=Path,
        default=None,
        help="file holding the admin bearer token (default: --config's api.admin_token_file, "
        f"else $KVGUARD_ADMIN_TOKEN_FILE or {DEFAULT_TOKEN_FILE})",
    )
    p.add_argument("--json", action="store_true", help="print the raw JSON state")
    p.set_defaults(func=cmd_status)


def cmd_status(args: argparse.Namespace) -> int:
    import httpx

    api = _config_api(args.config)
    # the URL first: a malformed one is an error of its own, which a token file that cannot be
    # read (no /etc/kvguard/admin.token on this host) hid behind the token's error
    url, source = _status_url(args.url, api, args.config)
    _check_url(url, source)
    token_file = _token_file(args.token_file, api)
    try:
        token = token_file.read_text().strip()
    except OSError as e:
        raise ValueError(f"cannot read the admin token from {token_file}: {e.strerror}") from e
    except UnicodeDecodeError:
        raise ValueError(
            f"{token_file} is not UTF-8 text: expected the daemon's admin token"
        ) from None
    if not token:
        raise ValueError(f"{token_file} is empty: expected the daemon's admin token")
    problem = token_problem(token)
    if problem:
        raise ValueError(f"{token_file} {problem}: expected the daemon's admin token alone")
    try:
        r = httpx.get(
            url.rstrip("/") + "/admin/state",
            headers={"Authorization": f"Bearer {token}"},
            timeout=10,
        )
    except (httpx.InvalidURL, httpx.UnsupportedProtocol) as e:  # what _check_url let through
        raise _unusable_url(url, source, str(e)) from None
    except httpx.HTTPError as e:
        raise ValueError(f"cannot reach kvguard at {url}: {e}") from e
    if r.status_code != 200:
        raise ValueError(f"{url} answered {r.status_code}: {r.text[:200]}")
    not_state = ValueError(
        f"{url.rstrip('/')}/admin/state did not answer kvguard's state (is this a kvguard daemon?)"
    )
    try:
        state = r.json()
    except ValueError:  # HTML, or nothing: another server on the port
        raise not_state from None
    if not isinstance(state, dict) or not state.keys() >= STATE_KEYS:
        raise not_state
    if args.json:
        print(json.dumps(state, indent=2))
        return 0
    out = io.StringIO()
    try:  # the whole table or none of it
        with contextlib.redirect_stdout(out):
            _print_state(state)
    except (KeyError, TypeError, ValueError, AttributeError):
        raise not_state from None
    print(out.getvalue(), end="")
    return 0


def token_problem(token: str) -> str | None:
    """Why an admin token (a token file's text less the whitespace around it: the newline an
    editor or `base64` ends it with) is not one an HTTP client can send, or None. Said without
    the token: the message goes to logs, cron mail, CI output and the 403 any client gets, and
    a file with a second line may hold anything."""
    if "\n" in token or "\r" in token:
        return "holds more than one line"
    bad = next((c for c in token if not " " <= c <= "~"), None)
    if bad is None:
        return None
    if ord(bad) < 32 or ord(bad) == 127:
        return f"holds a control character (U+{ord(bad):04X}), which a bearer token cannot hold"
    return "holds a character outside ASCII, which a bearer token cannot hold"


# What every kvguard daemon's /admin/state holds (newer fields are read with .get)
STATE_KEYS = frozenset(
    {"model", "ready", "draining", "kv", "queues", "admission", "knobs", "preemptions"}
)

# what a reload of a daemon started without --config read (its `reload_refused.config` is null)
NO_CONFIG_READ = "started without --config: it read the built-in defaults and packaged rules again"


def _config_api(path: Path | None) -> ApiConfig | None:
    """The `api` section of the daemon's config (`--config`), read as `kvguard serve` and
    `kvguard audit --config` read it (relative paths in it are relative to it); None without."""
    if path is None:
        return None
    from kvguard.daemon.config import load_config  # imports the engine: only when needed

    return load_config(path).api


def _status_url(
    given: str | None, api: ApiConfig | None = None, config: Path | None = None
) -> tuple[str, str]:
    """The daemon's URL and where it came from (`--url`, `--config`, `$KVGUARD_URL` or the
    default), so that an error names what the operator should fix."""
    if given is not None:
        return given, "--url"
    if api is not None:
        return _api_url(api, config), f"--config {config}"
    env = os.environ.get("KVGUARD_URL")
    if env:
        return env, "$KVGUARD_URL"
    return "http://127.0.0.1:8000", "the default URL"


def _api_url(api: ApiConfig, config: Path | None) -> str:
    """The URL the daemon `api` configures answers at on this host: an address that binds every
    one (0.0.0.0, ::) is reached on loopback."""
    if api.port == 0:
        raise ValueError(
            f"--config {config}: api.port is 0 (any free port): the daemon's log says which it "
            "took (`API bound to HOST:PORT`); pass --url"
        )
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(api.host, api.host)
    if ":" in host:  # an IPv6 address
        host = f"[{host}]"
    return f"http://{host}:{api.port}"


def _token_file(given: Path | None, api: ApiConfig | None) -> Path:
    """--token-file, else the config's admin token file, else $KVGUARD_ADMIN_TOKEN_FILE or
    the default (a config that names none: the unit hands the daemon DEFAULT_TOKEN_FILE as its
    credential)."""
    if given is not None:
        return given
    path = api.admin_token_path() if api is not None else None
    return path or Path(os.environ.get("KVGUARD_ADMIN_TOKEN_FILE", DEFAULT_TOKEN_FILE))


def _check_url(url: str, source: str) -> None:
    """Refuse a URL httpx cannot send a request to, as httpx and httpcore word it, before
    anything else is read or sent."""
    import httpx

    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as e:
        raise _unusable_url(url, source, str(e)) from None
    if parsed.scheme in ("http", "https") and parsed.host:
        return
    if parsed.scheme in ("http", "https"):
        problem = "Request URL has no host"
    elif "://" in url:
        problem = f"Request URL has an unsupported protocol '{parsed.scheme}://'"
    else:
        problem = "Request URL is missing an 'http://' or 'https://' protocol"
    raise _unusable_url(url, source, problem)


def _unusable_url(url: str, source: str, problem: str) -> ValueError:
    """The error of a malformed URL: what is wrong, and the option or variable it came from."""
    return ValueError(
        f"{source}: {url!r} is not a usable URL: {problem.rstrip('.')} (expected e.g. "
        "http://127.0.0.1:8000)"
    )


def _reload_applied(refused: dict) -> str:
    """What of a reload that did not apply is in force, by what became of its engine knobs
    (`knobs`: None, nothing; "still_applying", they may still apply; "applied_late")."""
    path = refused.get("config")
    file = path or "the reload"  # null: started without --config
    read = f" ({NO_CONFIG_READ})" if path is None else ""
    knobs = refused.get("knobs")
    if knobs == "still_applying":
        return (
            f"the engine is still applying the live knobs of {file}{read}, which may still "
            "apply; nothing else of it applied"
        )
    if knobs == "applied_late":
        return f"the live knobs of {file} applied late{read}; nothing else of it: reload again"
    return f"nothing of {file} applied{read}, the config in force stands"


def _print_state(s: dict) -> None:
    kv = s["kv"]
    dev = kv["device"]
    q = s["queues"]
    adm = s["admission"]
    # why it is not ready ("engine loop stalled", "draining", ...; absent from older daemons)
    why = f" ({s['ready_reason']})" if not s["ready"] and s.get("ready_reason") else ""
    print(f"model        {s['model']}  ready={s['ready']}{why} draining={s['draining']}")
    if s.get("dry_run"):  # the rules decide but change nothing: say so before what they show
        print("dry run      on: rules record what they would do and change nothing")
    refused = s.get("reload_refused")  # absent from older daemons
    if refused:  # `systemctl reload` succeeds whatever the file holds: said here, as in STATUS=
        print(f"reload       {refused['outcome']} at {refused['at']}: {_reload_applied(refused)}")
        for problem in refused["errors"]:  # each on a line of its own, as the log has them
            print("             " + " ".join(problem.split()))
    print(
        f"kv cache     {kv['dtype']}  {dev['blocks_used']}/{dev['blocks_total']} blocks "
        f"({dev['usage_ratio']:.1%})  host {kv['host']['blocks_used']}/{kv['host']['blocks_total']}"
    )
    for state in ("running", "waiting", "swapped"):
        row = "  ".join(f"{p}={n}" for p, n in q[state].items())
        print(f"{state:<12} {row}")
    if "in_flight" in s:  # requests not finished, those a stalled engine has not taken in too
        print(f"in flight    {s['in_flight']}")
    halted = f"halted (allowed: {adm['allow_priority']})" if adm["halted"] else "open"
    holders = [r["name"] for r in s.get("rules", []) if "admission" in r.get("holds", ())]
    if "admission" in (s.get("manual") or {}).get("holds", ()):  # an operator's admin action
        holders.append("manual")
    if adm["halted"] and holders:  # the rules whose remedy in force halted it, the operator
        halted += " by " + ", ".join(holders)
    print(f"admission    {halted}")
    if adm.get("estimate"):  # absent from older daemons
        print("estimate     " + _estimate_line(adm))
    tp = s.get("tensor_parallel")  # absent from older daemons
    if tp and (tp["size"] > 1 or tp.get("pipeline_stages", 1) > 1):
        print("ranks        " + _ranks_line(tp))
    if s.get("host_memory_used_ratio") is not None:  # absent from older daemons
        print(f"host memory  {s['host_memory_used_ratio']:.1%} used")
    if "api_keys" in s:
        keys = s["api_keys"]
        print(
            "api keys     "
            + ("none (open)" if keys is None else f"{keys['keys']} from {keys['file']}")
        )
    print("knobs        " + "  ".join(f"{k}={v}" for k, v in s["knobs"].items()))
    print("preemptions  " + "  ".join(f"{k}={v}" for k, v in s["preemptions"].items()))
    audit = s.get("audit")  # absent from older daemons
    if audit is not None:
        print("audit        " + (f"degraded: {audit['reason']}" if audit["degraded"] else "ok"))
    if s.get("rules"):
        for r in s["rules"]:
            print(f"rule         {r['name']:<20} {r['state']}")


def _ranks_line(tp: dict) -> str:
    """Tensor parallelism at a glance: the ranks, the worker processes, a failure if any."""
    pids = ", ".join(str(p) for p in tp["worker_pids"])
    sizes = [b / 2**20 for b in tp["kv_cache_rank_bytes"]] or [0.0]
    # uneven pipeline stages (pipeline_layers) hold pools of different sizes: the range, not
    # rank 0's alone (18 MiB said for a stage holding 256)
    lo, hi = f"{min(sizes):.0f}", f"{max(sizes):.0f}"
    per_rank = lo if lo == hi else f"{lo}-{hi}"
    stages = tp.get("pipeline_stages", 1)  # absent from older daemons
    split = f"{tp['size']} tensor-parallel" + (f" x {stages} pipeline stages" if stages > 1 else "")
    line = f"{split}  workers pid {pids}  KV {per_rank} MiB per rank"
    return line + (f"  FAILED: {tp['failure']}" if tp["failure"] else "")


def _estimate_line(adm: dict) -> str:
    """Predicted admission at a glance: the share of max_tokens it plans for, per bucket, and
    how far recent outputs ran from that plan."""
    ratios = "  ".join(f"{b}={r:.2f}" for b, r in (adm.get("output_ratio") or {}).items())
    err = adm.get("estimate_error") or {}
    return (
        f"{adm['estimate']}  output/max_tokens {ratios or 'cold: worst case'}  "
        f"error {err.get('mean', 0.0):+.2f}  outran {err.get('undershoot_share', 0.0):.0%} "
        f"of {err.get('samples', 0)}  overcommit {adm.get('overcommit', 1.0):.2f}x"
    )

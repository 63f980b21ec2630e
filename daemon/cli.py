"""The `kvguard` command line: one entry point, one subcommand per job.

Each subcommand is registered by a builder in SUBCOMMANDS, so later ones (serve, status, audit,
rules, alerts, systemd, db, bench) plug in without touching the others. Handlers import the engine
lazily: `kvguard --help` and argument errors answer at once instead of after loading torch.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

# `kvguard serve`: a reload (SIGHUP) before the daemon can take one is ignored from the first
# line of kvguard that runs (the console script imports this module first), not from when the
# subcommand's handler runs: SIGHUP's default action would end the process during the imports
# and the parsing before it. The service's own handler, installed later, logs one.
if sys.argv[1:2] == ["serve"]:
    signal.signal(signal.SIGHUP, signal.SIG_IGN)

from kvguard.daemon.alerts_cli import add_alerts_parser  # noqa: E402
from kvguard.daemon.audit_cli import add_audit_parser, add_db_parser  # noqa: E402
from kvguard.daemon.bench_cli import add_bench_parser  # noqa: E402
from kvguard.daemon.cli_serve import MODEL_FORMS, add_serve_parser, add_status_parser  # noqa: E402
from kvguard.daemon.cli_worker import add_worker_parser  # noqa: E402
from kvguard.daemon.keys_cli import add_keys_parser  # noqa: E402
from kvguard.daemon.rules_cli import add_rules_parser  # noqa: E402
from kvguard.daemon.systemd_cli import add_systemd_parser  # noqa: E402
from kvguard.daemon.version import NOT_INSTALLED, kvguard_version  # noqa: E402

# Bad arguments, bad config, a key or model that cannot be used, an API address or port the
# service may not bind (`service.run`): what a new start would only repeat, so the systemd
# units set RestartPreventExitStatus=2 and stop there.
EXIT_USAGE = 2
# The command ran but failed (generate: an engine step ended a request), or failed on what may
# pass by itself (below): systemd starts the unit again.
EXIT_FAILURE = 1
# What may pass by itself: a peer not listening yet or gone (a daemon restarting, a host still
# booting), a network not up yet, a port still held.
TRANSIENT_ERRORS = (
    ConnectionRefusedError,
    ConnectionResetError,
    ConnectionAbortedError,
    TimeoutError,
    EOFError,
)
TRANSIENT_ERRNOS = frozenset(
    {errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ENETDOWN, errno.EHOSTDOWN, errno.EADDRINUSE}
)
Handler = Callable[[argparse.Namespace], int]
SubcommandBuilder = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]

MODEL_HELP = f"{MODEL_FORMS} (default: %(default)s)"


# -- kvguard model -----------------------------------------------------------------------------
def add_model_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    model = sub.add_parser(
        "model",
        help="list and fetch models in the local cache",
        description="Models live in $KVGUARD_HOME/models (default ~/.cache/kvguard/models).",
    )
    actions = model.add_subparsers(dest="model_command", metavar="{list,fetch}", required=True)
    lst = actions.add_parser("list", help="show known models and whether they are cached")
    lst.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    lst.set_defaults(func=cmd_model_list)
    fetch = actions.add_parser(
        "fetch",
        help="download and convert a model into the cache",
        description="Download and convert a known model into the cache and print its directory "
        "(for a GGUF-born model both forms: fp32, then the 4-bit packed one `serve` uses).",
    )
    fetch.add_argument("name", metavar="NAME", help="a known model name, e.g. smollm2-135m or tiny")
    fetch.add_argument(
        "--force", action="store_true", help="fetch and convert again even if cached"
    )
    fetch.set_defaults(func=cmd_model_fetch)


def cmd_model_list(args: argparse.Namespace) -> int:
    from kvguard.engine.config import kvguard_home
    from kvguard.engine.model_registry import list_models

    rows = list_models(kvguard_home())
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    table = []
    for row in rows:
        table.append((row["name"], *_cache_cells(row), row["description"]))
        packed = row.get("packed")
        if packed is not None:  # the form `serve` uses by default (model_quantization: auto)
            what = f"served by default ({packed['description']})"
            table.append(("  packed", *_cache_cells(packed), what))
    # as wide as the longest name: a converted GGUF is listed by its file's path (the header
    # alone where nothing is listed)
    width = max(len("NAME"), max((len(name) for name, *_ in table), default=0))
    print(f"{'NAME':<{width}} {'CACHED':<7} {'SIZE':>9}  DESCRIPTION")
    for name, cached, size, what in table:
        print(f"{name:<{width}} {cached:<7} {size:>9}  {what}")
    return 0


def _cache_cells(row: dict[str, Any]) -> tuple[str, str]:
    """A `model list` row's CACHED and SIZE cells."""
    if not row["cached"]:
        return "no", "-"
    return "yes", f"{row['size_bytes'] / 2**20:.1f}MiB"


def cmd_model_fetch(args: argparse.Namespace) -> int:
    from kvguard.engine.config import kvguard_home
    from kvguard.engine.model_registry import KNOWN_MODELS, fetch_model

    home = kvguard_home()
    print(fetch_model(args.name, home, force=args.force, progress=True))
    if KNOWN_MODELS[args.name].gguf is not None:  # and the packed form `serve` uses by default
        print(fetch_model(args.name, home, force=args.force, progress=True, packed=True))
    return 0


# -- kvguard generate --------------------------------------------------------------------------
# what `generate` samples with where a flag is left out and the model's generation_config.json
# sets nothing (greedy: an offline run is repeatable)
GENERATE_DEFAULTS: dict[str, int | float] = {
    "max_tokens": 64,
    "temperature": 0.0,
    "top_p": 1.0,
    "top_k": 0,
}


def add_generate_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    gen = sub.add_parser(
        "generate",
        help="generate text offline, without a server",
        description="Load a model, run the prompts as one batch, print the generated text.",
        epilog="example: kvguard generate --chat --max-tokens 32 'What is a KV cache?'",
    )
    gen.add_argument(
        "prompts",
        nargs="+",
        metavar="PROMPT",
        help="prompt text; several prompts run as one batch; '-' (once) reads a prompt from stdin",
    )
    gen.add_argument("--model", metavar="NAME|PATH", default="smollm2-135m", help=MODEL_HELP)
    # each of these left out: the model's generation_config.json value (--generation-config
    # auto), else the default named
    model_default = "the model's generation_config.json value, else "
    gen.add_argument(
        "--max-tokens",
        metavar="N",
        type=int,
        default=None,
        help="tokens to generate per prompt "
        f"(default: {model_default}{GENERATE_DEFAULTS['max_tokens']})",
    )
    gen.add_argument(
        "--temperature",
        metavar="T",
        type=float,
        default=None,
        help=f"0 is greedy (default: {model_default}{GENERATE_DEFAULTS['temperature']}, greedy)",
    )
    gen.add_argument(
        "--top-p",
        metavar="P",
        type=float,
        default=None,
        help="nucleus sampling mass in [0, 1], 0 greedy "
        f"(default: {model_default}{GENERATE_DEFAULTS['top_p']})",
    )
    gen.add_argument(
        "--top-k",
        metavar="K",
        type=int,
        default=None,
        help="sample from the k most likely tokens; 0 disables "
        f"(default: {model_default}{GENERATE_DEFAULTS['top_k']})",
    )
    gen.add_argument(
        "--generation-config",
        choices=("auto", "none"),
        default="auto",
        help="auto takes what a flag above leaves out from the model's generation_config.json "
        "(temperature, top_p, top_k, max_new_tokens), as transformers' generate() does; none "
        "ignores that file (default: %(default)s)",
    )
    gen.add_argument(
        "--seed", metavar="S", type=int, default=None, help="sampling seed: same seed, same output"
    )
    gen.add_argument(
        "--chat",
        action="store_true",
        help="wrap each prompt as a user message in the model's chat template",
    )
    gen.add_argument(
        "--json", action="store_true", help="print a JSON list with token ids and finish reasons"
    )
    gen.add_argument(
        "--kv-cache-bytes",
        metavar="SIZE",
        default=None,
        help="KV cache budget on CPU, e.g. 64MiB (default: the engine's)",
    )
    gen.add_argument(
        "--device",
        metavar="DEVICE",
        default="auto",
        help="auto, cpu, cuda or cuda:N (default: %(default)s)",
    )
    gen.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    from kvguard.engine import EngineConfig, LLMEngine, SamplingParams

    _stdin_once(args.prompts)
    config: dict[str, Any] = {"model": args.model, "device": args.device}
    if args.kv_cache_bytes is not None:
        config["kv_cache_bytes"] = args.kv_cache_bytes
    given = {name: getattr(args, name) for name in GENERATE_DEFAULTS}
    # the flags given are checked before the model loads (seconds, minutes for a large one)
    _check_sampling_flags({**given, "seed": args.seed})
    SamplingParams(**{k: v for k, v in given.items() if v is not None}, seed=args.seed)
    engine = LLMEngine.from_config(EngineConfig(**config))
    model = engine.sampling_defaults if args.generation_config == "auto" else {}
    params = SamplingParams(
        **{
            name: model.get(name, default) if given[name] is None else given[name]
            for name, default in GENERATE_DEFAULTS.items()
        },
        seed=args.seed,
    )
    prompts = [sys.stdin.read() if p == "-" else p for p in args.prompts]
    if args.chat:
        prompts = [_chat_prompt(engine.tokenizer, p) for p in prompts]
    # A rendered chat prompt already holds every special token the model expects.
    outs = _generate(engine, prompts, params, add_special_tokens=not args.chat)
    _print_outputs(prompts, outs, args.json)
    # The answers are printed all the same (the JSON says which failed); the status tells a
    # script that checks $? that an output is no answer.
    failed = sum(out.finish_reason == "error" for out in outs)
    if failed:
        print(
            f"kvguard: error: {failed} of {len(outs)} outputs failed "
            "(finish_reason error: an engine step running them failed)",
            file=sys.stderr,
        )
        return EXIT_FAILURE
    return 0


def _check_sampling_flags(given: dict[str, Any]) -> None:
    """ValueError naming the flag (`--max-tokens 0: ...`) whose value SamplingParams refuses:
    its own message names the library's field (`max_tokens=0`), which the command line has
    not, and a user looks for what they typed. Each flag given is checked alone."""
    from kvguard.engine import SamplingParams

    for name, value in given.items():
        if value is None:
            continue
        try:
            SamplingParams(**{name: value})
        except ValueError as e:
            said = str(e)
            reason = said.partition(": ")[2] if said.startswith(f"{name}=") else said
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} {value}: {reason}") from None


def _stdin_once(prompts: list[str]) -> None:
    """ValueError where '-' is given more than once: stdin reads to its end for the first,
    and each later one got an empty prompt, silently. Checked before the model loads."""
    n = prompts.count("-")
    if n > 1:
        raise ValueError(
            f"'-' (stdin) is given as {n} prompts, but stdin (-) can be read once: pass '-' "
            "for one prompt and the others as arguments"
        )


def _generate(engine: Any, prompts: list[str], params: Any, add_special_tokens: bool) -> list[Any]:
    """`engine.generate`, a refused prompt named as the command line counts its arguments
    (from 1, "prompt 2 of 3"), not by the list index the library's message gives."""
    try:
        return engine.generate(prompts, params, add_special_tokens=add_special_tokens)
    except ValueError as e:
        i = getattr(e, "prompt_index", None)
        if i is None:
            raise
        reason = str(e).removeprefix(f"prompts[{i}]: ")
        raise ValueError(f"prompt {i + 1} of {len(prompts)}: {reason}") from e


def _chat_prompt(tokenizer: Any, prompt: str) -> str:
    messages = [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def _print_outputs(prompts: list[str], outs: list[Any], as_json: bool) -> None:
    if not as_json:
        for out in outs:
            print(out.text)
        return
    rows = [
        {
            "request_id": out.request_id,
            "prompt": prompt,
            "prompt_token_ids": out.prompt_token_ids,
            "token_ids": out.token_ids,
            "text": out.text,
            "finish_reason": out.finish_reason,
        }
        for prompt, out in zip(prompts, outs, strict=True)
    ]
    print(json.dumps(rows, indent=2, ensure_ascii=False))


# -- entry point -------------------------------------------------------------------------------
SUBCOMMANDS: dict[str, SubcommandBuilder] = {
    "serve": add_serve_parser,
    "worker": add_worker_parser,
    "status": add_status_parser,
    "rules": add_rules_parser,
    "audit": add_audit_parser,
    "db": add_db_parser,
    "alerts": add_alerts_parser,
    "systemd": add_systemd_parser,
    "bench": add_bench_parser,
    "keys": add_keys_parser,
    "model": add_model_parser,
    "generate": add_generate_parser,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvguard",
        description="kvguard: an LLM inference daemon whose paged KV cache defends itself "
        "against running out of memory.",
        epilog="Set KVGUARD_HOME to move the model cache (default ~/.cache/kvguard).",
    )
    version = kvguard_version()
    parser.add_argument(
        "--version",
        action="version",
        version=f"kvguard {version}"
        if version != NOT_INSTALLED
        else "kvguard (unknown version: not installed, run from a source tree)",
        help="print the installed kvguard's version and exit",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for build in SUBCOMMANDS.values():
        build(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; expected failures print one line, not a traceback, and exit 2, or 1
    where a new start may get past them (systemd's RestartPreventExitStatus=2 tells them apart)."""
    args = build_parser().parse_args(argv)
    # OpenMP keeps libgomp's default wait policy (a worker spins briefly between parallel
    # regions, then sleeps). Forcing PASSIVE made every short region of a step wake a sleeping
    # worker: a served 82-token prompt took 0.39-0.74 s against 0.21-0.30 s. On cores shared
    # with other busy work, OMP_WAIT_POLICY=PASSIVE in the environment can serve better.
    handler: Handler = args.func
    from kvguard.engine.distributed.errors import RankFailure
    from kvguard.engine.model_config import ModelLoadError  # after parsing: --help stays fast

    try:
        return handler(args)
    except BrokenPipeError:  # `kvguard audit list | head`: the reader has what it wanted
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # no second error as Python flushes at exit
        return 128 + signal.SIGPIPE
    # ConfigError is a ValueError; a RankFailure here is a start a rank failed (one while
    # serving ends the daemon through the engine loop, with its own exit status): the rank's
    # host may be booting, its worker was killed, so a new start is worth it (exit 1)
    except (ModelLoadError, ValueError, OSError, RankFailure) as e:
        print(f"kvguard: error: {e}", file=sys.stderr)
        return EXIT_FAILURE if isinstance(e, RankFailure) or transient(e) else EXIT_USAGE
    except KeyboardInterrupt:
        return 130


def transient(error: BaseException) -> bool:
    """Whether `error` may pass without an operator: exit 1, so that systemd starts the unit
    again where RestartPreventExitStatus=2 would stop it. An error raised from another is also
    judged by that cause: `kvguard worker`'s "no kvguard master at HOST:PORT within Ns" is a
    ConnectionError raised from the last refused connection (transient), a wrong key's one
    raised from the key's rejection (not)."""
    return any(
        isinstance(e, TRANSIENT_ERRORS) or (isinstance(e, OSError) and e.errno in TRANSIENT_ERRNOS)
        for e in (error, error.__cause__)
    )


if __name__ == "__main__":
    sys.exit(main())

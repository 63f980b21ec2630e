"""Secrets stay out of errors, logs, audit rows and /ready.

- A keys-file error names the line and the field, never the file's text: a key written there
  by mistake (its digest belongs there) would otherwise reach the journal, the audit
  database's `config_error` rows, a reload's 400 and `kvguard keys list`.
- An `audit.url` is shown with its password hidden, also as a query parameter (`?password=`,
  `sslpassword`), and one that does not parse is not quoted whole.
- A token file no client can send (a second line, a control character) is an error naming the
  file and the problem, for `kvguard status` and for the daemon's admin API alike.
- The compiled CPU kernels and their cache folder are not writable by other users whatever
  the umask, and a cached library others could have written is never loaded.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from kvguard.daemon.admin_api import check_token
from kvguard.daemon.api_keys import KeysFileError, digest, load_keys
from kvguard.daemon.audit import AuditStore
from kvguard.daemon.audit_migrate import check_url, shown
from kvguard.daemon.cli import main
from kvguard.daemon.config import ConfigFileError, load_config
from kvguard.daemon.openai_api import ApiError
from kvguard.daemon.service import Service
from kvguard.kernels import cpu_lowbit

# a key as `kvguard keys add` prints it, and one made elsewhere (`kvguard keys hash`)
KEY = "kvg-SECRETraw0key0written0by0mistake0xxxxxxxxx"
OTHER_KEY = "sk-SECRETfromAnotherServer0123456789"
SECRET = "Hunter2SECRET"
RAW_KEY_HINT = (
    "a raw API key? The file holds SHA-256 digests, never keys: `kvguard keys add NAME` makes "
    "a key and writes its entry (`kvguard keys hash` prints the digest of a key made elsewhere)"
)


# -- 1. the API keys file ----------------------------------------------------------------------


def keys_errors(path: Path, text: str) -> list[str]:
    path.write_text(text)
    with pytest.raises(KeysFileError) as e:
        load_keys(path)
    return e.value.errors


@pytest.mark.parametrize(
    ("text", "line", "where", "said"),
    [
        # a list of keys, as other servers and `--api-key` lists take them
        (f"keys:\n  - {KEY}\n", 2, "keys[0]", "a string (expected a mapping of keys)"),
        (f"keys:\n  - {OTHER_KEY}\n", 2, "keys[0]", "a string (expected a mapping of keys)"),
        (f"keys: {KEY}\n", 1, "keys", "a string (expected a list)"),
        # a key pasted into a field
        (
            f"keys:\n  - name: web\n    sha256: {'a' * 64}\n    max_priority: {KEY}\n",
            4,
            "keys[0].max_priority",
            "not allowed (expected high, normal or low)",
        ),
        (
            f"keys:\n  - name: web\n    sha256: {'a' * 64}\n    max_requests: {KEY}\n",
            4,
            "keys[0].max_requests",
            "a string (expected an integer)",
        ),
        (
            f"keys:\n  - name: web\n    sha256: {KEY}\n",
            3,
            "keys[0].sha256",
            "expected the key's SHA-256 as 64 lowercase hex digits (kvguard keys hash)",
        ),
        (
            f"keys:\n  - name: {KEY * 2}\n    sha256: {'a' * 64}\n",
            2,
            "keys[0].name",
            "string should have at most 64 characters",
        ),
        # a key as a mapping's key, or under a key of its own
        (
            f"keys:\n  - {{name: web, sha256: {'a' * 64}, {KEY}: web}}\n",
            2,
            "keys[0]",
            "unknown key (expected one of: name, sha256, max_priority, default_priority, "
            "max_requests)",
        ),
        (
            f"keys:\n  - name: web\n    sha256: {'a' * 64}\n    key: {KEY}\n",
            4,
            "keys[0]",
            "unknown key (expected one of: name, sha256, max_priority, default_priority, "
            "max_requests)",
        ),
    ],
)
def test_a_raw_key_in_the_keys_file_is_never_quoted(
    tmp_path: Path, text: str, line: int, where: str, said: str
) -> None:
    """The line and the field, what was expected, and a hint that a key is not what the file
    holds; the key itself nowhere, neither for the daemon nor for `kvguard keys list`."""
    path = tmp_path / "keys.yaml"
    errors = keys_errors(path, text)
    assert errors == [f"{path}:{line}: {where}: {said}; {RAW_KEY_HINT}"]


def test_a_raw_key_is_not_quoted_by_keys_list(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "keys.yaml"
    for text in (f"keys:\n  - {KEY}\n", f"keys:\n  - {{{KEY}: web}}\n"):
        path.write_text(text)
        assert main(["keys", "--file", str(path), "list"]) == 2
        err = capsys.readouterr().err
        assert f"{path}:2: keys[0]" in err and "a raw API key?" in err
        assert "SECRET" not in err, err


def test_keys_file_typos_are_named_without_quoting_them(tmp_path: Path) -> None:
    """A typo of a field's name or of a priority is named by the known word it is close to;
    a short wrong value gets no hint about keys."""
    path = tmp_path / "keys.yaml"
    ok = digest("a")
    text = (
        f"keys:\n  - name: a\n    sha256: {ok}\n    max_priorty: high\n"
        f"  - name: b\n    sha256: {digest('b')}\n    max_priority: hihg\n"
        f"  - name: c d\n    sha256: {digest('c')}\n    max_requests: '5'\n"
    )
    assert keys_errors(path, text) == [
        f"{path}:4: keys[0]: unknown key (did you mean max_priority?) (expected one of: name, "
        "sha256, max_priority, default_priority, max_requests)",
        f"{path}:7: keys[1].max_priority: not allowed (did you mean high?) (expected high, "
        "normal or low)",
        f"{path}:8: keys[2].name: not allowed (expected letters, digits, '.', '_' or '-')",
        f"{path}:10: keys[2].max_requests: a string (expected an integer)",
    ]


# -- 2. audit.url ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "want"),
    [
        (
            f"postgresql+psycopg://kvguard@db/kvguard?password={SECRET}",
            "postgresql+psycopg://kvguard@db/kvguard?password=***",
        ),
        (
            f"postgresql+psycopg://kvguard@db/kvguard?sslmode=require&sslpassword={SECRET}",
            "postgresql+psycopg://kvguard@db/kvguard?sslmode=require&sslpassword=***",
        ),
        (
            f"postgresql+psycopg://kvguard:{SECRET}@db/kvguard?application_name=kvg",
            "postgresql+psycopg://kvguard:***@db/kvguard?application_name=kvg",
        ),
        # an `@` in the password not written %40: SQLAlchemy takes its rest for the host
        (f"postgresql://kvguard:x@{SECRET}@db/kvguard", "postgresql://kvguard:***@***@db/kvguard"),
        ("sqlite:////var/lib/kvguard/audit.db", "sqlite:////var/lib/kvguard/audit.db"),
    ],
)
def test_shown_hides_a_password_wherever_the_url_holds_it(url: str, want: str) -> None:
    assert shown(url) == want


@pytest.mark.parametrize(
    ("url", "masked", "why"),
    [
        # one slash: does not parse
        (
            f"postgresql+psycopg:/kvguard:{SECRET}@db/kvguard",
            "postgresql+psycopg:/***@db/kvguard",
            "",
        ),
        # the `@` left out: the password reads as a port
        (f"postgresql://kvguard:{SECRET}/kvguard", "postgresql://kvguard:***/kvguard", "port"),
        (
            f"postgres ql://kvguard@db/kvguard?password={SECRET}&x",
            "***@db/kvguard?password=***&***",
            "",
        ),
    ],
)
def test_a_url_that_does_not_parse_is_not_quoted_whole(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], url: str, masked: str, why: str
) -> None:
    """The config file's error (the start's, a reload's log line, 400 and `config_error`
    row), `shown` (logs) and `kvguard audit --db` all show it masked."""
    with pytest.raises(ValueError, match="is not a database URL") as e:
        check_url(url)
    assert str(e.value).startswith(f"{masked!r} is not a database URL")
    assert why in str(e.value) and SECRET not in str(e.value)
    assert shown(url) == repr(masked)
    config = tmp_path / "c.yaml"
    config.write_text(f"serving: {{model: tiny}}\naudit:\n  url: {url!r}\n")
    with pytest.raises(ConfigFileError) as ce:
        load_config(config)
    assert ce.value.errors[0].startswith(f"{config}:3: audit.url: {masked!r} is not a database")
    assert SECRET not in str(ce.value)
    assert main(["audit", "list", "--db", url]) == 2
    out, err = capsys.readouterr()
    assert masked in err and SECRET not in out + err, err


def test_a_query_password_is_hidden_in_ready_logs_and_the_spill_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A PostgreSQL server that refuses connections: the degraded reason (/ready's and
    /admin/state's), every log line and the spill file written at stop show the URL with
    `password=***`."""
    caplog.set_level(logging.DEBUG)
    with socket.socket() as closed:  # bound, never listening: a connection is refused at once
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        url = f"postgresql+psycopg://kvguard@127.0.0.1:{port}/kvguard?password={SECRET}"
        store = AuditStore(url, spill_dir=tmp_path)
        store.record_event("daemon_start", "test")
        store.start(wait=60)
        problem = store.problem()
        assert problem is not None and problem.startswith(
            f"cannot migrate postgresql+psycopg://kvguard@127.0.0.1:{port}/kvguard?password=***: "
        ), problem
        assert SECRET not in problem
        store.stop(timeout=1)
    assert store.spill_file is not None
    spilled = store.spill_file.read_text()
    assert "password=***" in spilled and SECRET not in spilled
    assert "password=***" in caplog.text and SECRET not in caplog.text


# -- 3. the admin token file -------------------------------------------------------------------

TOKEN = "tOkEn0123456789abcdefABCDEF+/="


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (f"{TOKEN}\n# rotated 2026-01, SECRET\n", "holds more than one line"),
        (f"{TOKEN}\nSECRET\n", "holds more than one line"),
        (f"{TOKEN}SECRET\r{TOKEN}\n", "holds more than one line"),
        (f"{TOKEN}SECRET\x00NUL\n", "holds a control character (U+0000), which a bearer token"),
        (f"{TOKEN}SECRET\tTAB\n", "holds a control character (U+0009), which a bearer token"),
        (f"{TOKEN}SECRÉT\n", "holds a character outside ASCII, which a bearer token"),
    ],
)
def test_status_refuses_a_token_file_no_client_can_send(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, problem: str
) -> None:
    """Named with the problem, never its content (the output goes to cron mail, CI logs),
    and before any request is made: here to a port that takes the connection (the listen
    backlog) and would let the HTTP client find the header it cannot send."""
    token = tmp_path / "admin.token"
    token.write_text(content)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        url = f"http://127.0.0.1:{server.getsockname()[1]}"
        assert main(["status", "--url", url, "--token-file", str(token)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvguard: error: {token} {problem}"), err
    assert "SECRET" not in err and TOKEN not in err


def test_status_names_a_token_file_that_is_not_text(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    token = tmp_path / "admin.token"
    token.write_bytes(b"\xff\xfeSECRET\n")
    assert main(["status", "--url", "http://127.0.0.1:9", "--token-file", str(token)]) == 2
    assert capsys.readouterr().err == (
        f"kvguard: error: {token} is not UTF-8 text: expected the daemon's admin token\n"
    )


# the 403 of a token file set but unusable: the log, not the client, reads which and why
DISABLED = (
    "admin API disabled: the admin token file cannot be used; the daemon's log names the "
    "problem (fix the file: it is read again at each request)"
)


def service_with_token(tmp_path: Path, content: bytes) -> tuple[Service, Path]:
    token = tmp_path / "admin.token"
    token.write_bytes(content)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"serving: {{model: tiny}}\napi: {{admin_token_file: {token}}}\n")
    return Service(load_config(cfg), cfg), token


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (f"{TOKEN}\n# rotated 2026-01 SECRET\n".encode(), "holds more than one line"),
        (f"{TOKEN}SECRET\x00\n".encode(), "holds a control character (U+0000)"),
        (f"{TOKEN}SECRÉT\n".encode(), "holds a character outside ASCII"),
        (b"\xff\xfeSECRET\n", "is not UTF-8 text"),
    ],
)
def test_the_daemon_turns_the_admin_api_off_for_such_a_token_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, content: bytes, problem: str
) -> None:
    """Not a token no client can send, leaving /admin/* dead without a word: the admin API
    is off, the start's (and each reload's) warning says why, quoting nothing, and the 403
    says it is off without naming the file or its problem (any client reads it)."""
    svc, token = service_with_token(tmp_path, content)
    got, why = svc.admin_token_status()
    assert got is None and why.startswith(f"api.admin_token_file {token} {problem}"), why
    with caplog.at_level(logging.WARNING, logger="kvguard.daemon"):
        svc.warn_admin_token()
    assert f"admin API disabled (/admin/* answers 403): {why}" in caplog.text
    with pytest.raises(ApiError) as e:
        check_token(svc, f"Bearer {TOKEN}")
    assert e.value.status == 403 and str(e.value) == DISABLED
    assert "SECRET" not in why + caplog.text


@pytest.mark.parametrize("content", [b"", b"\n"], ids=["0 bytes", "a newline"])
def test_an_empty_admin_credential_turns_the_admin_api_off_saying_so(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    content: bytes,
) -> None:
    """systemd's credential admin.token (api.admin_token_file unset), empty: the admin API is
    off, with the start's warning naming the credential and a 403 saying it is off. A 0-byte
    one counted as no credential at all: no warning, and a 403 blaming api.admin_token_file."""
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "admin.token").write_bytes(content)
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(creds))
    cfg = tmp_path / "c.yaml"
    cfg.write_text("serving: {model: tiny}\n")
    svc = Service(load_config(cfg), cfg)
    why = f"the credential {creds / 'admin.token'} is empty"
    assert svc.admin_token_status() == (None, why)
    with caplog.at_level(logging.WARNING, logger="kvguard.daemon"):
        svc.warn_admin_token()
    assert f"admin API disabled (/admin/* answers 403): {why}" in caplog.text
    with pytest.raises(ApiError) as e:
        check_token(svc, f"Bearer {TOKEN}")
    assert e.value.status == 403 and str(e.value) == DISABLED


def test_the_403_of_an_unreadable_token_file_names_no_path_and_the_log_does(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A token file that became unreadable after the start (replaced in place, its mode
    changed): the first request that meets it logs the file and the problem, once; the 403
    any client reads names neither (it used to give the path and the error)."""
    svc, token = service_with_token(tmp_path, f"{TOKEN}\n".encode())
    svc.warn_admin_token()  # usable at the start: nothing logged
    token.unlink()
    with caplog.at_level(logging.WARNING, logger="kvguard.daemon"):
        for _ in range(2):
            with pytest.raises(ApiError) as e:
                check_token(svc, f"Bearer {TOKEN}")
            assert e.value.status == 403 and str(e.value) == DISABLED
    assert str(token) not in str(e.value)
    logged = [r.message for r in caplog.records if "admin API disabled" in r.message]
    assert logged == [
        f"admin API disabled (/admin/* answers 403): cannot read api.admin_token_file {token}: "
        "No such file or directory"
    ]


def test_a_token_file_as_written_by_hand_or_base64_still_works(tmp_path: Path) -> None:
    """The whitespace around the token is not part of it: a trailing newline (or CRLF), an
    indent; a space inside is sent and compared as it is."""
    for content, want in (
        (f"{TOKEN}\n", TOKEN),
        (f"  {TOKEN}\r\n", TOKEN),
        (f"{TOKEN} two\n\n", f"{TOKEN} two"),
    ):
        svc, _ = service_with_token(tmp_path, content.encode())
        assert svc.admin_token_status() == (want, "")
        check_token(svc, f"Bearer {want}")  # accepted: raises nothing


# -- 4. the compiled CPU kernels -----------------------------------------------------------------

BUILD = """
import os, sys
os.umask(0)  # a hand-run daemon under the most permissive umask
from kvguard.kernels import cpu_lowbit
sys.exit(0 if cpu_lowbit.available() else 1)
"""


def writable_by_others(path: Path) -> bool:
    return bool(path.stat().st_mode & (stat.S_IWGRP | stat.S_IWOTH))


@pytest.fixture
def built() -> Path:
    """This kvguard's library, as the default cache holds it (before a test changes $CC)."""
    assert cpu_lowbit.available(), "the CPU kernels must build here"
    cc = cpu_lowbit.compiler()
    assert cc is not None
    return cpu_lowbit.cache_dir() / f"kvguard-cpu-{cpu_lowbit._key(cc)}.so"


def cached_library(built: Path, folder: Path, cc: str) -> Path:
    """A whole, loadable copy of the library, cached in `folder` under the name a build with
    compiler `cc` gives it."""
    path = folder / f"kvguard-cpu-{cpu_lowbit._key(cc)}.so"
    shutil.copyfile(built, path)
    return path


def test_under_umask_000_the_kernels_cache_is_not_writable_by_others(tmp_path: Path) -> None:
    """A real compile in a fresh kvguard home: the folders it creates and the library."""
    home = tmp_path / "home"
    env = {**os.environ, "KVGUARD_HOME": str(home)}
    env.pop("CC", None)
    proc = subprocess.run([sys.executable, "-c", BUILD], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    (lib,) = (home / "kernels").glob("kvguard-cpu-*.so")
    for path in (home, home / "kernels", lib):
        assert not writable_by_others(path), f"{path}: {stat.filemode(path.stat().st_mode)}"


def test_a_cached_library_others_could_write_is_built_again_not_loaded(
    built: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Its folder is this user's: the folder is made writable by its owner alone and the
    library is built again in place. The compiler here fails at once (`false`), so the build
    ends without one: the copy others could have written is gone all the same, never loaded."""
    false = shutil.which("false")
    assert false is not None
    monkeypatch.setenv("KVGUARD_HOME", str(tmp_path))
    monkeypatch.setenv("CC", false)
    kernels = tmp_path / "kernels"
    kernels.mkdir()
    lib = cached_library(built, kernels, false)
    for path in (kernels, lib):
        path.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="kvguard.kernels"):
        assert cpu_lowbit.library.__wrapped__() is None
    assert not lib.exists() and not writable_by_others(kernels)
    assert f"{lib} is writable by other users (mode 0777): not loaded; building it again" in (
        caplog.text
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="a file of another user's needs root to make")
def test_a_cached_library_of_another_user_is_not_loaded(
    built: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """In a folder of another user's: not loaded, and not built there either (torch's
    kernels, said once); a library of another user's in this user's folder is built again."""
    nobody = 65534
    false = shutil.which("false")
    assert false is not None
    monkeypatch.setenv("KVGUARD_HOME", str(tmp_path))
    monkeypatch.setenv("CC", false)
    kernels = tmp_path / "kernels"
    kernels.mkdir()
    lib = cached_library(built, kernels, false)
    os.chown(kernels, nobody, -1)
    with caplog.at_level(logging.WARNING, logger="kvguard.kernels"):
        assert cpu_lowbit.library.__wrapped__() is None
    assert (
        f"CPU low-bit kernels unavailable ({kernels} belongs to uid {nobody}, another user: its "
        "libraries are not loaded): quantized layers use torch's kernels" in caplog.text
    )
    assert lib.exists()
    # the folder this user's again, the library another's
    os.chown(kernels, os.geteuid(), -1)
    os.chown(lib, nobody, -1)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvguard.kernels"):
        assert cpu_lowbit.library.__wrapped__() is None
    assert f"{lib} belongs to uid {nobody}, another user: not loaded; building it" in caplog.text
    assert not lib.exists()

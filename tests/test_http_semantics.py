"""HTTP as clients other than the openai client speak it: kept-alive connections answered
without a delayed-ACK wait, HEAD on the probes, a compressed request body refused by name."""

from __future__ import annotations

import asyncio
import gzip
import http.client
import json
import socket
import time

import httpx

from kvguard.daemon.service import bind_api
from tests.test_server import Daemon


def test_api_socket_has_accepted_connections_send_at_once() -> None:
    """asyncio turns TCP_NODELAY on for a connection it accepts only when the listening
    socket says it is TCP; a socket made with protocol 0 left Nagle on, and every answer on a
    kept-alive connection waited for the client's delayed ACK."""
    sock = bind_api("127.0.0.1", 0)
    port = sock.getsockname()[1]

    async def accepted() -> int:
        got: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        class Proto(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                s = transport.get_extra_info("socket")
                got.set_result(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        server = await asyncio.get_running_loop().create_server(Proto, sock=sock)
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            value = await asyncio.wait_for(got, 30)
            writer.close()
            return value
        finally:
            server.close()

    assert asyncio.run(accepted()) != 0, "accepted connections keep Nagle's algorithm on"


def test_kept_alive_connection_answers_without_delay(tiny_daemon: Daemon) -> None:
    """Sequential requests on one connection, as every HTTP client library sends them: with
    Nagle on, each answer after the first waited for the client's delayed ACK (>= 40 ms on
    Linux, every time); the fastest of twenty is far below that with it off."""
    conn = http.client.HTTPConnection("127.0.0.1", tiny_daemon.port, timeout=30)
    took = []
    try:
        for _ in range(20):
            t0 = time.perf_counter()
            conn.request("GET", "/health")
            r = conn.getresponse()
            assert r.status == 200 and json.loads(r.read()) == {"status": "alive"}
            took.append(time.perf_counter() - t0)
    finally:
        conn.close()
    assert min(took[1:]) < 0.02, f"kept-alive answers took {sorted(took)[:3]} s at best"


def test_head_on_probes_and_models(tiny_daemon: Daemon) -> None:
    """`wget --spider` and uptime monitors probe with HEAD: the status and headers GET would
    have, no body."""
    for path in ("/health", "/ready", "/metrics", "/v1/models", "/v1/models/tiny"):
        head = httpx.head(tiny_daemon.url + path, timeout=30)
        get = httpx.get(tiny_daemon.url + path, timeout=30)
        assert head.status_code == get.status_code == 200, (path, head.status_code)
        assert head.content == b"", path
        assert head.headers["content-type"] == get.headers["content-type"], path
    assert httpx.head(tiny_daemon.url + "/v1/models/nope", timeout=30).status_code == 404


def test_compressed_body_refused_by_its_coding(tiny_daemon: Daemon) -> None:
    """A gzip body was parsed as it was ("invalid JSON: not UTF-8 text", blaming the JSON), and
    a body labelled `deflate` served as if unlabelled; both are a 415 naming the coding, with
    Accept-Encoding saying what is served. `identity` is no coding at all."""
    body = {"model": "tiny", "prompt": "a", "max_tokens": 1}
    raw = json.dumps(body).encode()
    url = tiny_daemon.url + "/v1/completions"
    for coding, data in (("gzip", gzip.compress(raw)), ("deflate", raw), ("br, gzip", raw)):
        headers = {"Content-Type": "application/json", "Content-Encoding": coding}
        r = httpx.post(url, content=data, headers=headers, timeout=60)
        assert r.status_code == 415, (coding, r.status_code, r.text)
        err = r.json()["error"]
        assert coding in err["message"] and err["code"] == "unsupported_content_encoding"
        assert err["param"] == "Content-Encoding"
        assert r.headers["accept-encoding"] == "identity"
    # a coding on a second header line counts as on the first (one list, RFC 9110)
    split = [("Content-Type", "application/json"), ("Content-Encoding", "identity")]
    split.append(("Content-Encoding", "gzip"))
    r = httpx.post(url, content=gzip.compress(raw), headers=split, timeout=60)
    assert r.status_code == 415 and "'gzip'" in r.json()["error"]["message"], r.text
    headers = {"Content-Type": "application/json", "Content-Encoding": "identity"}
    r = httpx.post(url, content=raw, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 1

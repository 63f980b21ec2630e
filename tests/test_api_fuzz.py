"""Property-based fuzzing of the HTTP API from its own OpenAPI schema: no input may cause a 5xx."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from kvguard.daemon.app import create_app
from kvguard.daemon.config import load_config
from kvguard.daemon.service import Service

CASES_PER_OPERATION = 40  # x the API's operations: well over 200 cases in all
CALLS = [0]


def _service(tmp: Path) -> Service:
    cfg_file = tmp / "config.yaml"
    cfg_file.write_text(
        "serving: {model: tiny, kv_cache_bytes: 4MiB, max_model_len: 512}\n"
        f"audit: {{url: 'sqlite:///{tmp / 'audit.db'}'}}\n"
    )
    svc = Service(load_config(cfg_file), cfg_file)
    svc.load(progress=False)
    # Fuzzed max_tokens can be huge: a cap keeps every case short (and is itself under test).
    svc.engine.set_max_new_tokens_cap(4).result(10)
    return svc


_TMP = Path(tempfile.mkdtemp(prefix="kvguard-fuzz-"))  # the schema is read at import
atexit.register(shutil.rmtree, _TMP, True)  # also when only collected (no teardown runs)
SERVICE = None


def _app():
    global SERVICE
    if SERVICE is None:
        SERVICE = _service(_TMP)
    return create_app(SERVICE)


schema = schemathesis.openapi.from_asgi("/openapi.json", _app())
# Invalid data too (wrong types, out-of-range numbers, missing and unknown fields): 4xx, never 5xx.
# Unpaired surrogates, huge integers and NaN, which the schema cannot express, are sent over real
# HTTP by tests/test_api_hostile.py.
schema.config.generation.update(modes=list(GenerationMode))


@pytest.fixture(scope="module", autouse=True)
def _stop_engine():
    yield
    SERVICE.close()
    shutil.rmtree(_TMP, ignore_errors=True)
    assert CALLS[0] >= 200, f"only {CALLS[0]} fuzz cases ran"


@schema.parametrize()
@settings(max_examples=CASES_PER_OPERATION, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_input_causes_a_server_error(case) -> None:
    response = case.call()
    CALLS[0] += 1
    assert response.status_code < 500, (
        f"{case.method} {case.path} -> {response.status_code}: {response.text[:300]}"
    )
    case.validate_response(response, checks=[not_a_server_error])

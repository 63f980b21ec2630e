"""The daemon's config file: defaults, the shipped examples, and errors an operator can act on."""

from __future__ import annotations

import dataclasses
import functools
import re
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from kvguard.daemon.config import (
    ConfigFileError,
    DaemonConfig,
    MiB,
    apply_overrides,
    inert_keys,
    load_config,
    parse_duration,
)
from kvguard.engine.admission import AdmissionConfig
from kvguard.engine.config import DistributedConfig, EngineConfig
from kvguard.engine.llm_engine import LLMEngine

DAEMON = Path(__file__).resolve().parents[1] / "daemon"
EXAMPLES = DAEMON / "examples"
ETC_CONFIG = DAEMON / "systemd" / "etc" / "kvguard" / "config.yaml"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvguard.yaml"
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


def errors_of(path: Path) -> list[str]:
    with pytest.raises(ConfigFileError) as info:
        load_config(path)
    assert str(info.value) == "\n".join(info.value.errors)
    return info.value.errors


# -- defaults ------------------------------------------------------------------------------------
def test_defaults_serve_the_default_model_on_loopback() -> None:
    cfg = load_config(None)
    assert (cfg.serving.model, cfg.api.host, cfg.api.port) == ("smollm2-135m", "127.0.0.1", 8000)
    assert cfg.served_model_name() == "smollm2-135m"
    engine = cfg.to_engine_config()
    assert engine.model == "smollm2-135m"
    assert engine.kv_cache_bytes == 256 * MiB
    assert (engine.block_size, engine.max_num_seqs, engine.max_model_len) == (16, 32, 4096)
    assert engine.admission is not None and engine.admission.safety_factor == 1.15
    assert engine.admission.reserved_headroom_bytes == cfg.reserved_headroom_mb() * MiB


def test_headroom_is_auto_per_device() -> None:
    """The seed's 2 GiB suits a GPU; on CPU it would exceed the whole 256 MiB KV budget."""
    cpu = DaemonConfig.model_validate({"serving": {"device": "cpu"}})
    cuda = DaemonConfig.model_validate({"serving": {"device": "cuda:0"}})
    assert cpu.to_engine_config().admission.reserved_headroom_bytes == 0
    assert cuda.to_engine_config().admission.reserved_headroom_bytes == 2048 * MiB


@pytest.mark.parametrize(
    "text", ["{}", "{}  # the built-in defaults\n", "---\n{}\n", "serving:\napi: ~\n"]
)
def test_empty_file_or_sections_mean_defaults(tmp_path: Path, text: str) -> None:
    assert load_config(write(tmp_path, text)).model_dump() == DaemonConfig().model_dump()


@pytest.mark.parametrize("text", ["", "# only a comment\n", "---\n", "\n\n# truncated\n"])
def test_a_file_that_holds_nothing_is_refused(tmp_path: Path, text: str) -> None:
    """An empty file used to mean every default: an editor's truncated write read by a reload
    turned API-key auth off and swapped the operator's rules for the packaged ones. It is
    refused, as an empty rules file is, naming the way to ask for the defaults."""
    path = write(tmp_path, text)
    assert errors_of(path) == [
        f"{path}:1: the config file holds nothing, or only comments (for the built-in "
        "defaults, write {})"
    ]


def test_etc_config_documents_the_defaults() -> None:
    """The commented /etc file lists the defaults: it must not drift from the code."""
    assert load_config(ETC_CONFIG).model_dump() == DaemonConfig().model_dump()


@pytest.mark.parametrize(
    ("text", "seconds"),
    [(30, 30.0), (2.5, 2.5), ("30s", 30.0), ("5m", 300.0), ("2h", 7200.0), ("90d", 7776000.0)]
    + [("500ms", 0.5), ("1h30m", 5400.0), ("45", 45.0)],
)
def test_durations(text: str | float, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


def test_units_are_converted(tmp_path: Path) -> None:
    cfg = load_config(
        write(
            tmp_path,
            "serving: {kv_cache_bytes: 1GiB}\naudit: {retention: 2w}\napi: {drain_timeout: 1m}",
        )
    )
    assert cfg.serving.kv_cache_bytes == 2**30
    assert (cfg.audit.retention, cfg.api.drain_timeout) == (14 * 86400.0, 60.0)


# -- shipped examples ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["single-gpu-7b", "dual-gpu-13b", "multi-gpu-70b", "cpu-smollm2"])
def test_examples_validate(name: str) -> None:
    load_config(EXAMPLES / f"{name}.yaml")


def test_seed_single_gpu_baseline_converts() -> None:
    engine = load_config(EXAMPLES / "single-gpu-7b.yaml").to_engine_config()
    assert (engine.model, engine.kv_cache_dtype, engine.max_num_seqs) == (
        "meta-llama/Llama-2-7b-hf",
        "fp16",
        32,
    )
    assert engine.admission.reserved_headroom_bytes == 2048 * MiB


def test_cpu_example_converts_with_offload_active() -> None:
    engine = load_config(EXAMPLES / "cpu-smollm2.yaml").to_engine_config()
    assert (engine.device, engine.kv_cache_bytes, engine.num_threads) == ("cpu", 256 * MiB, 2)
    assert engine.enable_cpu_offload and engine.min_gpu_blocks <= 364  # 256 MiB / 720 KiB blocks
    assert engine.admission.reserved_headroom_bytes == 8 * MiB


def test_cpu_example_sets_no_inert_key() -> None:
    """The CPU example is kvguard's own, not one of the brief's baselines: it set the brief's
    inert monitoring.oom_alert_threshold, and a daemon started on it as shipped logged a
    WARNING that the key changes nothing at every start and reload, teaching operators to
    ignore warnings."""
    assert inert_keys(load_config(EXAMPLES / "cpu-smollm2.yaml")) == []


def test_dual_gpu_baseline_is_accepted_as_written() -> None:
    """Tensor parallelism is served: the seed's two-card baseline converts unchanged."""
    path = EXAMPLES / "dual-gpu-13b.yaml"
    cfg = load_config(path)
    assert cfg.serving.tensor_parallel == 2 and cfg.offloading.min_gpu_blocks == 512
    engine = cfg.to_engine_config()
    assert (engine.tensor_parallel, engine.device, engine.kv_cache_dtype) == (2, "cuda", "fp8_e4m3")
    assert engine.tensor_parallel_timeout_s == 20.0
    assert engine.enable_cpu_offload and engine.admission.reserved_headroom_bytes == 4096 * MiB
    assert "cannot be served" not in path.read_text()


def test_large_baseline_is_accepted_as_written() -> None:
    """tensor_parallel 8 x pipeline_parallel 2 and awq_4bit weights: the file converts unchanged."""
    path = EXAMPLES / "multi-gpu-70b.yaml"
    engine = load_config(path).to_engine_config()
    assert (engine.tensor_parallel, engine.pipeline_parallel, engine.world_size) == (8, 2, 16)
    assert engine.model_quantization == "awq_4bit" and engine.pipeline_layers is None
    assert "cannot be served" not in path.read_text()


@pytest.fixture
def visible_gpus(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], None]:
    """Sets how many CUDA devices torch reports (0: no CUDA), as on a host with that many."""
    import torch

    def visible(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    return visible


def start_refusals(cfg: DaemonConfig) -> list[str]:
    """What `check_start` (run before the port is bound) refuses in `cfg`; [] if nothing."""
    try:
        cfg.check_start()
    except ConfigFileError as e:
        return e.errors
    return []


def test_a_host_with_fewer_gpus_than_its_ranks_is_refused_before_the_bind(
    tmp_path: Path, visible_gpus: Callable[[int], None]
) -> None:
    """Each rank takes a GPU of its own on CUDA. The 70B example (16 ranks) on an 8-GPU host
    stacked two ranks on every card, each sizing its KV pool as if the card were its own, and
    a 1-GPU host learnt that tensor_parallel 2 needs 2 GPUs only after the bind."""
    example = EXAMPLES / "multi-gpu-70b.yaml"
    large = apply_overrides(load_config(example), model=str(tmp_path))  # a model directory
    line = example.read_text().splitlines().index("  tensor_parallel: 8") + 1
    visible_gpus(8)
    assert start_refusals(large) == [
        f"{example}:{line}: serving.tensor_parallel: this config needs 16 GPUs, one per rank it "
        "runs here (tensor_parallel 8 x pipeline_parallel 2), and torch sees 8 (expected at most "
        "8 ranks on this host: lower tensor_parallel or pipeline_parallel, list the ranks other "
        "hosts run in serving.distributed.remote_ranks, or make more GPUs visible)"
    ]
    visible_gpus(16)
    assert start_refusals(large) == []
    # stage 1 on another host: this one runs 8 ranks
    (tmp_path / "worker.key").write_text("a shared secret for this test\n")
    path = write(
        tmp_path,
        f"""
        serving:
          model: {tmp_path}
          device: cuda
          tensor_parallel: 8
          pipeline_parallel: 2
          distributed: {{remote_ranks: [8, 9, 10, 11, 12, 13, 14, 15], authkey_file: worker.key}}
        """,
    )
    visible_gpus(8)
    assert start_refusals(load_config(path)) == []
    visible_gpus(7)
    [refused] = start_refusals(load_config(path))
    assert refused.startswith(
        f"{path}:4: serving.tensor_parallel: this config needs 8 GPUs, one per rank it runs here "
        "(tensor_parallel 8 x pipeline_parallel 2 less 8 in serving.distributed.remote_ranks), "
        "and torch sees 7 (expected at most 7 ranks on this host"
    ), refused
    # device auto takes CUDA where torch finds it: two stages on one GPU
    path = write(tmp_path, f"serving: {{model: {tmp_path}, pipeline_parallel: 2}}\n")
    visible_gpus(1)
    [refused] = start_refusals(load_config(path))
    assert refused.startswith(
        f"{path}:1: serving.pipeline_parallel: this config needs 2 GPUs, one per rank it runs "
        "here (tensor_parallel 1 x pipeline_parallel 2), and torch sees 1 (expected at most 1 "
        "rank on this host"
    ), refused


def test_a_gpu_example_on_a_host_without_enough_cuda_says_how_many_gpus_it_needs(
    tmp_path: Path, visible_gpus: Callable[[int], None]
) -> None:
    example = EXAMPLES / "dual-gpu-13b.yaml"
    dual = apply_overrides(load_config(example), model=str(tmp_path))
    device = example.read_text().splitlines().index("  device: cuda") + 1
    visible_gpus(0)
    assert start_refusals(dual) == [
        f"{example}:{device}: serving.device: 'cuda': torch finds no CUDA on this host, where this "
        "config needs 2 GPUs, one per rank it runs here (tensor_parallel 2 x pipeline_parallel "
        "1) (expected cpu or auto)"
    ]
    visible_gpus(1)
    [refused] = start_refusals(dual)
    assert refused.startswith(
        f"{example}:{device + 1}: serving.tensor_parallel: this config needs 2 GPUs, one per "
        "rank it runs here (tensor_parallel 2 x pipeline_parallel 1), and torch sees 1 "
    ), refused
    visible_gpus(2)
    assert start_refusals(dual) == []


def test_pipeline_layers_that_miss_the_stages_name_the_line(tmp_path: Path) -> None:
    path = write(tmp_path, "serving:\n  pipeline_parallel: 2\n  pipeline_layers: [30]\n")
    with pytest.raises(ConfigFileError) as info:
        load_config(path).to_engine_config()
    assert info.value.errors == [
        f"{path}:3: serving.pipeline_layers: [30] does not split the layers into "
        "pipeline_parallel=2 stages (expected 2 layer counts, each at least 1)"
    ]


def line_of(path: Path, needle: str) -> int:
    lines = path.read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.lstrip().startswith(needle))


# -- broken files --------------------------------------------------------------------------------
BROKEN = [
    (
        "unknown key",
        "serving:\n  model: x\n  max_seqs: 4\n",
        "3: serving.max_seqs: unknown key (expected one of: model, device,",
    ),
    (
        "unknown section",
        "api: {port: 1}\nserve: {}\n",
        "2: serve: unknown key (expected one of: serving, admission_control,",
    ),
    (
        "wrong type",
        "serving:\n  max_num_seqs: many\n",
        "2: serving.max_num_seqs: a string 'many' (expected an integer)",
    ),
    (
        "quoted number",
        "api:\n  host: 0.0.0.0\n  port: '8000'\n",
        "3: api.port: a string '8000' (expected an integer)",
    ),
    (
        "bool as string",
        "rules:\n  dry_run: maybe\n",
        "2: rules.dry_run: a string 'maybe' (expected true or false)",
    ),
    (
        "bad duration",
        "api:\n  drain_timeout: 30 sec\n",
        "2: api.drain_timeout: '30 sec' is not a duration (expected seconds as a number or a "
        "duration like '500ms', '30s', '5m', '2h', '90d')",
    ),
    (
        "negative duration",
        "monitoring: {nvml_poll_interval: -5}\n",
        "1: monitoring.nvml_poll_interval: -5 is negative (expected seconds",
    ),
    (
        "NVML poll faster than a rules interval may be",  # '5ms' for '5s': a busy loop
        "monitoring:\n  nvml_poll_interval: 5ms\n",
        "2: monitoring.nvml_poll_interval: 0.005s is too short (expected at least 50ms)",
    ),
    (
        "NVML poll of zero",
        "monitoring: {nvml_poll_interval: 0}\n",
        "1: monitoring.nvml_poll_interval: 0s is too short (expected at least 50ms)",
    ),
    (
        "bad size",
        "# budget\n\nserving:\n  kv_cache_bytes: 256 megs\n",
        "4: serving.kv_cache_bytes: '256 megs' is not a size (expected bytes as an integer or a "
        "size like '256MiB', '2GiB', '512MB')",
    ),
    (
        "bad enum",
        "serving:\n  kv_cache_dtype: fp8\n",
        "2: serving.kv_cache_dtype: 'fp8' is not allowed (expected 'auto', 'fp32', 'fp16', "
        "'bf16' or 'fp8_e4m3')",
    ),
    (
        "bad device",
        "serving:\n  device: gpu\n",
        "2: serving.device: 'gpu' is not a device (expected auto, cpu, cuda or cuda:N)",
    ),
    (
        "out of range",
        "serving:\n  gpu_memory_utilization: 1.5\n",
        "2: serving.gpu_memory_utilization: 1.5 is out of range (expected a value <= 1.0)",
    ),
    (
        "section not a mapping",  # YAML 1.2: `yes` is a string, only true/false are booleans
        "serving:\n  model: x\noffloading: yes\n",
        "3: offloading: a string 'yes' (expected a mapping of keys)",
    ),
    (
        "cross-field",
        "serving:\n  enable_chunked_prefill: false\n  max_num_batched_tokens: 512\n",
        "3: serving.max_num_batched_tokens: 512 < max_model_len 4096 with chunked prefill off "
        "(expected >= 4096, or enable_chunked_prefill: true)",
    ),
    (
        "chunking off over the default step budget",  # defaults are checked too
        "serving:\n  model: x\n  enable_chunked_prefill: false\n",
        "3: serving.enable_chunked_prefill: false leaves max_num_batched_tokens at its default "
        "2048, below max_model_len 4096: without chunked prefill a whole prompt must fit one "
        "step (expected max_num_batched_tokens: 4096 or more, or enable_chunked_prefill: true)",
    ),
    (
        "chunking off over a default max_model_len",
        "serving:\n  enable_chunked_prefill: false\n  max_num_batched_tokens: 1024\n",
        "3: serving.max_num_batched_tokens: 1024 < max_model_len 4096 with chunked prefill off",
    ),
    (
        "retention as a bare number of days",  # 90 seconds: the start's sweep would empty it
        "audit:\n  retention: 90\n",
        "2: audit.retention: 90 keeps 90 seconds of audit history, below the minimum of 1h (a "
        "bare number is seconds: write e.g. '90d' for 90 days; expected a duration of at least "
        "1h)",
    ),
    (
        "retention under an hour",
        "audit: {retention: 59m}\n",
        "1: audit.retention: '59m' keeps 3540 seconds of audit history, below the minimum of 1h",
    ),
    (
        "thresholds out of order",
        "recovery:\n  target_vram_usage: 0.9\n  throttle_threshold: 0.8\n",
        "3: recovery.throttle_threshold: 0.8 <= target_vram_usage 0.9 (expected a ratio above it)",
    ),
    (
        "duplicate key",
        "serving:\n  model: a\n  model: b\n",
        "3: serving.model: duplicate key (expected once; first given on line 2)",
    ),
    (
        "yaml syntax error",
        "serving:\n  model: x\n  max_num_seqs: [1, 2\napi: {}\n",
        "4: YAML syntax error: ",  # then libyaml's (or PyYAML's) own words
    ),
    (
        "bad indentation",
        "serving:\n  model: x\n   block_size: 16\n",
        "3: YAML syntax error: mapping values are not allowed",
    ),
    (
        "list at top level",
        "# a list by mistake\n- serving\n- api\n",
        "2: (top level): a list (expected a mapping of sections: serving, admission_control,",
    ),
    (
        "absurd batch",
        "serving:\n  max_num_seqs: 100000000000000000000000000\n",
        "2: serving.max_num_seqs: 100000000000000000000000000 is out of range (expected a value <= 1048576)",
    ),
    (
        "null value",
        "serving:\n  model:\n",
        "2: serving.model: null (expected a string)",
    ),
    (
        "scalar at top level",
        "serving\n",
        "1: (top level): a string 'serving' (expected a mapping of sections:",
    ),
    (
        "host with its port",  # the bind used to fail (exit 1, restarted for ever) naming no key
        "api:\n  host: localhost:8000\n",
        "2: api.host: 'localhost:8000' is not an address or host name (expected e.g. 127.0.0.1, "
        "0.0.0.0, ::, localhost; the port is api.port)",
    ),
    (
        "host as a URL",
        "api: {host: 'http://0.0.0.0'}\n",
        "1: api.host: 'http://0.0.0.0' is not an address or host name",
    ),
    (
        "host with a comment inside its quotes",
        "api:\n  port: 1\n  host: '0.0.0.0 # all'\n",
        "3: api.host: '0.0.0.0 # all' is not an address or host name",
    ),
    (
        "request size as a bare number of MiB",  # 16 bytes: every request answered 413
        "api:\n  max_request_bytes: 16\n",
        "2: api.max_request_bytes: 16 bytes is too small: no request fits (a bare number is "
        "bytes: write e.g. '16MiB'; expected at least 4KiB)",
    ),
    (
        "audit url that is no URL",
        "api: {port: 1}\naudit:\n  url: notaurl\n",
        "3: audit.url: 'notaurl' is not a database URL (expected e.g. sqlite:////",
    ),
    (
        "audit url of an unknown backend",
        "audit: {url: 'nosuchdb://h/x'}\n",
        "1: audit.url: nosuchdb://h/x: unknown database backend 'nosuchdb'",
    ),
    (
        "audit url of an unknown driver",
        "audit: {url: 'mysql+nosuchdriver://x/y'}\n",
        "1: audit.url: mysql+nosuchdriver://x/y: unknown database backend",
    ),
]


@pytest.mark.parametrize(("text", "expected"), [b[1:] for b in BROKEN], ids=[b[0] for b in BROKEN])
def test_broken_file_names_file_line_and_field(tmp_path: Path, text: str, expected: str) -> None:
    path = write(tmp_path, text)
    errors = errors_of(path)
    assert len(errors) == 1, errors
    assert errors[0].startswith(f"{path}:{expected}"), errors[0]


def test_every_error_in_a_file_is_listed_in_file_order(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        serving:
          model: smollm2-135m
          block_size: 12
          kv_cache_bytes: lots
        admission_control:
          safety_factor: 0.5
        api:
          port: 70000
          colour: blue
        audit:
          retention: forever
        """,
    )
    errors = errors_of(path)
    assert [e.split(": ")[0:2] for e in errors] == [
        [f"{path}:3", "serving.block_size"],
        [f"{path}:4", "serving.kv_cache_bytes"],
        [f"{path}:6", "admission_control.safety_factor"],
        [f"{path}:8", "api.port"],
        [f"{path}:9", "api.colour"],
        [f"{path}:11", "audit.retention"],
    ]


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.yaml"
    [error] = errors_of(path)
    assert error.startswith(f"{path}: cannot read the config file:")


def test_an_audit_url_without_its_driver_is_refused_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backend SQLAlchemy knows whose driver is not installed: named with the file's line
    at load, and `kvguard serve` stops there (status 2), before binding or loading."""
    from sqlalchemy.dialects.mysql.mysqldb import MySQLDialect_mysqldb

    def missing() -> None:
        raise ModuleNotFoundError("No module named 'MySQLdb'", name="MySQLdb")

    monkeypatch.setattr(MySQLDialect_mysqldb, "import_dbapi", classmethod(lambda cls: missing()))
    path = write(tmp_path, "serving: {model: no-such-model}\naudit: {url: 'mysql://x/y'}\n")
    assert errors_of(path) == [
        f"{path}:2: audit.url: mysql://x/y: its database driver is not installed (MySQLdb)"
    ]
    from tests.test_server import serve_refused

    for url in ("notaurl", "nosuchdb://x/y"):
        path.write_text(f"serving: {{model: no-such-model}}\naudit: {{url: '{url}'}}\n")
        proc = serve_refused(path)
        assert proc.returncode == 2, proc.stderr
        assert f"{path}:2: audit.url: " in proc.stderr and "no-such-model" not in proc.stderr


def test_a_prometheus_url_with_a_path_and_a_token_loads_and_what_no_query_reaches_is_refused(
    tmp_path: Path,
) -> None:
    """A Prometheus behind a proxy that wants `?token=` is served (rules/signals.py sends the
    parameters with every query). What no query could reach is refused with the file's line,
    and no refusal shows the URL's secrets: before, a `#` (which cuts a token short) and a
    `query=` parameter (which replaces every PromQL expression) loaded, and a URL without
    its scheme was echoed with its token in clear."""
    good = "http://promuser:PW@127.0.0.1:9090/prom/?token=QSECRET&org=a%2Fb"
    path = write(tmp_path, f"prometheus:\n  timeout: 1s\n  url: '{good}'\n")
    assert load_config(path).prometheus.url == good
    refused = {
        "http://127.0.0.1:9090/prom?token=QSE#CRET": "a '#' ends the URL, and nothing after it "
        "would reach Prometheus (expected no #fragment; write a '#' inside a parameter's value "
        "as %23)",
        "http://127.0.0.1:9090/?token=QSECRET&query=up": "the query parameter 'query' would "
        "replace the PromQL expression of every query (expected only the parameters a proxy in "
        "front of Prometheus needs, such as token=...)",
        "http://127.0.0.1:9090/?time=1700000000": "the query parameter 'time' would evaluate "
        "every query at that one instant instead of now (expected only the parameters a proxy "
        "in front of Prometheus needs, such as token=...)",
        "127.0.0.1:9090/prom?token=QSECRET": "'127.0.0.1:9090/prom?token=***' is not an "
        "http:// or https:// URL with a host (expected e.g. http://127.0.0.1:9090)",
        "ftp://u:PW@h/?token=QSECRET": "'ftp://u:***@h/?token=***' is not an http:// or "
        "https:// URL with a host (expected e.g. http://127.0.0.1:9090)",
    }
    for url, problem in refused.items():
        path.write_text(f"prometheus:\n  timeout: 1s\n  url: '{url}'\n")
        assert errors_of(path) == [f"{path}:3: prometheus.url: {problem}"]


def test_a_start_refuses_cross_key_problems_before_it_binds_the_port(tmp_path: Path) -> None:
    """What only shows across keys (or with a key left at its default) stops `kvguard serve`
    with the file's line, before the port is bound and the model looked for: chunked prefill
    off over the default step budget (the engine's own words after the bind, before), a CPU
    headroom larger than the KV budget, pipeline_layers that do not split the model."""
    from tests.test_server import serve_refused

    head = "serving:\n  model: no-such-model\n  device: cpu\n"
    for body, said in (
        ("  enable_chunked_prefill: false\n", "4: serving.enable_chunked_prefill: false leaves"),
        (
            "admission_control:\n  reserved_headroom_mb: 1000\n",
            "5: admission_control.reserved_headroom_mb: 1000 MiB leaves nothing of the 256 MiB",
        ),
        ("  pipeline_layers: [1, 1]\n", "4: serving.pipeline_layers: [1, 1] does not split"),
    ):
        path = write(tmp_path, head + body)
        proc = serve_refused(path)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 2, out
        assert f"kvguard: error: {path}:{said}" in proc.stderr, out
        # nothing loaded: the unknown model is at most one more line of the file's problems
        assert "API bound" not in out and "unknown model" not in out, out


def test_a_host_that_is_no_address_stops_the_start_with_its_line(tmp_path: Path) -> None:
    """`kvguard serve` refuses it as a bad file (exit 2: systemd does not restart what would
    fail again), before the bind; it used to fail at the bind with exit 1, naming no key."""
    from tests.test_server import serve_refused

    path = write(tmp_path, "serving: {model: tiny, device: cpu}\napi: {host: 'localhost:8000'}\n")
    proc = serve_refused(path)
    assert proc.returncode == 2, proc.stderr
    assert f"kvguard: error: {path}:2: api.host: 'localhost:8000' is not an" in proc.stderr
    assert "API bound" not in proc.stderr + proc.stdout and "cannot bind" not in proc.stderr


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0", "::", "::1", "localhost", "gpu-3.lan"])
def test_addresses_and_host_names_are_hosts(tmp_path: Path, host: str) -> None:
    assert load_config(write(tmp_path, f"api: {{host: '{host}'}}\n")).api.host == host


def test_relative_paths_are_relative_to_the_config_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The unit runs the daemon in its state directory: a relative `rules.path` (or keys,
    token, worker key file) is read beside the config file, whatever the working directory;
    one that cannot be read stops the start with the key, its line and the absolute path."""
    etc, state = tmp_path / "etc", tmp_path / "state"
    etc.mkdir()
    state.mkdir()
    monkeypatch.chdir(state)
    (etc / "rules.yaml").write_text((DAEMON.parent / "rules" / "default.yaml").read_text())
    (etc / "keys").mkdir()
    (etc / "keys" / "api.yaml").write_text("keys: []\n")
    path = etc / "config.yaml"
    path.write_text(
        "rules:\n  path: rules.yaml\napi:\n  api_keys_file: keys/api.yaml\n"
        "  admin_token_file: admin.token\n"
        "serving:\n  model: tiny\n  distributed: {authkey_file: ../worker.key}\n"
    )
    cfg = load_config(Path("..") / "etc" / "config.yaml")  # itself relative to the cwd
    assert cfg.rules.path == etc / "rules.yaml"
    assert cfg.api.api_keys_file == etc / "keys" / "api.yaml"
    assert cfg.api.admin_token_file == etc / "admin.token"
    assert cfg.serving.distributed.authkey_file == tmp_path / "worker.key"
    assert apply_overrides(cfg, port=1).rules.path == etc / "rules.yaml"
    cfg.check_start()  # both files are there
    absolute = write(tmp_path, f"rules: {{path: {etc / 'rules.yaml'}}}\n")
    assert load_config(absolute).rules.path == etc / "rules.yaml"
    from tests.test_server import serve_refused

    (etc / "rules.yaml").unlink()
    proc = serve_refused(path)
    assert proc.returncode == 2, proc.stderr
    assert (
        f"kvguard: error: {path}:2: rules.path: cannot read {etc / 'rules.yaml'}: No such file "
        "or directory"
    ) in proc.stderr, proc.stderr
    assert "API bound" not in proc.stderr and "loaded" not in proc.stderr


def test_a_relative_path_an_older_kvguard_read_from_the_working_directory_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Older kvguard read relative paths from the working directory. A config kept across the
    upgrade, whose `audit.url: sqlite:///audit.db` and `admin_token_file` name nothing beside
    it while those files are in the working directory, would start a new, empty audit database
    and turn the admin API off: it is refused, both paths and the fix named, at the load every
    consumer uses (start, reload, `kvguard audit --config`). With the files beside the config
    too, those are the ones; with neither, a new database is made beside the config."""
    from tests.test_audit import kvguard
    from tests.test_server import serve_refused

    etc, run = tmp_path / "etc", tmp_path / "run"
    etc.mkdir()
    run.mkdir()
    monkeypatch.chdir(run)  # the old daemon's working directory, and its files
    rc, _ = kvguard("db", "upgrade", "--db", f"sqlite:///{run / 'audit.db'}")
    assert rc == 0 and (run / "audit.db").is_file(), capsys.readouterr().err
    (run / "admin.token").write_text("secret\n")
    path = etc / "config.yaml"
    path.write_text(
        "serving: {model: tiny}\napi: {admin_token_file: admin.token}\n"
        "audit:\n  url: 'sqlite:///audit.db?timeout=5'\n"
    )
    why = (
        "relative paths in the config are read from the config file's folder (older kvguard "
        "read them from the working directory); to keep that file, write its path absolute"
    )
    assert errors_of(path) == [
        f"{path}:2: api.admin_token_file: admin.token names {etc / 'admin.token'}, which does "
        f"not exist, but {run / 'admin.token'} does: {why} ({run / 'admin.token'}), or move it "
        f"to {etc / 'admin.token'}",
        f"{path}:4: audit.url: sqlite:///audit.db?timeout=5 names {etc / 'audit.db'}, which "
        f"does not exist, but {run / 'audit.db'} does: {why} "
        f"(sqlite:///{run / 'audit.db'}?timeout=5), or move it to {etc / 'audit.db'}",
    ]
    proc = serve_refused(path)
    assert proc.returncode == 2, proc.stderr
    assert f"kvguard: error: {path}:2: api.admin_token_file: admin.token names" in proc.stderr
    assert f"\n{path}:4: audit.url: sqlite:///audit.db?timeout=5 names" in proc.stderr
    assert "API bound" not in proc.stderr
    capsys.readouterr()
    rc, out = kvguard("audit", "list", "--config", str(path))
    assert rc == 2 and f"{path}:2: api.admin_token_file: admin.token names" in (
        capsys.readouterr().err
    )
    assert not (etc / "audit.db").exists()  # no second, empty database

    # beside the config too: those are read, as they were before this check
    rc, _ = kvguard("db", "upgrade", "--db", f"sqlite:///{etc / 'audit.db'}")
    assert rc == 0
    (etc / "admin.token").write_text("secret\n")
    cfg = load_config(path)
    assert cfg.audit.url == f"sqlite:///{etc / 'audit.db'}?timeout=5"
    assert cfg.api.admin_token_file == etc / "admin.token"

    # in neither place: a first start, whose database is made beside the config
    for d in (etc, run):
        (d / "audit.db").unlink()
        (d / "admin.token").unlink()
    assert load_config(path).audit.url == f"sqlite:///{etc / 'audit.db'}?timeout=5"
    rc, _ = kvguard("db", "upgrade", "--config", str(path))
    assert rc == 0 and (etc / "audit.db").is_file() and not (run / "audit.db").exists()


def test_cpu_headroom_larger_than_the_budget_is_refused(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "serving: {device: cpu}\nadmission_control:\n  reserved_headroom_mb: 2048\n",
    )
    with pytest.raises(ConfigFileError) as info:
        load_config(path).to_engine_config()
    assert info.value.errors[0].startswith(
        f"{path}:3: admission_control.reserved_headroom_mb: 2048 MiB leaves nothing of the 256 MiB"
    )


# -- derived values ------------------------------------------------------------------------------
def test_audit_url_defaults_to_sqlite_in_the_state_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STATE_DIRECTORY", "/var/lib/kvguard:/var/lib/other")
    assert DaemonConfig().audit_url() == "sqlite:////var/lib/kvguard/audit.db"
    monkeypatch.delenv("STATE_DIRECTORY")
    monkeypatch.chdir(tmp_path)
    assert DaemonConfig().audit_url() == f"sqlite:///{tmp_path.resolve()}/var/audit.db"
    cfg = DaemonConfig.model_validate({"audit": {"url": "postgresql://db/kvguard"}})
    assert cfg.audit_url() == "postgresql://db/kvguard"


def test_the_cli_looks_for_the_systemd_daemons_database(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon's default is unchanged; the CLI (no $STATE_DIRECTORY in a shell) takes
    /var/lib/kvguard where a database is there, and $KVGUARD_STATE_DIR wins for both."""
    from kvguard.daemon import config

    system = tmp_path / "lib"
    system.mkdir()
    monkeypatch.setattr(config, "SYSTEMD_STATE_DIR", system)
    monkeypatch.delenv("STATE_DIRECTORY", raising=False)
    monkeypatch.delenv("KVGUARD_STATE_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    cfg, local = DaemonConfig(), f"sqlite:///{tmp_path.resolve()}/var/audit.db"
    assert cfg.audit_url(cli=True) == cfg.audit_url() == local  # none at /var/lib/kvguard
    (system / "audit.db").write_bytes(b"")
    assert cfg.audit_url(cli=True) == f"sqlite:///{system}/audit.db"
    assert cfg.audit_url() == local
    monkeypatch.setenv("KVGUARD_STATE_DIR", "mine")
    mine = f"sqlite:///{tmp_path.resolve()}/mine/audit.db"
    assert cfg.audit_url(cli=True) == cfg.audit_url() == mine
    monkeypatch.setenv("STATE_DIRECTORY", "/var/lib/kvguard")  # under systemd: its own
    assert cfg.audit_url(cli=True) == "sqlite:////var/lib/kvguard/audit.db"


def test_admin_token_comes_from_the_file_or_the_systemd_credential(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    assert DaemonConfig().api.admin_token_path() is None
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(tmp_path))
    assert DaemonConfig().api.admin_token_path() is None  # no credential: admin API off
    (tmp_path / "admin.token").write_text("s3cret\n")
    assert DaemonConfig().api.admin_token_path() == tmp_path / "admin.token"
    explicit = DaemonConfig.model_validate({"api": {"admin_token_file": "/etc/kvguard/t"}})
    assert explicit.api.admin_token_path() == Path("/etc/kvguard/t")


# -- command-line overrides ----------------------------------------------------------------------
def test_overrides_win_over_the_file(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "serving: {model: tiny, max_num_seqs: 4}\napi: {port: 9000}"))
    out = apply_overrides(cfg, model="smollm2-135m", host="0.0.0.0", port=8080, dry_run=True)
    assert (out.serving.model, out.serving.max_num_seqs) == ("smollm2-135m", 4)
    assert (out.api.host, out.api.port, out.rules.dry_run) == ("0.0.0.0", 8080, True)
    assert apply_overrides(cfg).model_dump() == cfg.model_dump()
    assert cfg.api.port == 9000  # the original is left alone


def test_bad_override_names_the_flag() -> None:
    with pytest.raises(ConfigFileError) as info:
        apply_overrides(DaemonConfig(), port=70000)
    assert info.value.errors == [
        "--port: api.port: 70000 is out of range (expected a value <= 65535)"
    ]


def test_overridden_config_still_points_at_file_lines(tmp_path: Path) -> None:
    path = write(tmp_path, "serving:\n  model: x\n  pipeline_layers: [0]\n")
    with pytest.raises(ConfigFileError) as info:
        apply_overrides(load_config(path), port=1).to_engine_config()
    assert info.value.errors[0].startswith(f"{path}:3: serving.pipeline_layers: [0] ")


def test_tensor_parallel_flag_overrides_the_file(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "serving: {model: tiny, tensor_parallel: 4}"))
    assert cfg.to_engine_config().tensor_parallel == 4
    assert apply_overrides(cfg, tensor_parallel=2).to_engine_config().tensor_parallel == 2
    with pytest.raises(ConfigFileError) as info:
        apply_overrides(cfg, tensor_parallel=0)
    assert info.value.errors == [
        "--tensor-parallel: serving.tensor_parallel: 0 is out of range (expected a value >= 1)"
    ]


# -- one definition of the engine's knobs --------------------------------------------------------
# How an operator sets each EngineConfig field (admission's nested ones included): the YAML, with
# a value unlike the default, and what the engine must then receive, in the engine's own unit.
KNOB_SAMPLES: dict[tuple[str, ...], tuple[dict[str, dict[str, object]], object]] = {
    ("model",): ({"serving": {"model": "tiny"}}, "tiny"),
    ("device",): ({"serving": {"device": "cuda:1"}}, "cuda:1"),
    ("dtype",): ({"serving": {"dtype": "bf16"}}, "bf16"),
    ("kv_cache_bytes",): ({"serving": {"kv_cache_bytes": "64MiB"}}, 64 * MiB),
    ("gpu_memory_utilization",): ({"serving": {"gpu_memory_utilization": 0.5}}, 0.5),
    ("block_size",): ({"serving": {"block_size": 32}}, 32),
    ("max_num_seqs",): ({"serving": {"max_num_seqs": 7}}, 7),
    ("max_model_len",): ({"serving": {"max_model_len": 1024}}, 1024),
    ("kv_cache_dtype",): ({"serving": {"kv_cache_dtype": "fp8_e4m3"}}, "fp8_e4m3"),
    ("enable_chunked_prefill",): (
        {"serving": {"enable_chunked_prefill": False, "max_num_batched_tokens": 4096}},
        False,
    ),
    ("max_num_batched_tokens",): ({"serving": {"max_num_batched_tokens": 512}}, 512),
    ("prefill_while_decoding",): ({"serving": {"prefill_while_decoding": 64}}, 64),
    ("num_threads",): ({"serving": {"num_threads": 3}}, 3),
    ("cuda_graphs",): ({"serving": {"cuda_graphs": True}}, True),
    ("enable_prefix_caching",): ({"serving": {"enable_prefix_caching": False}}, False),
    ("prefix_cache_exact",): ({"serving": {"prefix_cache_exact": True}}, True),
    ("num_gpu_blocks",): ({"serving": {"num_gpu_blocks": 100}}, 100),
    ("oom_quiet_period_s",): ({"serving": {"oom_quiet_period": "2m"}}, 120.0),
    ("tensor_parallel",): ({"serving": {"tensor_parallel": 2}}, 2),
    ("tensor_parallel_timeout_s",): ({"serving": {"tensor_parallel_timeout": "90s"}}, 90.0),
    ("pipeline_parallel",): ({"serving": {"pipeline_parallel": 2}}, 2),
    ("pipeline_layers",): (
        {"serving": {"pipeline_parallel": 2, "pipeline_layers": [20, 10]}},
        [20, 10],
    ),
    ("pipeline_micro_batches",): ({"serving": {"pipeline_micro_batches": 1}}, 1),
    ("distributed",): (
        {
            "serving": {
                "pipeline_parallel": 2,
                "distributed": {
                    "remote_ranks": [1],
                    "authkey_file": "/etc/kvguard/worker.key",
                    "join_timeout": "30s",
                },
            }
        },
        DistributedConfig(
            remote_ranks=(1,), authkey_file=Path("/etc/kvguard/worker.key"), join_timeout_s=30.0
        ),
    ),
    ("model_quantization",): ({"quantization": {"model_quantization": "none"}}, "none"),
    ("cpu_activations",): ({"quantization": {"cpu_activations": "int8"}}, "int8"),
    ("enable_cpu_offload",): ({"offloading": {"enable_cpu_offload": True}}, True),
    ("cpu_cache_ratio",): ({"offloading": {"cpu_cache_ratio": 0.25}}, 0.25),
    ("min_gpu_blocks",): ({"offloading": {"min_gpu_blocks": 64}}, 64),
    ("admission", "enable"): ({"admission_control": {"enable": False}}, False),
    ("admission", "safety_factor"): ({"admission_control": {"safety_factor": 1.5}}, 1.5),
    ("admission", "reserved_headroom_bytes"): (
        {"admission_control": {"reserved_headroom_mb": 16}},
        16 * MiB,
    ),
    ("admission", "dynamic_max_tokens"): (
        {"admission_control": {"dynamic_max_tokens": False}},
        False,
    ),
    ("admission", "max_queue"): ({"admission_control": {"max_queue": 9}}, 9),
    ("admission", "max_queue_wait_s"): ({"admission_control": {"max_queue_wait": "90s"}}, 90.0),
    ("admission", "high_priority_reserve"): (
        {"admission_control": {"high_priority_reserve": 0.3}},
        0.3,
    ),
    ("admission", "estimate"): ({"admission_control": {"estimate": "worst_case"}}, "worst_case"),
    ("admission", "estimate_quantile"): (
        {"admission_control": {"estimate_quantile": 0.8}},
        0.8,
    ),
    ("admission", "low_priority_delay_s"): (
        {"admission_control": {"low_priority_delay": "2500ms"}},
        2.5,
    ),
    ("interrupt_for_high",): ({"serving": {"interrupt_for_high": False}}, False),
    ("grammar_jump_forward",): ({"serving": {"grammar_jump_forward": False}}, False),
    ("decode_steps",): ({"serving": {"decode_steps": 4}}, 4),
    ("speculative_tokens",): ({"serving": {"speculative_tokens": 6}}, 6),
    ("speculative_ngram",): ({"serving": {"speculative_ngram": 2}}, 2),
    ("speculative_max_batch",): ({"serving": {"speculative_max_batch": 12}}, 12),
    ("speculative_row_cost",): ({"serving": {"speculative_row_cost": 0.5}}, 0.5),
    ("admission", "max_overcommit"): ({"admission_control": {"max_overcommit": 1.2}}, 1.2),
}
# EngineConfig fields with no key of their own in the file, and why.
NOT_IN_THE_FILE = {
    ("home",): "the model cache, from $KVGUARD_HOME (the unit file sets it)",
    ("admission",): "built from the admission_control section, field by field",
}
# Keys the file accepts for the seed's baselines but refuses to serve (see _unservable).
REFUSED_KEYS: set[tuple[str, str]] = set()
KNOB_SECTIONS = ("serving", "admission_control", "offloading", "quantization")


def engine_field_paths(cls: type = EngineConfig, prefix: tuple[str, ...] = ()) -> list[tuple]:
    """Every field of EngineConfig and of the admission config nested in it."""
    out: list[tuple[str, ...]] = []
    for f in dataclasses.fields(cls):
        out.append((*prefix, f.name))
        if f.name == "admission":
            out += engine_field_paths(AdmissionConfig, (*prefix, f.name))
    return out


@pytest.mark.parametrize("path", engine_field_paths(), ids=".".join)
def test_every_engine_field_is_set_from_the_file(tmp_path: Path, path: tuple[str, ...]) -> None:
    """A knob added to the engine but not to the file (or not passed on) is caught here."""
    if path in NOT_IN_THE_FILE:
        return
    assert path in KNOB_SAMPLES, f"EngineConfig.{'.'.join(path)}: no config-file key sets it"
    sections, expected = KNOB_SAMPLES[path]
    engine = load_config(write(tmp_path, yaml.safe_dump(sections))).to_engine_config()
    got = functools.reduce(getattr, path, engine)
    assert got == expected and type(got) is type(expected), (sections, got)


def test_every_file_key_of_the_engine_sections_reaches_the_engine() -> None:
    """The other direction: a key in serving/admission_control/offloading that nothing reads."""
    keys = {
        (section, key)
        for section in KNOB_SECTIONS
        for key in DaemonConfig.model_fields[section].annotation.model_fields
    }
    sampled = {
        (s, k) for sections, _ in KNOB_SAMPLES.values() for s in sections for k in sections[s]
    }
    assert keys - REFUSED_KEYS == sampled


def test_file_defaults_are_the_engine_defaults_unless_declared() -> None:
    """Units and defaults agree: an empty file gives the engine's own defaults, except the two
    the daemon sets for serving (512 hot GPU blocks, a headroom that depends on the device)."""
    cfg = DaemonConfig()
    engine = cfg.to_engine_config()
    library = EngineConfig(admission=AdmissionConfig())
    declared = {
        ("min_gpu_blocks",): 512,
        ("admission", "reserved_headroom_bytes"): cfg.reserved_headroom_mb() * MiB,
    }
    for path in engine_field_paths():
        if path in NOT_IN_THE_FILE:
            continue
        want = declared.get(path, functools.reduce(getattr, path, library))
        assert functools.reduce(getattr, path, engine) == want, path


def test_etc_config_names_every_engine_key() -> None:
    """Operators discover knobs in /etc/kvguard/config.yaml, so each one appears there."""
    text = ETC_CONFIG.read_text()
    for section in KNOB_SECTIONS:
        for key in DaemonConfig.model_fields[section].annotation.model_fields:
            if (section, key) not in REFUSED_KEYS:
                assert re.search(rf"^\s*#?\s*{key}:", text, re.M), f"{section}.{key}"


def test_status_with_an_empty_token_file_says_so(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    from kvguard.daemon.cli import main

    token = tmp_path / "admin.token"
    token.write_text("\n")
    assert main(["status", "--url", "http://127.0.0.1:9", "--token-file", str(token)]) == 2
    assert (
        capsys.readouterr().err
        == f"kvguard: error: {token} is empty: expected the daemon's admin token\n"
    )


def test_a_closed_pipe_ends_the_cli_quietly(tmp_path: Path) -> None:
    """`kvguard ... | head`: the reader has gone; no error line, the shell's code for SIGPIPE."""
    import subprocess
    import sys

    code = (
        "import os, sys\n"
        "from kvguard.daemon.cli import main\n"
        "r, w = os.pipe(); os.close(r); os.dup2(w, 1)\n"
        "sys.exit(main(['model', 'list', '--json']))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 141 and proc.stderr == "", proc.stderr


def test_the_briefs_inert_keys_load_and_are_named(tmp_path: Path) -> None:
    """The brief's recovery and monitoring thresholds load as written, and each one a file
    sets is named as changing nothing (the rules file decides); unset ones are not."""
    from kvguard.daemon.config import inert_keys, load_config

    assert inert_keys(load_config(write(tmp_path, "serving: {model: tiny}\n"))) == []
    cfg = load_config(
        write(
            tmp_path,
            "recovery:\n  target_vram_usage: 0.7\nmonitoring:\n  oom_alert_threshold: 0.9\n",
        )
    )
    said = inert_keys(cfg)
    assert [line.split(" ", 1)[0] for line in said] == [
        "recovery.target_vram_usage",
        "monitoring.oom_alert_threshold",
    ]
    assert all("has no effect in kvguard" in line for line in said)


def test_special_tokens_in_messages_is_allow_or_refuse_and_a_reload_applies_it(
    tmp_path: Path,
) -> None:
    """`api.special_tokens_in_messages`: allow (the default, as Hugging Face's templates and
    other servers serve such text) or refuse; anything else names the key and the choices. The
    chat API reads it from the config in force per request, and a reload applies it."""
    from kvguard.daemon.service import engine_changes

    assert load_config(None).api.special_tokens_in_messages == "allow"
    refuse = load_config(write(tmp_path, "api: {special_tokens_in_messages: refuse}\n"))
    assert refuse.api.special_tokens_in_messages == "refuse"
    errors = errors_of(write(tmp_path, "api: {special_tokens_in_messages: escape}\n"))
    assert len(errors) == 1 and "1: api.special_tokens_in_messages: " in errors[0], errors
    assert "'allow'" in errors[0] and "'refuse'" in errors[0], errors
    live, restart = engine_changes(load_config(None), refuse)
    assert live == [] and restart == []


def test_prefix_cache_exact_is_off_by_default_a_bool_and_waits_for_a_restart(
    tmp_path: Path,
) -> None:
    """`serving.prefix_cache_exact`: false by default (a follow-up turn reuses the blocks the
    previous answer filled), true makes every prefix-cache hit exact and reaches the engine's
    block manager; a value that is no boolean names the key; a reload lists a change as
    waiting for a restart."""
    from kvguard.daemon.service import engine_changes

    assert EngineConfig().prefix_cache_exact is False
    assert load_config(None).to_engine_config().prefix_cache_exact is False
    on = load_config(write(tmp_path, "serving: {prefix_cache_exact: true}\n"))
    assert on.to_engine_config().prefix_cache_exact is True
    engine = LLMEngine.from_config(
        EngineConfig(model="tiny", kv_cache_bytes="4MiB", prefix_cache_exact=True), progress=False
    )
    assert engine.block_manager.exact is True
    errors = errors_of(write(tmp_path, "serving: {prefix_cache_exact: sometimes}\n"))
    assert len(errors) == 1 and "1: serving.prefix_cache_exact: " in errors[0], errors
    live, restart = engine_changes(load_config(None), on)
    assert live == [] and restart == ["serving.prefix_cache_exact"]

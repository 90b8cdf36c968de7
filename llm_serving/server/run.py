"""The server process's life: load the tokenizer, start the engine (its agents), serve HTTP until SIGTERM or
SIGINT, then drain: refuse new requests, let those in flight finish within `serving_config.shutdown_grace_s`,
abort the rest (a second signal aborts at once), stop the engine and its agents. `llm-serving start` runs it
(cli.py) once the start-up decisions are made (startup/)."""
from __future__ import annotations

import asyncio
import importlib
import logging
import signal
import time

logger = logging.getLogger("llm_serving")


async def serve(config, model_dir: str, model_name: str, vocab_file: str, given=None, specs: tuple = ()) -> None:
    """Serve `model_name` (its config decided: `config`) and the other models `specs` lists (master/fleet.py's
    ModelSpecs, loaded when a request names them; `given`: the settings as given, which each of them is decided from)."""
    from aiohttp import web

    from llm_serving.hosts import is_loopback
    from llm_serving.master.engine import Engine
    from llm_serving.master import spare_agents
    from llm_serving.master.fleet import Fleet, ModelSpec
    from llm_serving.startup import decide
    from llm_serving.tokenization import load_tokenizer

    def prepare(model_config):
        decided, path, _, vocab = decide(model_config)
        return decided, path, load_tokenizer(path, vocab)

    tokenizer = load_tokenizer(model_dir, vocab_file)
    fleet = Fleet(given or config, [ModelSpec(model_name, model_dir), *specs], Engine, prepare,
                  start_spare=spare_agents.start)
    stop, force = asyncio.Event(), asyncio.Event()   # first SIGTERM/SIGINT drains, a second one aborts now
    loop = asyncio.get_running_loop()

    def on_signal(signame: str) -> None:
        if stop.is_set():
            logger.warning("%s again: aborting the requests in flight now", signame)
            force.set()
        else:
            logger.info("%s: shutting down", signame)
        stop.set()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig.name)
    runner = None
    try:
        start = asyncio.create_task(fleet.start((config, model_dir, tokenizer)))
        # the HTTP app's modules imported on a thread while the agents start (0.4 s not in front of their spawn)
        app_module = asyncio.create_task(asyncio.to_thread(importlib.import_module, "llm_serving.server.app"))
        waiter = asyncio.create_task(stop.wait())
        await asyncio.wait({start, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if not start.done():
            start.cancel()
            app_module.cancel()
            logger.info("stopped during start-up")
            return
        waiter.cancel()
        start.result()
        create_app = (await app_module).create_app

        sc = config.serving_config
        runner = web.AppRunner(create_app(fleet), handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, sc.server_ip, sc.server_port)
        await site.start()
        for sock in site._server.sockets:  # report the real port when 0 was asked for
            host, port = sock.getsockname()[:2]
            logger.info("serving model %r on http://%s:%d%s", model_name, host, port,
                        f" (and {len(specs)} more on demand: {', '.join(s.name for s in specs)})" if specs else "")
        if not sc.api_key and not is_loopback(sc.server_ip):
            logger.warning("the HTTP API listens on %s without an API key: anyone who can reach it may use it "
                           "(set LLM_SERVING_API_KEY or serving_config.api_key)", sc.server_ip)
        await stop.wait()
        await drain(fleet, sc.shutdown_grace_s, force)
    finally:
        if runner is not None:
            await runner.cleanup()
        await fleet.stop()
        spare_agents.close()


async def drain(fleet, grace_s: float, force: asyncio.Event) -> None:
    """Graceful shutdown: refuse new requests (503), let those in flight finish for up to grace_s (or until
    `force`), then abort the rest with the reason; their clients get a final event saying so. `fleet`: the server's
    models (master/fleet.py), every loaded one drained."""
    fleet.drain(f"server shutting down: no new requests; those in flight may finish within {grace_s:g} s")
    deadline = time.monotonic() + grace_s
    while fleet.requests and not force.is_set() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    aborted = fleet.abort_all("server shutting down: " + ("aborted by a second signal" if force.is_set() else
                              f"the {grace_s:g} s grace period (serving_config.shutdown_grace_s) ended"))
    logger.info("shut down: %d request(s) aborted", aborted)

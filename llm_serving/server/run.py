"""The server process's life: load the tokenizer, start the engine (its agents), serve HTTP until SIGTERM or
SIGINT, then drain: refuse new requests, let those in flight finish within `serving_config.shutdown_grace_s`,
abort the rest (a second signal aborts at once), stop the engine and its agents. `llm-serving start` runs it
(cli.py) once the start-up decisions are made (startup/)."""
from __future__ import annotations

import asyncio
import logging
import signal
import time

logger = logging.getLogger("llm_serving")


async def serve(config, model_dir: str, model_name: str, vocab_file: str) -> None:
    from aiohttp import web

    from llm_serving.hosts import is_loopback
    from llm_serving.master.engine import Engine
    from llm_serving.server.app import create_app
    from llm_serving.tokenization import load_tokenizer

    tokenizer = load_tokenizer(model_dir, vocab_file)
    engine = Engine(config, tokenizer, model_dir, model_name)
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
        start = asyncio.create_task(engine.start())
        waiter = asyncio.create_task(stop.wait())
        await asyncio.wait({start, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if not start.done():
            start.cancel()
            logger.info("stopped during start-up")
            return
        waiter.cancel()
        start.result()
        sc = config.serving_config
        runner = web.AppRunner(create_app(engine), handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, sc.server_ip, sc.server_port)
        await site.start()
        for sock in site._server.sockets:  # report the real port when 0 was asked for
            host, port = sock.getsockname()[:2]
            logger.info("serving model %r on http://%s:%d", model_name, host, port)
        if not sc.api_key and not is_loopback(sc.server_ip):
            logger.warning("the HTTP API listens on %s without an API key: anyone who can reach it may use it "
                           "(set LLM_SERVING_API_KEY or serving_config.api_key)", sc.server_ip)
        await stop.wait()
        await drain(engine, sc.shutdown_grace_s, force)
    finally:
        if runner is not None:
            await runner.cleanup()
        await engine.stop()


async def drain(engine, grace_s: float, force: asyncio.Event) -> None:
    """Graceful shutdown: refuse new requests (503), let those in flight finish for up to grace_s (or until
    `force`), then abort the rest with the reason; their clients get a final event saying so."""
    engine.drain(f"server shutting down: no new requests; those in flight may finish within {grace_s:g} s")
    deadline = time.monotonic() + grace_s
    while engine.requests and not force.is_set() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    aborted = engine.abort_all("server shutting down: " + ("aborted by a second signal" if force.is_set() else
                               f"the {grace_s:g} s grace period (serving_config.shutdown_grace_s) ended"))
    logger.info("shut down: %d request(s) aborted", aborted)

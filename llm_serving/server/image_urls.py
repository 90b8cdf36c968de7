"""Images given by URL: fetched by the server before the request is prepared, and only from the hosts the operator
lists (`serving_config.image_url_hosts`; empty, the default: every http(s) URL is a 400 that says to send the image
as a `data:` URL). A fetch follows no redirect, reads at most `max_image_bytes` and gives up after
`image_fetch_timeout_s`; each failure is a 400 naming the URL. An API's model leaves such an image as
`{"type": "image", "url": ...}` in its user turn; `fetch_images` makes it `{"type": "image", "image": bytes}`, the
form every other image has (server/translate.py)."""
from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

from llm_serving.server.errors import ValidationError

__all__ = ["fetch_images"]


def _url_parts(messages: list) -> list:
    return [part for m in messages if isinstance(m.get("content"), list)
            for part in m["content"] if isinstance(part, dict) and part.get("type") == "image" and "url" in part]


async def fetch_images(req, config) -> None:
    """Fetch the images `req.messages` (an ApiRequest's) gives by URL, in place of their URLs (new message dicts:
    a stored conversation's are not changed); a raw prompt's (`req.prompt_parts`: its errors name `inputs`) too."""
    if req.prompt_parts is not None:
        urls = [p["url"] for p in req.prompt_parts if isinstance(p, dict) and "url" in p]
        if urls:
            fetched = await _fetch_all(urls, config, "inputs")
            req.prompt_parts = [{"type": "image", "image": fetched[p["url"]]} if isinstance(p, dict) and "url" in p
                                else p for p in req.prompt_parts]
    if req.messages is None or not _url_parts(req.messages):
        return
    fetched = await _fetch_all([part["url"] for part in _url_parts(req.messages)], config, "messages")
    req.messages = [{**m, "content": [{"type": "image", "image": fetched[p["url"]]}
                                      if isinstance(p, dict) and p.get("type") == "image" and "url" in p else p
                                      for p in m["content"]]} if isinstance(m.get("content"), list) else m
                    for m in req.messages]


async def _fetch_all(urls: list, config, param: str) -> dict:
    """{url: its bytes} of each URL once, in turn; the first failure a ValidationError naming `param`."""
    sc = config.serving_config
    hosts = {h.lower() for h in sc.image_url_hosts}
    fetched: dict = {}
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=sc.image_fetch_timeout_s)) as session:
        for url in urls:
            if url not in fetched:
                fetched[url] = await _fetch(session, url, hosts, sc, param)
    return fetched


async def _fetch(session, url: str, hosts: set, sc, param: str) -> bytes:
    import aiohttp

    where = urlsplit(url)
    host = (where.hostname or "").lower()
    if not hosts:
        raise ValidationError(f"image URL {url!r}: images are not fetched on this server (serving_config."
                              "image_url_hosts is empty); send the image as a base64 data: URL", param=param)
    if where.scheme not in ("http", "https") or host not in hosts:
        raise ValidationError(f"image URL {url!r}: only http(s) URLs of the hosts in serving_config.image_url_hosts "
                              f"({', '.join(sorted(hosts))}) are fetched", param=param)
    cap = sc.max_image_bytes
    try:
        async with session.get(url, allow_redirects=False) as response:
            if response.status != 200:
                raise ValidationError(f"image URL {url!r} answered {response.status} (redirects are not "
                                      "followed)", param=param)
            data = bytearray()
            async for chunk in response.content.iter_chunked(1 << 16):
                data += chunk
                if len(data) > cap:
                    raise ValidationError(f"image URL {url!r}: the image has more than {cap} bytes "
                                          "(serving_config.max_image_bytes)", param=param)
            return bytes(data)
    except asyncio.TimeoutError:
        raise ValidationError(f"image URL {url!r} did not answer within {sc.image_fetch_timeout_s} s "
                              "(serving_config.image_fetch_timeout_s)", param=param) from None
    except aiohttp.ClientError as e:
        raise ValidationError(f"image URL {url!r} could not be fetched: {e}", param=param) from None

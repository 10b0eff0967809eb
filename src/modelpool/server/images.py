"""A request's images on the daemon's side, between its family's parser and the pool.

In the check thread (``settle_images``, beside the body's parse): the count and encoded
bytes against the model's ``image_limits``; a model that reads no images gets each image
replaced by a note (``[server] unsupported_images = "note"``, counted in the answer's
``x-modelpool-images-omitted`` header) or refuses them (``"refuse"``: 400
``model_not_multimodal``); an ``http(s)`` image URL whose host ``[server]
image_url_hosts`` does not list is a 400 ``remote_image_url``. On the event loop
(``fetch_images``): the allowed URLs fetched, each within ``image_fetch_timeout_s`` and
``max_bytes``, following a redirect only to an allowed host::

    settle_images(job, pool_config, server_config)      # in the check thread
    await fetch_images(job, server_config, pool_config.image_limits)
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping
from typing import Any, Final
from urllib.parse import urljoin, urlsplit

import httpx

from modelpool.server.core.job import Job
from modelpool.shared.config import PoolConfig, ServerConfig
from modelpool.shared.errors import ImageRefused
from modelpool.shared.image_input import check_image_limits, image_part, omit_images, part_name
from modelpool.shared.images import IMAGE_MEDIA_TYPES, ImageLimits, model_reads_images

IMAGES_OMITTED_HEADER: Final = "x-modelpool-images-omitted"
# Redirects followed from one image URL, each to an allowed host.
MAX_REDIRECTS: Final = 3
_REDIRECTS = frozenset({301, 302, 303, 307, 308})


def settle_images(job: Job, config: PoolConfig, server: ServerConfig) -> None:
    """The checks of a job's images that need neither decoding nor the network (see the
    module docstring); ``job.prompts`` and ``job.images_omitted`` are updated in place."""
    count = sum(
        check_image_limits(prompt, config.image_limits)
        for prompt in job.prompts
        if isinstance(prompt, list)
    )
    if not count:
        return
    if not model_reads_images(config.backend, config.model, config.backend_options):
        first = next(_images(job))
        if server.unsupported_images == "refuse":
            raise ImageRefused(
                f"{first[0]}: the model reads no images (a text-only model); send text only "
                '(the operator\'s [server] unsupported_images = "note" would replace each '
                "image with a note instead)",
                part=first[0],
                reason="model_not_multimodal",
            )
        omitted = 0
        for index, prompt in enumerate(job.prompts):
            if isinstance(prompt, list):
                job.prompts[index], number = omit_images(prompt)
                omitted += number
        job.images_omitted = omitted
        return
    allowed = {host.lower() for host in server.image_url_hosts}
    for where, part in _images(job):
        url = part.get("url")
        if isinstance(url, str) and _host(url) not in allowed:
            raise ImageRefused(
                f"{where}: remote image URLs are not fetched by this server ({_host(url)!r} "
                "is not an allowed host): send the image as a data: URL or base64, or ask "
                "the operator to list the host in [server] image_url_hosts",
                part=where,
                reason="remote_image_url",
            )


async def fetch_images(job: Job, server: ServerConfig, limits: ImageLimits) -> None:
    """Each pending (allowed) image URL of the job, fetched into its part in place."""
    pending = [(where, part) for where, part in _images(job) if "url" in part]
    if not pending:
        return
    timeout = httpx.Timeout(server.image_fetch_timeout_s)
    async with httpx.AsyncClient(follow_redirects=False, timeout=timeout) as client:
        for where, part in pending:
            try:
                async with asyncio.timeout(server.image_fetch_timeout_s):
                    data, declared = await _fetch(client, part["url"], where, server, limits)
            except TimeoutError:
                raise ImageRefused(
                    f"{where}: the image URL did not answer within "
                    f"{server.image_fetch_timeout_s:g} s ([server] image_fetch_timeout_s)",
                    part=where,
                    reason="image_fetch_failed",
                ) from None
            except httpx.HTTPError as exc:
                raise ImageRefused(
                    f"{where}: the image URL could not be fetched ({type(exc).__name__})",
                    part=where,
                    reason="image_fetch_failed",
                ) from None
            fetched = image_part(data, declared if declared in IMAGE_MEDIA_TYPES else None, where)
            part.clear()
            part.update(fetched)


async def _fetch(
    client: httpx.AsyncClient, url: str, where: str, server: ServerConfig, limits: ImageLimits
) -> tuple[bytes, str | None]:
    """The body of ``url`` (at most ``max_bytes``) and its declared media type."""
    allowed = {host.lower() for host in server.image_url_hosts}
    for _ in range(MAX_REDIRECTS + 1):
        async with client.stream("GET", url) as response:
            if response.status_code in _REDIRECTS and "location" in response.headers:
                url = urljoin(url, response.headers["location"])
                if urlsplit(url).scheme not in ("http", "https") or _host(url) not in allowed:
                    raise ImageRefused(
                        f"{where}: the image URL redirects to {_host(url)!r}, not an allowed "
                        "host ([server] image_url_hosts)",
                        part=where,
                        reason="remote_image_url",
                    )
                continue
            if response.status_code != 200:
                raise ImageRefused(
                    f"{where}: the image URL answered HTTP {response.status_code}",
                    part=where,
                    reason="image_fetch_failed",
                )
            chunks = []
            size = 0
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > limits.max_bytes:
                    raise ImageRefused(
                        f"{where}: the image at the URL is over the {limits.max_bytes} bytes "
                        "allowed (image_limits.max_bytes)",
                        part=where,
                        reason="image_too_large",
                    )
                chunks.append(chunk)
            declared = response.headers.get("content-type", "").partition(";")[0].strip()
            return b"".join(chunks), declared.lower() or None
    raise ImageRefused(
        f"{where}: the image URL redirects more than {MAX_REDIRECTS} times",
        part=where,
        reason="image_fetch_failed",
    )


def _images(job: Job) -> Iterator[tuple[str, dict[str, Any]]]:
    """Each image part of the job's prompts, with its name (the client's, when known)."""
    for prompt in job.prompts:
        if not isinstance(prompt, list):
            continue
        for message_index, message in enumerate(prompt):
            content = message.get("content") if isinstance(message, Mapping) else None
            if not isinstance(content, list):
                continue
            for index, part in enumerate(content):
                if isinstance(part, dict) and part.get("type") == "image":
                    yield part_name(part, message_index, index, "messages"), part


def _host(url: str) -> str:
    return (urlsplit(url).hostname or "").lower()

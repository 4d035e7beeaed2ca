"""Streamed responses served as ASGI wants them: through an asynchronous iterator.

Django's ASGI handler sends a ``StreamingHttpResponse`` with ``async for``. Given the synchronous iterator a view
or WhiteNoise hands it (a device's artifact download, ``training/api/device_views.py``; every static file), it
warns ("StreamingHttpResponse must consume synchronous iterators in order to serve them asynchronously") and reads
the whole body into a list in a thread before it sends the first byte: a 100 MB base model held in memory per
download. ``AsyncStreamingMiddleware`` gives such a response, when an ASGI server serves the request, an
asynchronous iterator that reads each chunk in a thread, so nothing warns and memory stays one chunk per download.
Under WSGI (and the test client) responses pass unchanged.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

from django.core.handlers.asgi import ASGIRequest
from django.http import StreamingHttpResponse

CHUNK = 256 * 1024
_DONE = object()


async def _read_file(filelike, chunk: int = CHUNK) -> AsyncIterator[bytes]:
    """A file's bytes from where it stands (a ``FileResponse``'s file, or WhiteNoise's slice of one for a range)."""
    while data := await asyncio.to_thread(filelike.read, chunk):
        yield data


async def _drain(iterator: Iterator) -> AsyncIterator:
    """A synchronous iterator's items, each taken in a thread (a generator may read storage or a socket)."""
    while (item := await asyncio.to_thread(next, iterator, _DONE)) is not _DONE:
        yield item


def make_async(response: StreamingHttpResponse) -> None:
    """Swap the response's synchronous iterator for an asynchronous one over the same bytes. What the response
    had to close at the end (the file, the view's generator) stays registered and is closed as before."""
    filelike = getattr(response, "file_to_stream", None)
    iterator = response._iterator  # the sync iterator Django made of the content (never read yet)
    response.streaming_content = _read_file(filelike) if filelike is not None else _drain(iterator)


class AsyncStreamingMiddleware:
    """Outermost, so it sees every response, WhiteNoise's static files included."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        response = self.get_response(request)
        if response.streaming and not response.is_async and isinstance(request, ASGIRequest):
            make_async(response)
        return response

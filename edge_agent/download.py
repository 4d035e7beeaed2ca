"""Resumable, verified downloads: bytes go to ``<name>.part``; an interrupted download continues with an
HTTP Range request; only a file whose size and sha256 match the manifest is moved into place."""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from edge_agent.manifest import verify_file

CHUNK = 256 * 1024


class DownloadError(Exception):
    pass


def download(
    url: str,
    destination: Path,
    *,
    sha256: str,
    size: int,
    headers: dict[str, str],
    progress: Callable[[int, int], None] | None = None,
    timeout: float = 60.0,
) -> Path:
    if not url.startswith(("http://", "https://")):
        raise DownloadError(f"not an http(s) URL: {url}")
    partial = destination.with_name(destination.name + ".part")
    destination.parent.mkdir(parents=True, exist_ok=True)
    have = partial.stat().st_size if partial.exists() else 0
    if have > size:
        partial.unlink()
        have = 0
    if have < size:
        request = urllib.request.Request(url, headers={**headers, **({"Range": f"bytes={have}-"} if have else {})})  # noqa: S310
        try:
            response = urllib.request.urlopen(request, timeout=timeout)  # noqa: S310
        except urllib.error.HTTPError as error:
            raise DownloadError(f"HTTP {error.code} for {url}: {error.read()[:300].decode(errors='replace')}") from None
        with response:
            if have and response.status != 206:
                have = 0  # the server ignored the range: start over
            with partial.open("ab" if have else "wb") as handle:
                while chunk := response.read(CHUNK):
                    handle.write(chunk)
                    have += len(chunk)
                    if have > size:
                        raise DownloadError(f"the server sent more than the {size} bytes the manifest promised")
                    if progress:
                        progress(have, size)
                handle.flush()
                os.fsync(handle.fileno())
    try:
        verify_file(partial, sha256=sha256, size=size)
    except Exception:
        partial.unlink(missing_ok=True)  # a corrupt partial must not poison the next attempt
        raise
    os.replace(partial, destination)
    return destination

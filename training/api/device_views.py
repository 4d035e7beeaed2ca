"""What devices fetch: artifacts by sha256, with HTTP Range so an interrupted download resumes."""

from __future__ import annotations

import re

from django.http import HttpResponse, StreamingHttpResponse
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework.views import APIView

from core.api.errors import ApiError
from devices.authentication import DeviceTokenAuthentication, IsDevice
from training.registry.blobs import blob_name, blob_open
from training.selectors import device_may_download

CHUNK = 256 * 1024
_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


def _stream(handle, start: int, length: int):
    try:
        handle.seek(start)
        remaining = length
        while remaining > 0:
            chunk = handle.read(min(CHUNK, remaining))
            if not chunk:
                break
            remaining -= len(chunk)
            yield chunk
    finally:
        handle.close()


class DeviceBlobView(APIView):
    """Download an artifact this device may run (base weights or an adapter version), by its sha256.

    Supports a single `Range: bytes=start-[end]` for resuming (206 / 416)."""

    authentication_classes = [DeviceTokenAuthentication]
    permission_classes = [IsDevice]

    @extend_schema(
        responses={
            (200, "application/octet-stream"): OpenApiResponse(description="the whole file"),
            (206, "application/octet-stream"): OpenApiResponse(description="the requested range"),
            416: OpenApiResponse(description="the range is not in the file (Content-Range names its size)"),
        }
    )
    def get(self, request, sha256: str):
        try:
            blob_name(sha256)
        except ValueError:
            raise ApiError("not_found", "No such artifact.", status_code=404) from None
        if not device_may_download(request.user.device, sha256):
            raise ApiError("not_found", "No such artifact for this device.", status_code=404)
        handle = blob_open(sha256)
        size = handle.size
        start, end = 0, size - 1
        status = 200
        header = request.headers.get("Range")
        if header:
            match = _RANGE.match(header.strip())
            if not match or int(match.group(1)) >= size:
                handle.close()
                response = HttpResponse(status=416)
                response["Content-Range"] = f"bytes */{size}"
                return response
            start = int(match.group(1))
            end = min(int(match.group(2)), size - 1) if match.group(2) else size - 1
            if end < start:
                handle.close()
                response = HttpResponse(status=416)
                response["Content-Range"] = f"bytes */{size}"
                return response
            status = 206
        length = end - start + 1
        response = StreamingHttpResponse(
            _stream(handle, start, length), status=status, content_type="application/octet-stream"
        )
        response["Content-Length"] = str(length)
        response["Accept-Ranges"] = "bytes"
        response["ETag"] = f'"{sha256}"'
        response["Cache-Control"] = "private, max-age=31536000, immutable"
        if status == 206:
            response["Content-Range"] = f"bytes {start}-{end}/{size}"
        return response

"""The API's JSON parser: DRF's, with the nesting limit of ``core.bounded_json``.

DRF's own parser lets a RecursionError out of ``json.load`` (a 500) for a body of a few kilobytes of ``[``;
this one answers 400 ``json_too_deep`` before parsing. It is the default parser (``REST_FRAMEWORK`` in
settings); a view that lists parsers of its own lists this one for JSON.
"""

from __future__ import annotations

from typing import Any

from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser, get_encoding
from rest_framework.utils import json as drf_json

from core import bounded_json
from core.api.errors import ApiError


class BoundedJSONParser(JSONParser):
    def parse(self, stream, media_type=None, parser_context=None) -> Any:
        encoding = get_encoding(parser_context or {})  # DRF's: text encodings only, never bz2_codec and the like
        try:
            text = stream.read().decode(encoding) if stream is not None else ""
            parse_constant = drf_json.strict_constant if self.strict else None
            return bounded_json.loads(text, parse_constant=parse_constant)
        except bounded_json.JSONTooDeep as exc:
            raise ApiError(
                "json_too_deep", f"JSON parse error - {exc}", details={"depth": exc.depth, "max_depth": exc.limit}
            ) from None
        except ValueError as exc:  # not JSON, not in the encoding, NaN or an infinity
            raise ParseError(f"JSON parse error - {exc}") from None

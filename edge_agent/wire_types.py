"""The device protocol's value types (hashes, keys, ids, times, metrics: each with the bounds and the description
the generated documents carry) and the bases of its models: a transport message ignores fields it does not define,
a signed object refuses them. The messages themselves are in ``edge_agent.wire``."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from edge_agent.protocol import MAX_DELTA_METRICS, METRIC_NAME_PATTERN, encode

# JSON numbers every language reads exactly: whole numbers within IEEE-754 doubles' exact range (RFC 8785).
MAX_SAFE_INTEGER = 2**53 - 1
MAX_CLASSES = 10_000  # a classifier's classes a manifest's per-class figures may name
EARLIEST_TIME = 946684800.0  # 2000-01-01T00:00:00Z: an epoch-seconds time before it is a broken clock


def _text(pattern: str, description: str) -> Any:
    """A string type of the wire: what it must match, and what the schema says it is."""
    return Annotated[str, StringConstraints(pattern=pattern), Field(description=description)]


Sha256Hex = _text(r"^[0-9a-f]{64}$", "sha256, 64 lowercase hex digits")
Signature = _text(r"^[A-Za-z0-9_-]{86}$", "Ed25519 signature (64 bytes) as base64url without padding: 86 characters")
PublicKey = _text(r"^[A-Za-z0-9_-]{43}$", "Ed25519 public key (32 bytes) as base64url without padding: 43 characters")
Nonce = _text(r"^[A-Za-z0-9_-]{43}$", "32 random bytes as base64url without padding: 43 characters")
DeviceId = _text(
    r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$",
    "the device's id: a UUID in lowercase hex with hyphens",
)
AdapterName = _text(
    r"^[-a-zA-Z0-9_]{1,64}$", "an adapter's name (not its id): letters, digits, - and _, 1 to 64 characters"
)
Whole = Annotated[int, Field(ge=0, le=MAX_SAFE_INTEGER)]
Positive = Annotated[int, Field(ge=1, le=2**31 - 1)]
Number = Annotated[float, Field(allow_inf_nan=False, description="a finite JSON number")]
EpochSeconds = Annotated[
    float,
    Field(
        ge=EARLIEST_TIME,
        le=32503680000.0,
        allow_inf_nan=False,
        description="a time in seconds since 1970-01-01T00:00:00Z (UTC)",
    ),
]
MetricName = Annotated[str, StringConstraints(pattern=f"^{METRIC_NAME_PATTERN}$")]
Metrics = Annotated[
    dict[MetricName, Number],
    Field(
        max_length=MAX_DELTA_METRICS,
        description="at most 32 named finite numbers (a name: a letter or _, then up to 63 of A-Z a-z 0-9 _ . : -)",
    ),
]


class _Model(BaseModel):
    def to_dict(self) -> dict[str, Any]:
        """The object as JSON-ready data, field names as they travel."""
        return self.model_dump(mode="json", by_alias=True)


class _Message(_Model):
    """A transport message: fields it does not define are ignored."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)

    def to_json(self) -> str:
        """The message as one text frame."""
        return encode(self.type, **self.model_dump(mode="json", by_alias=True, exclude={"type"}))


class _Signed(_Model):
    """An object a device signs: every field it has is signed, so one it does not define is refused."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

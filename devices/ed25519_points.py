"""Whether 32 bytes are an Ed25519 public key a device may hold: a canonical encoding of a point on the curve
that is not of small order.

OpenSSL (through ``cryptography``) takes any 32 bytes as a public key and verifies against it. With a
small-order key (the identity point ``01 00 .. 00``, the all-zero key, ...) a signature made without any
private key verifies for every message, so anyone who learns the device's id could act as it. The check
decodes the point as RFC 8032 section 5.1.3 says, then multiplies it by the cofactor 8: a point of small
order lands on the identity. Pure Python over integers, a few microseconds: run at enrollment and at every
signature check against an enrolled key.
"""

from __future__ import annotations

P = 2**255 - 19
D = -121665 * pow(121666, -1, P) % P
SQRT_MINUS_ONE = pow(2, (P - 1) // 4, P)

NON_CANONICAL = "non_canonical"
NOT_ON_CURVE = "not_on_curve"
SMALL_ORDER = "small_order"

# Why each refusal, in words an enrolling device's developer reads in the error message.
REASONS = {
    NON_CANONICAL: "its encoding is not canonical (y is not below 2^255 - 19, or x is 0 with the sign bit set)",
    NOT_ON_CURVE: "it does not decode to a point on the curve",
    SMALL_ORDER: "it is a point of small order, which a signature made without any private key verifies against",
}


def _decode(raw: bytes) -> tuple[int, int] | str:
    """The point ``(x, y)`` that ``raw`` encodes (RFC 8032, 5.1.3), or why it encodes none."""
    value = int.from_bytes(raw, "little")
    y, x_sign = value & ((1 << 255) - 1), value >> 255
    if y >= P:
        return NON_CANONICAL
    u, v = (y * y - 1) % P, (D * y * y + 1) % P
    x = u * pow(v, 3, P) * pow(u * pow(v, 7, P), (P - 5) // 8, P) % P
    root = v * x * x % P
    if root != u:
        if root != (-u) % P:
            return NOT_ON_CURVE
        x = x * SQRT_MINUS_ONE % P
    if x == 0 and x_sign:
        return NON_CANONICAL
    if x & 1 != x_sign:
        x = P - x
    return x, y


def _double(point: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
    """2P in extended coordinates (X, Y, Z, T), RFC 8032 section 5.1.4."""
    x, y, z, _ = point
    a, b, c = x * x % P, y * y % P, 2 * z * z % P
    h = (a + b) % P
    e = (h - (x + y) * (x + y)) % P
    g = (a - b) % P
    f = (c + g) % P
    return e * f % P, g * h % P, f * g % P, e * h % P


def public_key_refusal(raw: bytes) -> str | None:
    """Why ``raw`` (32 bytes) is not an Ed25519 public key to accept (a key of ``REASONS``), or None."""
    if len(raw) != 32:
        raise ValueError(f"an Ed25519 public key is 32 bytes, not {len(raw)}")
    decoded = _decode(raw)
    if isinstance(decoded, str):
        return decoded
    x, y = decoded
    point = (x, y, 1, x * y % P)
    for _ in range(3):
        point = _double(point)
    x8, y8, z8, _ = point
    if x8 == 0 and y8 == z8:  # [8]P is the identity (0, 1): P lies in the torsion subgroup
        return SMALL_ORDER
    return None

"""Names the agent did not choose (inbox file names above all), made safe to write into its log and terminal.

A file name may hold any character but ``/`` and NUL: a newline in one would start a forged log line
(``x.npz\n2026-01-01 [agent] inbox: stored 500 samples``), ESC opens an ANSI escape, U+202E reorders what
follows, and a name that is not UTF-8 (Python's surrogate escapes) cannot be written to a UTF-8 stream at all.
``visible`` writes every such character as a Python-style escape (``\\n``, ``\\x1b``, ``\\u202e``, ``\\udcff``)
and doubles a backslash, so the escapes it writes cannot be forged either.
"""

from __future__ import annotations

import re

# The C0 and C1 controls and DEL, ALM, LRM and RLM, the line and paragraph separators, the bidi embeddings,
# overrides and isolates, lone surrogates, and the backslash that starts an escape.
_ACTED_ON = re.compile("[\\\\\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\ud800-\udfff]")
_SHORT = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(found: re.Match) -> str:
    char = found.group()
    if char in _SHORT:
        return _SHORT[char]
    return f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}"


def visible(text: object) -> str:
    """``str(text)`` with every character a log viewer or terminal would act on written as an escape."""
    return _ACTED_ON.sub(_escape, str(text))

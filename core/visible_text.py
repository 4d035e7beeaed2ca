"""Text that operators read on a screen and in logs, supplied by someone else (a device's name, its labels).

Such text may not hold a character that a terminal, a log viewer or a browser acts on instead of showing: the
C0 and C1 control characters (newline, ESC that opens an ANSI escape, BEL, DEL, ...), the bidirectional
controls that reorder what follows (U+202E RIGHT-TO-LEFT OVERRIDE makes ``phone\u202egpj.exe`` read as
``phoneexe.jpg``) and the Unicode line separators. It is refused, never rewritten: the sender learns which
character and where, and what is stored is what was sent.
"""

from __future__ import annotations

import re
import unicodedata

# Cc (U+0000-001F, U+007F-009F), ALM, LRM and RLM, the line and paragraph separators, the embeddings and
# overrides (U+202A-202E) and the isolates (U+2066-2069).
_ACTED_ON = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]")


def control_character(text: str) -> str | None:
    """Where ``text`` first holds a character a screen or log acts on, in words (``U+202E (RIGHT-TO-LEFT
    OVERRIDE) at character 6``), or None when it holds none."""
    found = _ACTED_ON.search(text)
    if found is None:
        return None
    char = found.group()
    name = unicodedata.name(char, "") or "a control character"  # the Cc characters have no name in unicodedata
    return f"U+{ord(char):04X} ({name}) at character {found.start() + 1}"

"""The compiled loops of ``sum_kernel.c`` (the weighted sum's inner step, a read's sum of squares), or None where
the install built no extension (no C compiler: pyproject.toml marks it optional). Callers fall back to numpy
(the weighted sum: the same bytes) or torch (verification's norm, a float32 product per slice)."""

try:
    from . import sum_kernel
except ImportError:  # not built
    sum_kernel = None

__all__ = ["sum_kernel"]

"""The compiled loops of the server's aggregation workers (training/federation/strategies/sum_kernel.c: the mean
family's weighted sum, verification's sum of squares); everything else about the package is in pyproject.toml.

Optional: without a C compiler the install goes on and the workers use numpy and torch instead (the same
aggregated bytes, slower). -ffp-contract=off: no fused multiply-add, so the compiled loop rounds each product and
each sum as numpy's multiply then add do.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "training.federation.strategies.sum_kernel",
            sources=["training/federation/strategies/sum_kernel.c"],
            extra_compile_args=["-O3", "-ffp-contract=off"],
            optional=True,
        )
    ]
)

"""Build hook for the optional compiled gather (everything else is in pyproject.toml).

``mmapcache._region._cgather`` copies a batch of a variable-shape field in one C call. It is
optional: without a C compiler the build goes on without it and mmapcache reads
through its numpy fallback (``mmapcache.accelerated`` says which one is in use).
``MMAPCACHE_REQUIRE_EXTENSION=1`` makes it required: a build that cannot compile it
fails instead of installing the slower fallback silently (CI builds that way).
"""

import os

from setuptools import Extension, setup

REQUIRED = os.environ.get("MMAPCACHE_REQUIRE_EXTENSION", "0") not in ("", "0")

setup(
    ext_modules=[
        Extension(
            "mmapcache._region._cgather",
            sources=["mmapcache/_region/_cgather.c"],
            extra_compile_args=["-O2", "-Wall", "-Wextra"],
            optional=not REQUIRED,
        )
    ]
)

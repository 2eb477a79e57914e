"""Build hook for the optional compiled gather (everything else is in pyproject.toml).

``mmapcache._region._cgather`` copies a batch of a variable-shape field in one C call (and
computes a mixture's draws: ``_cdraws.c``, part of the same extension). It is
optional: without a C compiler the build goes on without it and mmapcache reads
through its numpy fallback (``mmapcache.accelerated`` says which one is in use).
``MMAPCACHE_REQUIRE_EXTENSION=1`` makes it required: a build that cannot compile it
fails instead of installing the slower fallback silently (CI builds that way).
"""

import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

REQUIRED = os.environ.get("MMAPCACHE_REQUIRE_EXTENSION", "0") not in ("", "0")


class NamedBuild(build_ext):
    """build_ext whose failure, when the extension is required, names the extension and what requires it."""

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as error:
            if ext.optional:
                raise
            raise SystemExit(
                f"error: the extension {ext.name} could not be built ({error}); MMAPCACHE_REQUIRE_EXTENSION=1 "
                "requires it: install a C compiler and the Python headers, or unset it to use the numpy fallback"
            ) from error


setup(
    cmdclass={"build_ext": NamedBuild},
    ext_modules=[
        Extension(
            "mmapcache._region._cgather",
            sources=["mmapcache/_region/_cgather.c", "mmapcache/_region/_cdraws.c"],
            depends=["mmapcache/_region/_cbuffers.h"],
            extra_compile_args=["-O2", "-Wall", "-Wextra"],
            optional=not REQUIRED,
        )
    ],
)

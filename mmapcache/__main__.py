"""``python -m mmapcache``: the same command line as the ``mmapcache`` console script."""

from .cli import main

raise SystemExit(main())

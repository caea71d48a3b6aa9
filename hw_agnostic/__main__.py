"""``python -m hw_agnostic COMMAND``: the same command line as ``hw-agnostic`` (see :mod:`hw_agnostic.cli`)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())

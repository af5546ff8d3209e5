"""``python -m torchdist_ext.bench``: see the package docstring or ``--help``."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())

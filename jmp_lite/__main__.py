"""``python -m jmp_lite demo``: the same as the ``jmp-lite`` console script."""

import sys

from jmp_lite.cli import main

if __name__ == "__main__":
    sys.exit(main())

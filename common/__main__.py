"""``python -m common``: the command line (see ``common.tools.cli``)."""

import sys

from common.tools.cli import main

if __name__ == "__main__":
    sys.exit(main())

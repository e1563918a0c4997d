"""``python -m posttune``: the ``posttune`` command, for an environment whose scripts are not on PATH."""

import sys

from posttune.cli.main import main

if __name__ == "__main__":
    sys.exit(main())

"""``python -m kvpolicy``: the command line (see ``kvpolicy.cli``)."""

import sys

from .cli import main

sys.exit(main())

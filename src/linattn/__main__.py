"""``python -m linattn`` (and ``torchrun -m linattn train ...``) runs the command line."""

import sys

from .cli import main

sys.exit(main())

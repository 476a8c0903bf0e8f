"""`python -m toolgym.configs.cli ...` (and `torchrun ... -m toolgym.configs.cli ...`) is `toolgym ...`."""

import sys

from .main import main

sys.exit(main())

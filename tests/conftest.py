"""Shared test settings: small thread counts so the suite behaves the same on 2-core CI."""

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

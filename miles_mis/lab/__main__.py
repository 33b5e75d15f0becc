"""``python -m miles_mis.lab [train] ...`` (what torchrun launches)."""

import sys

from .train import main

argv = sys.argv[1:]
if argv and argv[0] == "train":
    argv = argv[1:]
sys.exit(main(argv))

"""`python -m posttune.training.worker CONFIG [overrides]`: what torchrun starts on each rank."""

import sys

from posttune.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))

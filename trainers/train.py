"""`python -m trainers.train SPEC [--set key=value ...]`: what `ray job submit -- ...` runs."""

import sys

from trainers.cli import main

if __name__ == "__main__":
    sys.exit(main(["run", *sys.argv[1:]]))

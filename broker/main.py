"""`python broker/main.py [OPTIONS]` is `farm broker [OPTIONS]`; the code is farm/broker/."""

import sys

from farm.cli import main

if __name__ == "__main__":
    main(["broker", *sys.argv[1:]])

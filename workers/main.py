"""`python workers/main.py [OPTIONS]` is `farm worker [OPTIONS]`; the code is farm/workers/."""

import sys

from farm.cli import main

if __name__ == "__main__":
    main(["worker", *sys.argv[1:]])

"""``python -m farm`` runs the ``farm`` command."""

from farm.cli import main

if __name__ == "__main__":
    main(prog_name="farm")

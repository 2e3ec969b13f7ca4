"""``python -m gradindex``: the command line."""

from gradindex.cli import main

if __name__ == "__main__":
    main(prog_name="gradindex")

"""`python -m dataparallel ...`: the same as the `dataparallel` command."""

from dataparallel.launch.cli import main

if __name__ == "__main__":
    raise SystemExit(main())

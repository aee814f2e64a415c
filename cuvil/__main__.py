"""`python -m cuvil`: the same as the `cuvil` command."""

from cuvil.cli import main

if __name__ == "__main__":
    raise SystemExit(main())

"""python -m turnip {demo,info,plot,bench}: the command line (turnip/cli.py)."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())

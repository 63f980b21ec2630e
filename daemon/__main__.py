"""`python -m kvguard.daemon ...` runs the `kvguard` command: for a Python whose scripts folder
is not on PATH (a venv used without activating it, `pip install --user`). The `kvguard`
namespace itself is implicit (each code folder is mapped into it), so it holds no `__main__`
of its own."""

import sys

from kvguard.daemon.cli import main

if __name__ == "__main__":
    sys.exit(main())

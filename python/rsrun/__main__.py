"""``python -m rsrun ARGS``: runs the installed ``rsrun ARGS`` in this process's place."""

import os
import sys

from rsrun import find_bin


def main() -> None:
    try:
        exe = find_bin("rsrun")
    except FileNotFoundError as err:
        print(f"rsrun: error: {err}", file=sys.stderr)
        sys.exit(1)
    # Python workers run under this interpreter unless PYTHON_EXEC says otherwise, as torchrun's
    # run with sys.executable (a venv's python need not be on PATH).
    os.environ.setdefault("RSRUN_PYTHON_OF_MODULE", sys.executable)
    # exec, not a child: signals, the exit status and the terminal go to rsrun itself.
    os.execv(exe, ["rsrun", *sys.argv[1:]])


if __name__ == "__main__":
    main()

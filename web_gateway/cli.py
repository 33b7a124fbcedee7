"""`gateway`: placeholder until the HTTP gateway lands."""

import sys


def main() -> None:
    sys.stderr.write("gateway: the HTTP gateway is not built yet\n")
    sys.exit(2)

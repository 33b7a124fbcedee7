"""`broker`: inspect streams (placeholder until `broker status` lands)."""

import sys


def main() -> None:
    sys.stderr.write("broker: commands are not built yet\n")
    sys.exit(2)

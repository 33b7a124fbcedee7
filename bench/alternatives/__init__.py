"""The alternatives' servers, each run by the python of its own virtualenv (bench/venvs.py)."""

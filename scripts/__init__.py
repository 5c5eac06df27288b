"""The user commands behind `headstart` (scripts/cli.py); each also runs as `python scripts/NAME.py`."""

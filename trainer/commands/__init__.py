"""Every `dtrain` command, one module each (trainer/cli.py's COMMANDS imports the one that runs)."""

"""Studies that write the measured tables in docs/ (run as scripts: `python scripts/studies/NAME.py --help`)."""

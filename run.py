#!/usr/bin/env python
"""Entry point: ``python run.py --config_path configs/<model>.yaml`` (see README.md)."""

import sys

from analysis.cli import main

if __name__ == "__main__":
    sys.exit(main())

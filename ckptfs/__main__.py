"""`python -m ckptfs`: the same as the `ckptfs` command."""
import sys

from .cli import main

sys.exit(main())

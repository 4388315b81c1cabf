"""`python -m hf_grow.cli` is the `hf-grow` command, as `python -m hf_grow` is."""

import sys

from .commands import main


sys.exit(main())

"""`python -m hf_grow` is the `hf-grow` command."""

import sys

from .cli import main


sys.exit(main())

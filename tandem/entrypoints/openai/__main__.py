"""``python -m tandem.entrypoints.openai [MODEL] [flags]``: the server without the ``tandem`` CLI."""
import logging
import sys

from tandem.entrypoints.openai.serve import main

logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
sys.exit(main())

"""The package's one logger. Library code logs; only the CLI prints."""

import logging

logger = logging.getLogger("dynn_runtime")
logger.addHandler(logging.NullHandler())

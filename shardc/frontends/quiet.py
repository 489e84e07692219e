"""Keep the libraries' own chatter off stderr while a model is built and traced.

torch.export prints partial FX graphs to ``sys.stderr`` when it fails and logs through
``logging``; transformers logs warnings while it builds a model from a config. The command
line promises one line on stderr, so :func:`library_output_captured` swallows both for the
duration of a trace (the error that follows says what went wrong); ``SHARDC_DEBUG=1`` lets
everything through.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import warnings

from shardc.errors import debugging


@contextlib.contextmanager
def library_output_captured():
    """Within the block: Python-level writes to ``sys.stderr`` go to a buffer that is
    dropped, ``logging`` records up to ERROR are disabled and warnings are not shown.
    No-op under ``SHARDC_DEBUG=1``."""
    if debugging():
        yield
        return
    previous_disable = logging.root.manager.disable
    logging.disable(logging.ERROR)  # torch / transformers loggers bound to the real stderr
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(previous_disable)
        sys.stderr.flush()

"""Third-party noise, kept out of what a user reads unless asked for (``TUNEPACK_VERBOSE=1``).

Every run used to print torchao's version notice, DTensor and deprecation warnings, torchtune's
debug lines, a dataset progress bar and torchrun's banner and shutdown traceback around the few
lines tunepack itself writes. By default the trainer's processes drop other packages' warnings
and their log records below ERROR; ``tunepack train --verbose`` (which sets the variable) or
``TUNEPACK_VERBOSE=1`` in a TrainJob's env keeps everything. Errors always get through.
"""

from __future__ import annotations

import logging
import os
import warnings

VERBOSE_ENV = "TUNEPACK_VERBOSE"
OWN_LOGGER = "tunepack"


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "").strip().lower() not in ("", "0", "false", "no")


class _OwnOrSevere(logging.Filter):
    """Pass tunepack's own records and other packages' errors."""

    def filter(self, record: logging.LogRecord) -> bool:
        own = record.name == OWN_LOGGER or record.name.startswith(OWN_LOGGER + ".")
        return own or record.levelno >= logging.ERROR


def quiet() -> None:
    """Silence other packages' warnings and minor log records in this process, unless verbose.

    Call it before importing them (some, torchao, speak at import time) and again after: torch
    attaches a handler of its own to its logger when imported, which gets the filter then.
    """
    if verbose():
        return
    warnings.filterwarnings("ignore")
    warnings.filterwarnings("default", module=r"tunepack(\.|$)")
    # A filter on handlers, not levels on loggers: libraries set their own loggers' levels
    # (torchtune's at DEBUG). With a root handler in place first, torchtune's get_logger adds no
    # handler of its own.
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    loggers = [logging.getLogger()]
    loggers += [
        x for x in logging.root.manager.loggerDict.values() if isinstance(x, logging.Logger)
    ]
    for logger in loggers:
        for handler in logger.handlers:
            if not any(isinstance(f, _OwnOrSevere) for f in handler.filters):
                handler.addFilter(_OwnOrSevere())
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")

"""Deprecated: the tiny-model builders moved to `grouprl.tasks.testing`."""

import warnings

from grouprl.tasks.testing import *  # noqa: F401,F403

warnings.warn("grouprl.tasks.tiny is now grouprl.tasks.testing", DeprecationWarning, stacklevel=2)

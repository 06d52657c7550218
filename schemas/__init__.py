"""Wire and on-disk types of tierpipe: events on the bus and the shard file header.

Only msgspec types and their codecs live here; no I/O, no settings.
"""

from tierpipe.schemas import events, names, shard
from tierpipe.schemas.events import *  # noqa: F403
from tierpipe.schemas.names import *  # noqa: F403
from tierpipe.schemas.shard import *  # noqa: F403

__all__ = (*events.__all__, *names.__all__, *shard.__all__)

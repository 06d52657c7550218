"""Name tokens: the job and node names that become NATS subject tokens and path parts."""

from __future__ import annotations

from typing import Annotated

import msgspec

__all__ = ("TOKEN_PATTERN", "Token")

#: Job and node names: safe as a NATS subject token, a file name and a consumer-name part.
#: (`\Z`, not `$`: `$` also matches before a final line break, and a name with one would
#: inject a line into the NATS protocol.)
TOKEN_PATTERN = r"^[A-Za-z0-9_-]{1,64}\Z"  # noqa: S105 (not a secret)

Token = Annotated[str, msgspec.Meta(pattern=TOKEN_PATTERN)]

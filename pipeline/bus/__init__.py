"""The NATS boundary: every NATS and JetStream call of tierpipe goes through this package, and
nats-py's exceptions stop here (callers see `BusUnavailableError` and the rest of the error tree).

- `client`: `Bus`: publishing events, reading and watching a job's stream.
- `connection`: one NATS connection and its JetStream context (`Bus`'s base): connect options
  from the settings, connected, what a refusal means, watched while up, closed.
- `errors`: which nats-py exceptions mean an outage, and JetStream's errors as the error tree's.
- `kv`: a KV bucket (`Bucket`; the job states', the node records'): opened or bound, its keys
  read, written with compare-and-set and watched.
- `stream`: a job's stream, created or brought up to date in place.
- `history`: the stream read back: stored history, the newest event, a live view.
- `consumer`: the stages' durable pull consumers and how a worker stops taking messages.
- `batcher`: a stage's outputs reported per node, one batch per job and kind.
- `portal`: the trainer's `Bus` on its own event-loop thread (`BusPortal`).
"""

from tierpipe.bus.client import Bus, Published, redact_url
from tierpipe.bus.consumer import Msg
from tierpipe.bus.history import Raw, Stored, Watch
from tierpipe.bus.kv import Bucket, BucketConfig, Entry
from tierpipe.bus.portal import BusPortal

__all__ = (
    "Bucket", "BucketConfig", "Bus", "BusPortal", "Entry", "Msg", "Published", "Raw", "Stored",
    "Watch", "redact_url",
)  # fmt: skip

"""The dev harness: embedded servers (a nats-server and a SeaweedFS S3 store on loopback) and
`tierpipe demo` (`demo`; its simulated nodes and rank launches in `cluster`), and the
sharded-state example (`fsdp_tp`: FSDP2 + tensor parallel over gloo), for the tests, the
benchmarks and trying tierpipe on one machine.

Nothing in the library imports this package; only the CLI does (for `tierpipe demo`).
"""

from tierpipe.dev.nats import NatsServer
from tierpipe.dev.process import find_binary, free_ports
from tierpipe.dev.s3 import S3Server

__all__ = ("NatsServer", "S3Server", "find_binary", "free_ports")

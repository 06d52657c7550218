"""The object-storage tier: write-once multipart uploads and ranged downloads on any
S3-compatible store.

- `store`: `S3Store`, the tier's `ShardStore`: write, verify, read, delete, locate.
- `keys`: where a shard lives in a bucket (`object_key`, `parse_object_key`).
- `parts`: part uploads and ranged downloads: reads, checksums, paced bodies.
- `once`: what an object already at a key means: done, replaceable or a conflict.
- `commit`: the per-step commit objects that say a step is whole in the bucket.
- `uploads`: earlier and orphaned multipart uploads, aborted.
- `delete`: removals, only of what this job owns.
- `client`: the S3 client as the store calls it (`S3Client`), and its replies' types.
- `retry`: request pacing, concurrency limits and jittered retries.
- `errors`: botocore's errors translated into the error tree.
"""

from tierpipe.storage.s3.keys import ShardKey, object_key, parse_object_key
from tierpipe.storage.s3.store import S3Store, Uploaded

__all__ = ("S3Store", "ShardKey", "Uploaded", "object_key", "parse_object_key")

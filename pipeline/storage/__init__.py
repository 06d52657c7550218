"""Storage: every byte of a shard on disk and in the bucket.

- `store`: the contract both tiers keep (`ShardStore`: locate, write, verify, read_into, delete),
  and what a reader hands the bytes to (`BlobSink`).
- `nvme`: the node-local tier (`NvmeStore`): seal staged images into shard files, verify them.
- `placement`: a sealed file linked to its final path, never over another valid save.
- `s3`: the object-storage tier (`S3Store`): write-once multipart uploads, ranged downloads;
  `s3_parts` (part uploads and ranged downloads: reads, checksums, paced bodies), `s3_once`
  (what an object already at a key means: done, replaceable or a conflict), `s3_uploads`
  (earlier and orphaned multipart uploads aborted), `s3_errors` (botocore's errors translated).
- `reader`: shard files read back: the head, and the one read-and-hash engine that verify and
  restore share; `layout` (where the bytes land as they are read: scratch ring or arena).
- `shardfile`: standalone writers (`write_shard`) for tests, tools and benchmarks.
- `aligned`: O_DIRECT opens, aligned buffers, full-length pread/pwrite loops.
- `durable`: fsynced directories and removals, preallocation, out-of-space errors.
- `lock`: one agent per node and stage; the temp files of dead writers.
"""

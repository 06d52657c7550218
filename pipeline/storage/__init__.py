"""Storage: every byte of a shard on disk and in the bucket.

- `store`: the contract both tiers keep (`ShardStore`: locate, write, verify, read_into, delete),
  and what a reader hands the bytes to (`BlobSink`).
- `nvme`: the node-local tier (`NvmeStore`): seal staged images into shard files, verify them.
- `placement`: a sealed file linked to its final path, never over another valid save.
- `s3`: the object-storage tier (`S3Store`), a package: `store` (the tier), `client` (the typed
  S3 client it calls), `keys` (object keys),
  `parts` (part uploads and ranged downloads), `once` (what an object already at a key means),
  `commit` (per-step commit objects), `uploads` (earlier and orphaned multipart uploads aborted),
  `delete` (removals of what this job owns), `retry` (pacing, limits, retries), `errors`
  (botocore's errors translated).
- `staging`: the staging slots (host RAM, shared memory), the trainer's side: slots, markers,
  and a sealed image staged with its `staged` event (`stage_image`, `staged_event`).
- `staged_image`: a staging slot as the node agent sees it: mapped, proven unchanged, released.
- `shard`: the shard file format: prefix, header, slot generation, digests (a sharded tensor's
  blob also per 1 MiB block); `sharding` (a sharded tensor's placements and the box its shard is).
- `pinned`: page-locking host memory for CUDA copies (`cudaHostRegister`).
- `reader`: shard files read back: the head, and the one read-and-hash engine that verify and
  restore share; `layout` (where the bytes land as they are read: scratch ring or arena).
- `shardfile`: standalone writers (`write_shard`) for tests, tools and benchmarks.
- `aligned`: O_DIRECT opens, aligned buffers, full-length pread/pwrite loops.
- `durable`: fsynced directories and removals, preallocation, out-of-space errors.
- `lock`: one agent per node and stage; the temp files of dead writers.
- `resources`: running out of memory, descriptors or threads, named as an outage, never as a
  verdict on the copy.
"""

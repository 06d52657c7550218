"""The peer tier: copies of a node's verified shards on partner nodes' NVMe, moved agent to agent.

- `ring`: which nodes are a node's partners (the same rule on every node);
- `replicas`: the replicas a node holds for its partners, under `<nvme_root>/.peer/`;
- `landing`: the receiving end of one replica copy (read, written, every digest checked);
- `server`: the agent's peer endpoint (serves its copies and replicas, receives replicas);
- `client`: the endpoint's HTTP client (ask a partner to replicate, fetch a shard to a file);
- `reader`: a shard read back from a peer's endpoint during a restore, every digest checked.
"""

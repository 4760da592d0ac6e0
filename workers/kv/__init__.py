"""KV tier storage (ARCHITECTURE §4): L1 node-local host memory shared by the node's processes, L2 a remote store
(Valkey by default; LMCache or Mooncake Store plug in behind `KvStore`), and the manager that moves snapshots
between them by the LRU policy of `pipeline.kv.tiers`."""

"""Node policies: which node of a rack gets a batch (or, for per-request policies, a request).

One file per policy, all behind `NodePolicy` (base.py); `registry.make_node_policy` builds one by name. They are the
baselines our users compare (round robin, random, least outstanding, power of two choices, static weights), the
seed's live weight W (`weighted`) and a KV/prefix-aware cost (`kv_aware`).
"""

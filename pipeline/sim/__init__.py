"""Discrete-event simulator of a rackflow cluster (ARCHITECTURE §8): virtual clock, the SAME router, batcher,
node-policy, health and failover objects as the live services, an engine model per node driven by the calibrated
cost model, real traces. Pure: it reads no clock and opens no file; the CLI feeds it parsed traces and config."""

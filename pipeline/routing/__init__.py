"""Routing policies: request -> rack (router) and batch -> node (batcher). One file per policy, a registry by name."""

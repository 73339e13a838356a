"""Sharding: FSDP's precision policies and per-rank arithmetic, and FSDP2 (``fully_shard``) modules
estimated per rank.
"""

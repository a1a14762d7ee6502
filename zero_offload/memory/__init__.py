"""Pools and the tiered memory manager."""

"""Offloading optimizers."""

"""Sharding strategies behind one registry (see registry.py)."""

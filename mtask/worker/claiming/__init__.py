"""Claiming (River's producer): which due keys to claim, the cluster-wide limits and groups
decided before a claim, and the claim calls themselves; each claimed document is handed to
the run side through ``running.protocols.RunStarter``."""

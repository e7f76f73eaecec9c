"""The worker role (installed as ``farm.workers``)."""

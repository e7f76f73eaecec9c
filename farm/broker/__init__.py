"""The broker role (installed as ``farm.broker``)."""

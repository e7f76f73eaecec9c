"""Policies and the broker's ``FarmState`` on simulated devices: ``simulator`` runs a job in
virtual time, ``scenarios`` describes farms and jobs to run it on."""

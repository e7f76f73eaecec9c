"""Running farms: ``local`` starts a broker and pinned workers on this machine, ``deploy``
and ``slurm`` write supervisord and Slurm deployments, ``keys`` sets up CurveZMQ,
``config`` reads the configuration file, ``logs`` formats log lines."""

"""``farm bench``: the paper's experiments on this machine, and farm beside its peers.

``setups`` says what the suite runs on (this machine and the farms it builds),
``measure`` runs farm jobs (standalone speeds, Table 2, every policy), ``peers``
runs the same model on the same images the ways users would otherwise pick
(OpenCV's own threads, a process pool, Ray Data), ``results`` writes CSV, PNG
and a Markdown report, and ``suite`` puts them in order.
"""

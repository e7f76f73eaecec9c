"""Every default of farm, in one place.

The broker's and workers' configurations, the ``farm`` command's options, a
local farm and ``farm deploy`` all read their defaults here, so that a default
changes in one line and every part of farm agrees on it.
"""

#: Where a broker binds, and where workers and clients connect, unless told otherwise.
BROKER_ENDPOINT = "tcp://127.0.0.1:5555"
#: A broker's scheduling policy (also a local farm's and a deployment's).
POLICY = "equal-finish"
#: Seconds between heartbeats on every link (broker to worker, broker to client).
HEARTBEAT = 1.0
#: The heartbeat intervals a peer may ask for, in seconds.
MIN_HEARTBEAT, MAX_HEARTBEAT = 0.01, 60.0
#: Heartbeats a peer may miss before it is declared gone.
LIVENESS = 5
#: Charged attempts (a FAILED, or its worker died computing it) that make a chunk suspect
#: even on one device; a single image so charged by itself is reported failed.  Charges on
#: two distinct devices make it suspect sooner (farm/broker/blame.py).
MAX_ATTEMPTS = 3
#: Runs of one item, for any reason (lost workers included), before it is given up.
MAX_RUNS = 50
#: How jobs of equal priority share workers: "fair" (fewest chunks held first) or "fifo".
SHARING = "fair"
#: Cap on a chunk, in seconds of compute once speeds are known (0: no cap).
MAX_CHUNK_SECONDS = 1.0
#: Backup attempts (farm/broker/backups.py): the most extra work a job's backups may
#: add, as a share of its images (0: none).  MapReduce's backups cost "a few percent"
#: (OSDI 2004); Dolly's clones 3-5% (NSDI 2013).
BACKUP_SHARE = 0.05
#: Address the broker's Prometheus endpoint listens on, when it has a port.
METRICS_HOST = "127.0.0.1"
#: Chunks the broker may keep in flight to one worker: one computing and one waiting on a
#: core; a GPU worker gets one more, so that a chunk is queued even while the reply of the
#: last one and the request for the next are on the wire.
SLOTS, GPU_SLOTS = 2, 3
#: A worker's inference library: auto times the installed ones and keeps the fastest.
BACKEND = "auto"
#: Compute precision of workers and engines.
PRECISION = "f32"
#: ``--precision auto``: the top-1 agreement with f32, in percent, a lower precision needs,
#: and the job's first images it is checked on when ``--validate`` names none.  99.5, not
#: 99.9: on 300 images one changed answer moves the agreement by 0.33%, so 99.9% would
#: mean "none changed", which a cascade's margin, checked on images it was not fitted
#: on, cannot show (docs/precision.md, "Cascades").
MIN_AGREEMENT, VALIDATION_IMAGES = 99.5, 300
#: ``farm models quantize``: calibration images taken from the start of IMAGES.
CALIBRATION_IMAGES = 300
#: Key names in a `farm keys` folder: a worker's and a client's.
WORKER_KEY, CLIENT_KEY = "worker", "client"
#: Model a command runs when none is named.
MODEL = "lenet"
#: A job's priority (higher gets free workers first).
PRIORITY = 0
#: Seconds of broker silence before a client gives up.
CLIENT_TIMEOUT = 60.0
#: Seconds without a job after which a ``farm up`` farm stops by itself.
LOCAL_IDLE_TIMEOUT = 300.0
#: Logging threshold of the services (broker, worker), and of every other command.
SERVICE_LOG_LEVEL, LOG_LEVEL = "INFO", "WARNING"
#: Log lines for people ("text") or for log shippers ("json").
LOG_FORMAT = "text"
#: Folder of a supervised farm's control socket, pidfile and logs.
RUN_DIR = "/tmp/farm"
#: `farm bench`: the models it measures, images per job, and rounds of farm against its peers.
BENCH_MODELS = ("lenet", "cifar10_quick")
BENCH_IMAGES = 100_000
BENCH_PEER_ROUNDS = 3
#: The image formats the workers decode (``farm.engines.images``), as messages name them.
DECODED_FORMATS = ("JPEG", "PNG", "BMP", "TIFF", "WebP", "GIF", "PNM")

"""farm: Caffe-model inference spread over every core and GPU, scheduled so no device idles."""

from farm.client import Client, FarmError, FarmTimeout, JobResult
from farm.summary import JobSummary

__all__ = ["Client", "FarmError", "FarmTimeout", "JobResult", "JobSummary"]
__version__ = "0.1.0"

"""The SGLang paper's workloads as frontend programs (``programs``), their traces for
``radixkv sim`` (``recorder``), and the end-to-end benchmark that ``radixkv bench`` runs
(``bench``). Part of the installed package: no source checkout needed."""

from radixkv.workloads.programs import FULL, SMALL, TINY, WORKLOADS, Scale, Workload, make, run
from radixkv.workloads.recorder import RecordingBackend, export_trace, record, trace

SCALES = {"full": FULL, "small": SMALL, "tiny": TINY}

__all__ = ["FULL", "SCALES", "SMALL", "TINY", "WORKLOADS", "RecordingBackend", "Scale", "Workload", "export_trace",
           "make", "record", "run", "trace"]  # fmt: skip

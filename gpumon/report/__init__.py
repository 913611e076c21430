"""`gpumon report`: one self-contained HTML page of a run in pictures.

A run is read from a recording (``gpumon agent --record``, replayed through the verdict engine
``gpumon classify`` uses) or from a Prometheus-compatible server's range queries, into one
model of the run (``model.py``) that the page (``page.py``) draws. Both sources fill the same
model, so the page never knows where its numbers came from.
"""

from gpumon.report.model import ReportError, RunModel

__all__ = ["ReportError", "RunModel"]

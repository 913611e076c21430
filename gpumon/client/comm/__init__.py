"""The client's communication room: what a process's collectives and point-to-point transfers
cost each step, whichever framework issues them.

- ``tapped``: the one table of what is tapped, and how each call names its payload.
- ``tap``: ``torch.distributed``'s functions wrapped once per process (collectives, ``send``,
  ``recv``, ``isend``, ``irecv``, ``batch_isend_irecv``), and the waits on their works.
- ``functional``: the functional collectives DTensor, tensor and sequence parallelism issue
  (``torch.distributed._functional_collectives``), and their ``wait_tensor``.
- ``ledger``: each step's accounting, the monitor's step extension (``CommLedger``).
- ``ops``, ``intervals``, ``device``: an operation and a wait, interval arithmetic, and the
  same figures from CUDA events on a GPU.

Above the core (it reports launches to ``core.comm_inflight``), below the framework watchers
(DDP, FSDP, DeepSpeed), which attach a ledger to a monitor and say what else to time.
"""

"""What the agent holds between collection and scrape: the node, the ranks, their collectives
and the recording's status (docs/architecture.md §2). Written by the agent, read as copies by
the exporter; imports only ``gpumon.wire``, ``gpumon.analysis`` and two plain modules of
``gpumon.collectors`` (``samples``, ``sender_shares``).
"""

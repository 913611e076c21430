"""Collectors: each reads one source (NVML, the host, the ingest socket) into plain samples."""

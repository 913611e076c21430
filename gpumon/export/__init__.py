"""Agent state to Prometheus metric families, and the HTTP server that serves them."""

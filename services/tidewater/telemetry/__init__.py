"""OpenTelemetry for every Tidewater process: metrics (a Prometheus scrape endpoint) and
tracing."""

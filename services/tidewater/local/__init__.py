"""Running Tidewater processes on one machine: supervision, the demo."""

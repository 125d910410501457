"""gRPC plumbing shared by every Tidewater server and client."""

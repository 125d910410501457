"""Generated gRPC code for package tidewater.v1 (python -m tidewater.devtools.protogen)."""

"""The client commands of the `tidewater` CLI (topics, produce, consume, bench), each a thin
layer over the SDK in `tidewater.client`."""

"""The Python client SDK: an asyncio Producer, Consumer and Admin, and blocking facades in
`tidewater.client.sync`."""

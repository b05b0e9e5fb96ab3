"""The gateway: mitmproxy with the polar addon, in-process."""

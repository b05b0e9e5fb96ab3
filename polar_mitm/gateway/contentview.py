"""mitmproxy content view for LLM API bodies (filled in by the debugging work)."""


def register() -> None:
    pass

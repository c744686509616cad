"""OpenAI-compatible gateway in front of prefill/decode (or colocated) instances.

Entry: `python -m router` (router.__main__); embedding: `router.app.build_app(RouterConfig(...))`.
"""

"""First-party pd-middleware plugins.

The core never imports this package: it finds these plugins through the entry-point
group ``pd_middleware.plugins`` declared in ``pyproject.toml``, exactly as it finds a
third party's.
"""
